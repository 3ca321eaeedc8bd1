"""The ``prepare`` stage: load every source, hold out a seeded split, encode everything once to
count tokens (and surface every bad record before any training starts), write the manifest.

``data/manifest.json`` per source: role (``finetune``, ``warmup``, ``unseen`` or ``retention``,
see :mod:`pipeline.data.sources`), format, examples, held-out indices, train/held-out tokens,
supervised tokens, the cap its entry set (``max_examples``), truncated and skipped counts.
Eval-only sources (unseen, retention) are held out whole: they never train. Train tokens are the
token-weighted merge's weights and the split planner's balance. The token ids themselves are kept
in ``data/tokens/<n>.safetensors`` (concatenated ids + offsets) so that later stages encode only
images; :func:`load_split` attaches them to the examples it returns. Each source's counts are
written beside its ids (``<n>.json``) as soon as it is encoded: a prepare stopped halfway (a kill,
a bad record) encodes again only the sources it had not finished.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from pipeline.checkpoint import write_json_atomic
from pipeline.config import RunConfig
from pipeline.data.benchmark import write_tasks
from pipeline.data.encode import Encoder
from pipeline.data.example import DataError, Example
from pipeline.data.manifest import MANIFEST_PATH, active_sources, read_manifest
from pipeline.data.sources import EVAL_ROLES, LoadedSources, load_sources

TOKENS_DIR = Path("data") / "tokens"
ENCODE_BATCH = 32
SKIPPED_SHOWN = 5  # reasons kept per source in the manifest; the count is always exact


def heldout_indices(n: int, fraction: float, seed: int, source: str) -> list[int]:
    """A seeded choice of held-out positions; at least one when the fraction is positive,
    never all of them (a source must keep something to train on)."""
    if fraction <= 0 or n < 2:
        return []
    k = min(max(1, round(fraction * n)), n - 1)
    return sorted(random.Random(f"{seed}/heldout/{source}").sample(range(n), k))


def data_digest(cfg: RunConfig) -> str:
    """What the prepared data depends on: the seed (it draws the built-in corpus and the split),
    the data and model (the processor) sections, and the warm-up and eval sources."""
    lists = [[spec.model_dump(mode="json") for spec in specs] for specs in (cfg.warmup.sources or [], cfg.eval.sources)]
    return hashlib.sha256(json.dumps([cfg.digest("run", "data", "model"), lists]).encode()).hexdigest()[:16]


def _load(cfg: RunConfig) -> LoadedSources:
    return load_sources(cfg.data, cfg.run.seed, cfg.warmup.sources, cfg.eval.sources)


def prepare_data(cfg: RunConfig, run_dir: str | Path, processor: Any, force: bool = False) -> dict[str, Any]:
    """Write ``run_dir/data/manifest.json`` and the toy benchmark tasks ``eval.benchmarks`` names;
    reuse what is up to date."""
    write_tasks(cfg, run_dir)
    return _prepare_sources(cfg, run_dir, processor, force)


def _prepare_sources(cfg: RunConfig, run_dir: str | Path, processor: Any, force: bool) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST_PATH
    digest = data_digest(cfg)
    if path.is_file() and not force:
        manifest = json.loads(path.read_text())
        if manifest.get("config_digest") == digest:
            return manifest
    loaded = _load(cfg)
    encoder = Encoder(processor, cfg.data.max_length)
    budget = cfg.train.max_tokens if cfg.train.packing else None  # a packed micro batch's tokens
    total = sum(len(v) for v in loaded.examples.values())
    sources = {}
    with tqdm(total=total, desc="prepare: encoding", unit="ex", leave=False) as bar:
        for number, (name, examples) in enumerate(loaded.examples.items()):
            heldout = _heldout(cfg, loaded, name)
            tokens_file = TOKENS_DIR / f"{number:04d}.safetensors"
            tokens_path, record = Path(run_dir) / tokens_file, Path(run_dir) / tokens_file.with_suffix(".json")
            counts = None if force else _encoded_before(record, tokens_path, digest, name, examples)
            if counts is None:
                counts = _encode_source(examples, set(heldout), encoder, bar, tokens_path, budget)
                write_json_atomic(record, {"config_digest": digest, "source": name, "counts": counts})
            else:
                bar.update(len(examples))
            sources[name] = (
                counts
                | {
                    "role": loaded.roles[name],
                    "tokens_file": str(tokens_file),
                    "format": loaded.formats[name],
                    "origin": examples[0].origin,
                    "heldout_indices": heldout,
                    "max_examples": loaded.entries[name].max_examples,  # the cap its entry sets (None: none)
                    "skipped": len(loaded.skipped.get(name, [])),
                    "skipped_by_reason": dict(loaded.skipped_by_reason.get(name, {})),
                    "skipped_reasons": loaded.skipped.get(name, [])[:SKIPPED_SHOWN],
                    "image_tags_inserted": sum(ex.tags_inserted > 0 for ex in examples),
                }
            )
    for name, reasons in loaded.skipped.items():  # sources dropped whole (empty after skipping)
        if name not in sources:
            sources[name] = {
                "role": loaded.roles[name],
                "dropped": True,
                "skipped": len(reasons),
                "skipped_by_reason": dict(loaded.skipped_by_reason.get(name, {})),
                "skipped_reasons": reasons[:SKIPPED_SHOWN],
            }
    manifest = {"config_digest": digest, "max_length": cfg.data.max_length, "sources": sources}
    write_json_atomic(path, manifest)
    return manifest


def _encoded_before(
    record: Path, tokens: Path, digest: str, name: str, examples: list[Example]
) -> dict[str, int] | None:
    """A source's counts from a prepare that encoded it before being stopped (its record beside its
    token ids, under the same config, for the same examples: their fingerprints), so that a
    killed prepare encodes only the sources it had not finished; None otherwise."""
    done = json.loads(record.read_text()) if record.is_file() and tokens.is_file() else None
    if not done or done["config_digest"] != digest or done["source"] != name:
        return None
    cached = load_file(str(tokens))["fingerprints"].tolist()
    return done["counts"] if cached == [ex.fingerprint() for ex in examples] else None


def _heldout(cfg: RunConfig, loaded: LoadedSources, name: str) -> list[int]:
    """A source's held-out positions: all of an eval-only source's, else the seeded split."""
    n = len(loaded.examples[name])
    if loaded.roles[name] in EVAL_ROLES:
        return list(range(n))
    fraction = loaded.entries[name].heldout_fraction
    return heldout_indices(n, cfg.data.heldout_fraction if fraction is None else fraction, cfg.run.seed, name)


def _encode_source(
    examples: list[Example], heldout: set[int], encoder: Encoder, bar: tqdm, tokens_path: Path, budget: int | None
) -> dict[str, int]:
    """Encode one source in batches: count its tokens and cache its token ids, from its images'
    sizes alone (:meth:`Encoder.encode_counted`: no image decoded). A training example longer
    than a packed micro batch (``budget``) is refused, named, before anything trains."""
    counts = dict.fromkeys(
        ("examples", "train_examples", "train_tokens", "heldout_tokens", "supervised_tokens", "truncated"), 0
    )
    encoded = (
        enc
        for i in range(0, len(examples), ENCODE_BATCH)
        for enc in encoder.encode_counted(examples[i : i + ENCODE_BATCH])
    )
    ids = []
    for position, enc in enumerate(encoded):
        ids.append(enc.input_ids.to(torch.int32))  # kept with each example's fingerprint
        split = "heldout" if position in heldout else "train"
        if split == "train" and budget is not None and enc.num_tokens > budget:
            raise examples[position].error(
                f"{enc.num_tokens} tokens do not fit a packed micro batch of train.max_tokens = {budget}: "
                f"raise train.max_tokens, or set data.max_length to at most {budget} to truncate such examples"
            )
        counts["examples"] += 1
        counts[f"{split}_tokens"] += enc.num_tokens
        if split == "train":
            counts["train_examples"] += 1
            counts["supervised_tokens"] += enc.num_supervised
        counts["truncated"] += enc.truncated
        bar.update()
    _save_token_ids(ids, [ex.fingerprint() for ex in examples], tokens_path)
    return counts


def _save_token_ids(ids: list[torch.Tensor], fingerprints: list[int], path: Path) -> None:
    offsets = torch.tensor([0, *torch.tensor([len(x) for x in ids]).cumsum(0).tolist()], dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tensors = {
        "input_ids": torch.cat(ids),
        "offsets": offsets,
        "fingerprints": torch.tensor(fingerprints, dtype=torch.int64),
    }
    save_file(tensors, str(tmp))
    tmp.replace(path)


def _attach_token_ids(examples: list[Example], path: Path, source: str) -> None:
    """Give each example its cached ids, refusing a cache that no longer matches the data."""
    tensors = load_file(str(path))
    bounds = tensors["offsets"].tolist()
    fingerprints = tensors["fingerprints"].tolist()
    if len(fingerprints) != len(examples):
        raise DataError(
            str(path),
            None,
            f"source '{source}': {len(examples)} examples but {len(fingerprints)} cached; "
            "re-run `merit prepare --force`",
        )
    for i, example in enumerate(examples):
        if example.fingerprint() != fingerprints[i]:
            raise example.error(
                "changed since `merit prepare` (its cached token ids are stale); re-run `merit prepare --force`"
            )
        example.token_ids = tensors["input_ids"][bounds[i] : bounds[i + 1]]


def load_split(
    cfg: RunConfig, run_dir: str | Path, split: str, sources: list[str] | None = None
) -> dict[str, list[Example]]:
    """The ``train`` or ``heldout`` examples of each fine-tuning source (or of the named sources,
    of any role), as prepared, with their cached token ids attached."""
    manifest = read_manifest(run_dir)
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    known = active_sources(manifest, role=None)
    wanted = sources or list(active_sources(manifest))
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise ValueError(f"unknown sources {unknown}; prepared: {sorted(known)}")
    loaded = _load(cfg)
    out = {}
    for name in wanted:
        held = set(known[name]["heldout_indices"])
        examples = loaded.examples[name]
        _attach_token_ids(examples, Path(run_dir) / known[name]["tokens_file"], name)
        out[name] = [ex for pos, ex in enumerate(examples) if (pos in held) == (split == "heldout")]
    return out
