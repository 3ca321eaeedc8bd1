"""The ``prepare`` stage: read every source once, write its examples to the prepared store
(:mod:`pipeline.data.store`: messages, image references, token ids; never the images), hold out a
seeded split, surface every bad record before any training starts, write the manifest.

``data/manifest.json`` per source: role (``finetune``, ``warmup``, ``unseen`` or ``retention``,
see :mod:`pipeline.data.sources`), format, store folder, examples, held-out indices, train/held-out
tokens, supervised tokens, the cap its entry set (``max_examples``), truncated and skipped counts,
its shards' digest, and the files it was read from (sizes and times: a later stage refuses rows
whose files changed).
Eval-only sources (unseen, retention) are held out whole: they never train. Train tokens are the
token-weighted merge's weights and the split planner's balance.

The work is split in tasks (:class:`~pipeline.data.sources.Task`: an entry, or one subset of a hub
mixture), run side by side in ``data.prepare_processes`` processes. A task streams its records,
counts each example's tokens from its images' sizes (:meth:`Encoder.encode_counted`: no image
decoded), and writes ``data/store/tasks/<task>.json`` when its sources are whole: a prepare stopped
halfway (a kill, a bad record) prepares again only the tasks it had not finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import shutil
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
from tqdm.auto import tqdm

from pipeline.checkpoint import sha256_file, write_json_atomic
from pipeline.config import RunConfig
from pipeline.data.benchmark import write_tasks
from pipeline.data.encode import Encoder
from pipeline.data.example import DataError, Example
from pipeline.data.hub import local_datasets
from pipeline.data.manifest import MANIFEST_PATH, active_sources, read_manifest
from pipeline.data.sources import EVAL_ROLES, Policy, Task, no_examples, no_source, source_tasks
from pipeline.data.store import STORE_DIR, SourceStore, StoredExamples, StoreWriter, store_folder

TASKS_DIR = STORE_DIR / "tasks"
ENCODE_BATCH = 32
SKIPPED_SHOWN = 5  # reasons kept per source in the manifest; the count is always exact
LISTS = ("data.sources", "warmup.sources", "eval.sources")


def heldout_indices(n: int, fraction: float, seed: int, source: str) -> list[int]:
    """A seeded choice of held-out positions; at least one when the fraction is positive,
    never all of them (a source must keep something to train on)."""
    if fraction <= 0 or n < 2:
        return []
    k = min(max(1, round(fraction * n)), n - 1)
    return sorted(random.Random(f"{seed}/heldout/{source}").sample(range(n), k))


def data_digest(cfg: RunConfig) -> str:
    """What the prepared data depends on: the seed (it draws the built-in corpus and the split),
    the data and model (the processor) sections, and the warm-up and eval sources; not how many
    processes prepare it."""
    lists = [[spec.model_dump(mode="json") for spec in specs] for specs in (cfg.warmup.sources or [], cfg.eval.sources)]
    data = cfg.data.model_copy(update={"prepare_processes": None})
    same = cfg.model_copy(update={"data": data})
    return hashlib.sha256(json.dumps([same.digest("run", "data", "model"), lists]).encode()).hexdigest()[:16]


def prepare_data(cfg: RunConfig, run_dir: str | Path, processor: Any, force: bool = False) -> dict[str, Any]:
    """Write ``run_dir/data/manifest.json`` and the toy benchmark tasks ``eval.benchmarks`` names;
    reuse what is up to date."""
    write_tasks(cfg, run_dir)
    return _prepare_sources(cfg, Path(run_dir), processor, force)


def _prepare_sources(cfg: RunConfig, run_dir: Path, processor: Any, force: bool) -> dict[str, Any]:
    path = run_dir / MANIFEST_PATH
    digest = data_digest(cfg)
    if path.is_file() and not force:
        manifest = json.loads(path.read_text())
        if manifest.get("config_digest") == digest:
            return manifest
    tasks = source_tasks(cfg.data, cfg.warmup.sources, cfg.eval.sources)
    results = _run_tasks(tasks, cfg, run_dir, Encoder(processor, cfg.data.max_length), digest, force)
    budget = cfg.train.max_tokens if cfg.train.packing else None  # a packed micro batch's tokens
    sources: dict[str, Any] = {}
    for listed in LISTS:
        mine = [(task, result) for task, result in zip(tasks, results, strict=True) if task.listed == listed]
        before = sum(not info.get("dropped") for info in sources.values())
        for task, result in mine:
            for name, skipped in result["skipped"].items():
                if name not in result["sources"]:  # a source dropped whole, or the entry's own skips
                    sources[name] = {"role": task.role, "dropped": True, **skipped}
            for name, prepared in result["sources"].items():
                if name in sources and not sources[name].get("dropped"):
                    raise ValueError(f"two config entries produce a source named '{name}'")
                skipped = result["skipped"].get(name, {"skipped": 0, "skipped_by_reason": {}, "skipped_reasons": []})
                sources[name] = _source_entry(cfg, run_dir, task, name, prepared, budget) | skipped
        if (mine or listed == "data.sources") and sum(not i.get("dropped") for i in sources.values()) == before:
            raise no_source(listed)
    manifest = {"config_digest": digest, "max_length": cfg.data.max_length, "sources": sources}
    write_json_atomic(path, manifest)
    return manifest


def _source_entry(
    cfg: RunConfig, run_dir: Path, task: Task, name: str, prepared: dict[str, Any], budget: int | None
) -> dict[str, Any]:
    """A source's manifest entry: its split and counts, from its prepared rows' columns. A training
    example longer than a packed micro batch (``budget``) is refused, named, before anything trains."""
    store = SourceStore(run_dir / prepared["store"], name, prepared["origin"])
    lengths = store.lengths()
    heldout = _heldout(cfg, task, name, len(lengths))
    train = np.ones(len(lengths), dtype=bool)
    train[heldout] = False
    if budget is not None and (too_long := np.flatnonzero(train & (lengths > budget))).size:
        raise store.example(int(too_long[0])).error(
            f"{lengths[too_long[0]]} tokens do not fit a packed micro batch of train.max_tokens = {budget}: "
            f"raise train.max_tokens, or set data.max_length to at most {budget} to truncate such examples"
        )
    supervised = store.column_array("supervised")
    return {
        "role": task.role,
        "store": prepared["store"],
        "store_digest": prepared["store_digest"],
        "format": task.spec.format,
        "origin": prepared["origin"],
        "inputs": prepared["inputs"],
        "examples": len(lengths),
        "train_examples": int(train.sum()),
        "train_tokens": int(lengths[train].sum()),
        "heldout_tokens": int(lengths[~train].sum()),
        "supervised_tokens": int(supervised[train].sum()),
        "truncated": int(store.column_array("truncated").sum()),
        "heldout_indices": heldout,
        "max_examples": task.spec.max_examples,  # the cap its entry sets (None: none)
        "image_tags_inserted": prepared["image_tags_inserted"],
    }


def _heldout(cfg: RunConfig, task: Task, name: str, n: int) -> list[int]:
    """A source's held-out positions: all of an eval-only source's, else the seeded split."""
    if task.role in EVAL_ROLES:
        return list(range(n))
    fraction = task.spec.heldout_fraction
    return heldout_indices(n, cfg.data.heldout_fraction if fraction is None else fraction, cfg.run.seed, name)


def _run_tasks(
    tasks: list[Task], cfg: RunConfig, run_dir: Path, encoder: Encoder, digest: str, force: bool
) -> list[dict[str, Any]]:
    """Every task's result: from the record of a prepare that finished it before, else prepared
    here, this process taking one task after another and workers beside it, up to
    ``data.prepare_processes`` processes in all. Workers are spawned (the stage may run in a
    threaded flow, where a fork could copy a lock held by another thread) and take seconds to start
    (imports, the processor): none starts for built-in tasks alone, generated in a second or two."""
    results = [None if force else _prepared_before(run_dir, task, digest) for task in tasks]
    queue = [i for i, result in enumerate(results) if result is None]
    workers = min(cfg.data.prepare_processes or len(os.sched_getaffinity(0)), len(queue)) - 1
    if all(tasks[i].spec.format == "builtin" for i in queue):
        workers = 0
    args, running, pool = (cfg.data, cfg.run.seed, run_dir, digest), {}, None
    bar = tqdm(total=len(tasks), initial=len(tasks) - len(queue), desc="prepare", unit="task", leave=False)
    with bar, contextlib.ExitStack() as stack:
        try:
            while queue or running:
                for future in [f for f in running if f.done()]:
                    results[running.pop(future)] = future.result()
                    bar.update()
                if pool is None and workers > 0:
                    pool = stack.enter_context(_workers(workers, encoder))
                while pool is not None and queue and len(running) < workers:
                    i = queue.pop(0)
                    running[pool.submit(_prepare_in_worker, tasks[i], *args)] = i
                if queue:
                    i = queue.pop(0)
                    results[i] = prepare_task(tasks[i], *args, encoder)
                    bar.update()
                elif running:
                    wait(running, return_when=FIRST_COMPLETED)
        except BaseException:
            if pool is not None:
                pool.shutdown(cancel_futures=True)  # the tasks under way finish: their records are kept
            raise
    return results


@contextlib.contextmanager
def _workers(count: int, encoder: Encoder) -> Iterator[ProcessPoolExecutor]:
    """``count`` spawned processes holding the encoder, tokenizers one thread each (as this one's)."""
    context = multiprocessing.get_context("spawn")
    lines = context.Value("i", 1)  # each worker's terminal line for its bars (this process': 1)
    pool = ProcessPoolExecutor(count, mp_context=context, initializer=_keep, initargs=(encoder, lines))
    with _one_thread_tokenizers(), pool:
        yield pool


@contextlib.contextmanager
def _one_thread_tokenizers() -> Iterator[None]:
    """The processes are the parallelism: a tokenizer's own threads (one per core in each process)
    only oversubscribe the cores. Spawned workers inherit the setting."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


_worker_encoder: Encoder | None = None
_bar_line = 1  # the terminal line of this process' per-source bars, below the stage's own


def _keep(encoder: Encoder, lines: Any) -> None:
    global _worker_encoder, _bar_line
    _worker_encoder = encoder
    with lines.get_lock():
        lines.value += 1
        _bar_line = lines.value


def _prepare_in_worker(task: Task, data: Any, seed: int, run_dir: Path, digest: str) -> dict[str, Any]:
    return prepare_task(task, data, seed, run_dir, digest, _worker_encoder)


def prepare_task(task: Task, data: Any, seed: int, run_dir: Path, digest: str, encoder: Encoder) -> dict[str, Any]:
    """Stream one task's sources into the store, encoded a batch at a time; its record (what the
    manifest needs of each source, its skips) is written last."""
    policy, prepared = Policy(data.on_bad_record, seed), {}
    inputs = {str(p): _stat(p) for p in task.inputs()}
    with local_datasets():
        for name, stream in task.sources(data, policy):
            folder, origin, tags = store_folder(name), None, 0
            bar = tqdm(desc=name, unit="ex", leave=False, position=_bar_line)
            with StoreWriter(run_dir / folder) as writer, bar:
                for batch in _batches(stream):
                    examples, encoded = _encoded(batch, encoder, policy)
                    if examples:
                        writer.add(examples, encoded)
                        origin = origin or examples[0].origin
                        tags += sum(ex.tags_inserted > 0 for ex in examples)
                        bar.update(len(examples))
            if writer.rows == 0:
                shutil.rmtree(run_dir / folder, ignore_errors=True)
                policy.reject(name, no_examples(task, name))
                continue
            prepared[name] = {
                "store": str(folder),
                "store_digest": _store_digest(run_dir / folder),
                "origin": origin,
                "inputs": inputs,
                "image_tags_inserted": tags,
            }
    skipped = {
        name: {
            "skipped": len(reasons),
            "skipped_by_reason": dict(policy.skipped_by_reason[name]),
            "skipped_reasons": reasons[:SKIPPED_SHOWN],
        }
        for name, reasons in policy.skipped.items()
    }
    result = {"sources": prepared, "skipped": skipped}
    write_json_atomic(_record(run_dir, task), {"config_digest": digest, "inputs": inputs, **result})
    return result


def _batches(stream: Any) -> Any:
    batch: list[Example] = []
    for example in stream:
        batch.append(example)
        if len(batch) == ENCODE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _encoded(batch: list[Example], encoder: Encoder, policy: Policy) -> tuple[list[Example], list[Any]]:
    """A batch counted together; if one of its examples cannot be encoded (an image too thin to
    resize), each alone, the bad ones handed to the bad-record policy."""
    try:
        return batch, encoder.encode_counted(batch)
    except DataError:
        kept, encoded = [], []
        for example in batch:
            try:
                encoded += encoder.encode_counted([example])
                kept.append(example)
            except DataError as err:
                policy.reject(example.source, err)
        return kept, encoded


def _store_digest(folder: Path) -> str:
    """sha256 over a source's shards' sha256s, in order."""
    digest = hashlib.sha256()
    for shard in sorted(folder.glob("shard-*.arrow")):
        digest.update(bytes.fromhex(sha256_file(shard)))
    return digest.hexdigest()


def _record(run_dir: Path, task: Task) -> Path:
    return run_dir / TASKS_DIR / f"{quote(f'{task.listed}:{task.label}', safe='')}.json"


def _stat(path: Path) -> list[int] | None:
    """A file's size and modification time (None: it is not there; reading it names the file)."""
    if not path.exists():
        return None
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _prepared_before(run_dir: Path, task: Task, digest: str) -> dict[str, Any] | None:
    """A task's result from a prepare that finished it (same config, same input files, its
    sources' rows whole); None otherwise."""
    record = _record(run_dir, task)
    done = json.loads(record.read_text()) if record.is_file() else None
    if not done or done["config_digest"] != digest:
        return None
    if done["inputs"] != {str(p): _stat(p) for p in task.inputs()}:
        return None
    if not all((run_dir / info["store"]).is_dir() for info in done["sources"].values()):
        return None
    return {"sources": done["sources"], "skipped": done["skipped"]}


def load_split(
    cfg: RunConfig, run_dir: str | Path, split: str, sources: list[str] | None = None
) -> dict[str, StoredExamples]:
    """The ``train`` or ``heldout`` examples of each fine-tuning source (or of the named sources,
    of any role), as prepared: read from the store when indexed, with their token ids. A source
    whose files changed since ``prepare`` is refused (its rows would be stale)."""
    manifest = read_manifest(run_dir)
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    known = active_sources(manifest, role=None)
    wanted = sources or list(active_sources(manifest))
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise ValueError(f"unknown sources {unknown}; prepared: {sorted(known)}")
    out = {}
    for name in wanted:
        info = known[name]
        for path, stat in info["inputs"].items():
            if _stat(Path(path)) != stat:
                raise DataError(
                    path, None, f"changed since `merit prepare` (source '{name}'); re-run `merit prepare --force`"
                )
        store = SourceStore(Path(run_dir) / info["store"], name, info["origin"])
        held = np.zeros(info["examples"], dtype=bool)
        held[info["heldout_indices"]] = True
        out[name] = StoredExamples.of(store, np.flatnonzero(held == (split == "heldout")))
    return out
