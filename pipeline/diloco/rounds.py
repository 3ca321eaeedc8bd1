"""The rounds of a DiLoCo variant in its run-directory folder, and the aggregator.

    diloco/<variant>/plan.json                the settings (a folder holds one plan's rounds)
    diloco/<variant>/global/<r>/              θ after r rounds: a loadable checkpoint, with the
                                              outer optimizer's state (outer/) and round.json
    diloco/<variant>/global/.<r>.parts/<s>/   part s of it (``diloco.aggregators``), until assembled
    diloco/<variant>/deltas/<r>/<k>/          worker k's compressed pseudo-gradient of round r, or
                                              its LoRA adapter (``pipeline.diloco.payload``)
    diloco/<variant>/workers/<k>/             worker k's inner state, metrics and log
    diloco/<variant>/members.json             each round's workers and their payloads' digests,
                                              decided once, before any part of the round is written
    diloco/<variant>/rounds.json              every round's record

Round 0 starts from θ0 itself, and every global is written in θ0's stored layout, the tensors
transformers does not load (``mtp.*``) copied from it (``pipeline.merge.layout``). Every folder is
written under a temporary name and renamed (``staged_dir``), so a global, a part or a delta that
exists is whole: a re-run resumes after the last global that exists, with the outer state saved
beside it. A round's members are recorded before its parts and a part names the members, payloads
and split it was made of: a re-run aggregates the recorded members (not the payloads published
since: a straggler's, a restarted worker's) and reuses a part only if it was made of exactly those,
so a round killed at any point ends as it would have.

Aggregation streams tensor by tensor: per trained tensor it holds θ's, the momentum buffer's,
the output and the merge's working set (one worker's Δ at a time for the averages and Iso-C, a
budgeted row block for the element-wise methods), never the R pseudo-gradients whole. The workers' Δ
are merged piece by piece (each expert's matrix alone), then the outer step runs on the stored tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import (
    MANIFEST,
    is_complete,
    read_manifest,
    source_of,
    staged_dir,
    verify_checkpoint,
    write_json_atomic,
    write_manifest,
)
from pipeline.config import DilocoMethod
from pipeline.diloco.drift import DriftMeter
from pipeline.diloco.outer import OuterSGD
from pipeline.diloco.payload import Payload, open_payload
from pipeline.diloco.plan import DilocoPlan
from pipeline.merge.driver import merge_tensor
from pipeline.merge.inputs import TensorInputs, Workspace
from pipeline.merge.io import (
    INDEX,
    CheckpointReader,
    TensorInfo,
    check_complete,
    copy_aux_files,
    stream_checkpoint,
    write_index,
)
from pipeline.merge.layout import ModelView, Piece, assemble
from pipeline.merge.registry import TensorContext
from pipeline.merge.rules import choose

GLOBAL, DELTAS, OUTER, RECORDS, ABORT = "global", "deltas", "outer", "rounds.json", "abort.json"
MEMBERS = "members.json"  # each round's workers, decided once
PART = "part.json"  # a part's record, beside its tensors
MAX_SHARD = 5 << 30
POLL_S = 0.02  # how often the aggregator looks for payloads and a worker for the next global weights


class Clock:
    """Seconds since the last lap."""

    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


def global_dir(plan: DilocoPlan, r: int) -> Path:
    return Path(plan.init) if r == 0 else Path(plan.folder) / GLOBAL / str(r)


def global_reader(plan: DilocoPlan, r: int) -> ModelView:
    """Global ``r`` as the workers hold it, whatever θ0's layout (every global is written in it)."""
    return ModelView.open(global_dir(plan, r))


def layout_meta(theta: ModelView) -> dict[str, Any]:
    """What a global's manifest says of its tensors: its source, its layout and the carried tensors (θ's)."""
    return {"source": str(source_of(theta.path)), "layout": theta.layout.summary(), "carried": theta.layout.carried}


def delta_dir(plan: DilocoPlan, r: int, k: int) -> Path:
    return Path(plan.folder) / DELTAS / str(r) / str(k)


def rounds_done(plan: DilocoPlan) -> int:
    """The rounds whose global weights exist (0: none, the run starts from θ0)."""
    folder = Path(plan.folder) / GLOBAL
    done = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
    return max((r for r in done if (folder / str(r) / "manifest.json").is_file()), default=0)


def abort(plan: DilocoPlan, why: str | None) -> None:
    """Tell the workers waiting for the next round that none will come (``why``), or, with None,
    clear an earlier note before the run starts again."""
    path = Path(plan.folder) / ABORT
    if why is None:
        path.unlink(missing_ok=True)
    else:
        write_json_atomic(path, {"why": why})


def aborted(plan: DilocoPlan) -> str | None:
    path = Path(plan.folder) / ABORT
    return json.loads(path.read_text())["why"] if path.is_file() else None


def records(plan: DilocoPlan) -> list[dict[str, Any]]:
    path = Path(plan.folder) / RECORDS
    return json.loads(path.read_text()) if path.is_file() else []


def save_record(plan: DilocoPlan, record: dict[str, Any]) -> None:
    """Add (or replace) a round's record in ``rounds.json``."""
    kept = [r for r in records(plan) if r["round"] != record["round"]]
    write_json_atomic(Path(plan.folder) / RECORDS, sorted([*kept, record], key=lambda r: r["round"]))


def payload_digest(folder: Path) -> str:
    """What names a payload: the sha256 of its manifest's file hashes (the files are checked
    against those by ``verify_checkpoint``; the manifest's timings are left out)."""
    files = read_manifest(folder)["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def digests(plan: DilocoPlan, r: int, workers: list[int]) -> dict[str, str]:
    return {str(k): payload_digest(delta_dir(plan, r, k)) for k in workers}


def members(plan: DilocoPlan) -> list[dict[str, Any]]:
    path = Path(plan.folder) / MEMBERS
    return json.loads(path.read_text()) if path.is_file() else []


def members_of(plan: DilocoPlan, r: int) -> dict[str, Any] | None:
    return next((m for m in members(plan) if m["round"] == r), None)


def decide_round(plan: DilocoPlan, r: int, wait: Callable[[], tuple[list[int], dict[str, Any]]]) -> dict[str, Any]:
    """Round r's members: the workers it aggregates, their payloads' digests and the notes on the
    others (``failures``, ``stragglers``). Recorded in ``members.json`` the first time, as ``wait``
    decides them (the workers, the notes), before any part of the round is written; a re-run
    after a kill takes the record, whatever was published since (a straggler's payload, a
    restarted worker's), so the round aggregates what the killed run's would have."""
    entry = members_of(plan, r)
    if entry is not None:
        check_members(plan, entry)
        return entry
    workers, notes = wait()
    entry = {"round": r, "workers": workers, "digests": digests(plan, r, workers)}
    entry |= notes
    # Written by the loop's thread alone: no lock. Kept for the run's life (a round's entry is small).
    write_json_atomic(Path(plan.folder) / MEMBERS, sorted([*members(plan), entry], key=lambda m: m["round"]))
    return entry


def check_members(plan: DilocoPlan, entry: dict[str, Any]) -> None:
    """Refuse to aggregate a round whose recorded payloads are gone or changed: its parts, its
    record and the re-run's weights would no longer be the ones the round was decided on."""
    r, path = entry["round"], Path(plan.folder) / MEMBERS
    for k in entry["workers"]:
        folder = delta_dir(plan, r, k)
        found = payload_digest(folder) if (folder / MANIFEST).is_file() else None
        if found != entry["digests"][str(k)]:
            raise RuntimeError(
                f"DiLoCo {plan.variant} round {r}: {path} records worker {k}'s payload "
                f"{entry['digests'][str(k)][:12]}, and {folder} {'is missing' if found is None else 'holds another'}; "
                f"put it back, or remove round {r}'s entry from {path.name} to decide the round again"
            )


def round_inputs(plan: DilocoPlan, r: int, workers: list[int]) -> dict[str, Any]:
    """The workers round r aggregates and their payloads' digests. With the round's members
    recorded (``decide_round``), ``workers`` must be them: a part task started with another set
    (by a run whose record was removed since) is refused rather than mixed in; without a record
    (the library called directly), the payloads of ``workers`` as they are."""
    entry = members_of(plan, r)
    if entry is None:
        return {"workers": workers, "digests": digests(plan, r, workers)}
    if entry["workers"] != workers:
        raise RuntimeError(
            f"DiLoCo {plan.variant} round {r}: asked to aggregate workers {workers}, but the round's members "
            f"({Path(plan.folder) / MEMBERS}) are {entry['workers']}"
        )
    check_members(plan, entry)
    return {"workers": workers, "digests": entry["digests"]}


def closed_to(plan: DilocoPlan, r: int, k: int) -> bool:
    """Whether round r has gone on without worker k (``RoundPolicy.closed_to``): its global exists,
    or its members are decided without k (a payload of k's would be dropped)."""
    entry = members_of(plan, r)
    return plan.policy.closed_to(r, k, rounds_done(plan), None if entry is None else entry["workers"])


def aggregate_round(
    plan: DilocoPlan,
    r: int,
    workers: list[int],
    device: str = "cpu",
    block_mb: int = 1024,
    notes: dict[str, Any] | None = None,
    began: float | None = None,
) -> dict[str, Any]:
    """Merge the pseudo-gradients the given workers sent for round r, take the outer step and
    write ``global/<r+1>`` (weights, outer state, record); returns the round's record, with the
    caller's ``notes`` and, given the ``time.perf_counter()`` at which the round began, its wall
    time (the record is whole in the global's folder, so a re-run after a kill between writing
    the global and recording it records the same). With
    ``plan.aggregators`` = S > 1 the tensors are split into S parts by bytes, each aggregated on
    its own (``aggregate_part``: every tensor's merge and outer step are per tensor and depend on
    nothing else, so the split changes no bit of the result), then assembled; a part already
    written of the same workers, payloads and split (before a kill) is not redone."""
    for s in range(plan.aggregators):
        aggregate_part(plan, r, workers, s, device, block_mb)
    return assemble_round(plan, r, workers, notes, began)


def parts_dir(plan: DilocoPlan, r: int) -> Path:
    """Round r's parts, until they are assembled into ``global/<r+1>`` (hidden: not a round)."""
    return Path(plan.folder) / GLOBAL / f".{r + 1}.parts"


def part_beat_dir(plan: DilocoPlan, r: int, s: int) -> Path:
    """Where part s of round r, aggregated on a machine of its own, beats its heartbeat."""
    return parts_dir(plan, r) / f".{s}.beat"


def tensor_parts(info: dict[str, TensorInfo], trained: list[str], parts: int) -> list[list[str]]:
    """The trained tensors of each part, balanced by bytes: the largest first, each into the
    lightest part so far; in checkpoint order within a part."""
    loads, chosen = [0] * parts, [[] for _ in range(parts)]
    for name in sorted(trained, key=lambda n: -info[n].nbytes):
        lightest = loads.index(min(loads))
        chosen[lightest].append(name)
        loads[lightest] += info[name].nbytes
    order = {name: i for i, name in enumerate(trained)}
    return [sorted(names, key=order.__getitem__) for names in chosen]


def aggregate_part(
    plan: DilocoPlan, r: int, workers: list[int], s: int, device: str = "cpu", block_mb: int = 1024
) -> dict[str, Any]:
    """Part s of round r: its trained tensors of every payload merged, stepped and written (with
    the frozen tensors, in part 0) to ``parts_dir/<s>``; returns the part's record: the workers,
    payload digests, number of parts and tensors it was made of, its share of the drift's Gram
    matrix, its seconds and the bytes it read. A part already there is reused only if it was made
    of exactly these (a kill may leave one of another worker set, or of another S); else it is
    made again and replaces it."""
    start = time.perf_counter()
    made_of = round_inputs(plan, r, workers)
    metas = [verify_checkpoint(delta_dir(plan, r, k)) for k in workers]
    step = _RoundStep(plan, r, workers, device, block_mb, worker_weights(plan, metas))
    stored, stem = step.theta.layout.stored, "model" if plan.aggregators == 1 else f"model-part{s:03d}"
    names = tensor_parts(stored, step.trained, plan.aggregators)[s]
    made_of |= {"aggregators": plan.aggregators, "tensors": names}
    folder = parts_dir(plan, r) / str(s)
    if is_complete(folder):
        found = json.loads((folder / PART).read_text())
        if all(found.get(key) == value for key, value in made_of.items()):
            return found
    mine = set(names)
    kept = {n: i for n, i in stored.items() if n in mine or (s == 0 and n not in step.trained)}
    out_plan = {n: TensorInfo(i.shape, torch.float32 if n in mine else i.dtype) for n, i in kept.items()}
    momentum = {n: TensorInfo(i.shape, torch.float32) for n, i in out_plan.items() if n in mine}
    momentum = momentum if step.outer.momentum else {}
    with staged_dir(folder) as tmp:
        hashes, maps = write_stepped(tmp, step.theta.files, out_plan, mine, step, momentum, stem)
        payloads = sum(d.read(mine) for d in step.deltas)
        theta_bytes = sum(stored[n].nbytes for n in mine)
        record = {
            "part": s,
            **made_of,
            "gram": step.meter.gram.tolist(),
            "weight_maps": maps,
            "sizes": {"": sum(i.nbytes for i in out_plan.values()), OUTER: sum(i.nbytes for i in momentum.values())},
            # Every payload twice (the drift pass, then the merge), θ's tensors and the momentum.
            "read": 2 * payloads + theta_bytes + (sum(i.nbytes for i in momentum.values()) if step.previous else 0),
            "seconds": {k: round(v, 4) for k, v in step.seconds.items()},
        }
        record["seconds"]["aggregate"] = round(time.perf_counter() - start, 4)
        write_json_atomic(tmp / PART, record)
        write_manifest(tmp, hashes, kind="diloco_part", round=r + 1, part=s, variant=plan.variant)
    return record


def write_stepped(
    tmp: Path,
    theta: CheckpointReader,
    out_plan: dict[str, TensorInfo],
    stepped: set[str],
    step: Callable[[str], tuple[torch.Tensor, torch.Tensor | None]],
    momentum: dict[str, TensorInfo],
    stem: str = "model",
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The tensors of ``out_plan`` streamed into ``tmp``: those of ``stepped`` as ``step(name)``
    returns them, with the momentum buffer it returns into ``tmp/outer`` (planned by
    ``momentum``; none when empty), the others as θ's files have them (frozen: the same in every worker;
    tensors transformers does not load).
    Returns the files' sha256 and the weight map of each sub-folder."""
    written = stream_checkpoint(
        tmp,
        out_plan,
        lambda name: step(name) if name in stepped else theta.get(name),
        MAX_SHARD,
        stem=stem,
        side=(OUTER, momentum),
    )
    return written.sha256, written.weight_maps


def assemble_round(
    plan: DilocoPlan, r: int, workers: list[int], notes: dict[str, Any] | None = None, began: float | None = None
) -> dict[str, Any]:
    """``global/<r+1>`` from round r's parts (their files linked, one index over them), with the
    round's record (the drift's Gram matrix summed over the parts, ``notes``, the wall time since
    ``began``) written in it last."""
    made_of = round_inputs(plan, r, workers) | {"aggregators": plan.aggregators}
    folders = [parts_dir(plan, r) / str(s) for s in range(plan.aggregators)]
    manifests = [verify_checkpoint(folder) for folder in folders]
    parts = [json.loads((folder / PART).read_text()) for folder in folders]
    for folder, part in zip(folders, parts):
        # aggregate_part has just made or checked every part: another one here was written since,
        # by a part task of an earlier run still at work. Its tensors must not be mixed in.
        if any(part.get(key) != value for key, value in made_of.items()):
            raise RuntimeError(
                f"DiLoCo {plan.variant} round {r}: {folder} was made of workers {part.get('workers')} in "
                f"{part.get('aggregators')} parts, not of this round's {workers} in {plan.aggregators}; "
                "it was replaced while the round was assembled: run again (the part is made again)"
            )
    metas = [verify_checkpoint(delta_dir(plan, r, k)) for k in workers]
    theta = global_reader(plan, r)
    deltas = [open_payload(delta_dir(plan, r, k), theta) for k in workers]
    with staged_dir(global_dir(plan, r + 1)) as tmp:
        hashes, maps = {}, {}
        for folder, manifest in zip(folders, manifests):
            for name, digest in manifest["files"].items():
                if Path(name).name in (PART, INDEX):
                    continue
                link(folder / name, tmp / name)
                hashes[name] = digest
        for part in parts:
            for sub, weight_map in part["weight_maps"].items():
                maps.setdefault(sub, {}).update(weight_map)
        for sub, weight_map in maps.items():
            if len(set(weight_map.values())) > 1:  # several files: the index transformers reads
                write_index(tmp / sub, weight_map, sum(part["sizes"].get(sub, 0) for part in parts))
        copy_aux_files(theta.aux_files(), tmp)
        what, source = f"DiLoCo {plan.variant} global {r + 1}", source_of(theta.path)
        record = _record(plan, r, made_of, metas, theta, deltas, parts) | (notes or {})
        record["tensors"] = check_complete(CheckpointReader(tmp).info, CheckpointReader(source).info, what, str(source))
        if began is not None:
            record["seconds"]["wall"] = round(time.perf_counter() - began, 4)
        write_json_atomic(tmp / "round.json", record)
        write_manifest(tmp, hashes, kind="diloco_global", round=r + 1, variant=plan.variant, **layout_meta(theta))
    shutil.rmtree(parts_dir(plan, r), ignore_errors=True)
    return record


class _RoundStep:
    """One trained tensor of a round: the workers' Δ merged by the method's rule piece by piece, their
    drift measured, the outer step taken on the stored tensor; the seconds of each part summed over the
    tensors."""

    def __init__(self, plan: DilocoPlan, r: int, workers: list[int], device: str, block_mb: int, weights):
        self.theta = global_reader(plan, r)
        self.deltas = [open_payload(delta_dir(plan, r, k), self.theta) for k in workers]
        self.trained = self.deltas[0].trained
        self.outer, self.previous = outer_of(plan.method), outer_state(plan, r)
        self.weights, self.device, self.block_bytes = weights, device, block_mb << 20
        self.labels = [f"worker {k} round {r}" for k in workers]
        self.seed, self.rules = plan.workers[0].config.run.seed, plan.method.effective_rules
        self.meter, self.workspace = DriftMeter(len(workers)), Workspace()
        self.seconds = {"drift": 0.0, "merge": 0.0, "outer": 0.0}

    def __call__(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """θ's new stored tensor ``name`` and its momentum buffer, on the CPU."""
        info = TensorInfo(self.theta.layout.stored[name].shape, torch.float32)
        g = assemble(self.theta.layout.in_stored(name), info, self.merged, self.device)
        clock = Clock()
        value = self.theta.files.get(name).to(self.device, torch.float32)
        previous = self.previous.get(name).to(self.device) if self.previous else None
        buffer = self.outer.step(value, g, previous)
        self.seconds["outer"] += clock.lap()
        return value.cpu(), None if buffer is None else buffer.cpu()

    def merged(self, piece: Piece) -> torch.Tensor:
        """The workers' Δ of one piece merged by the method its rule names, their drift measured."""
        method, params = choose((piece.name, piece.key), self.rules)
        readers = [d.delta(piece.key) for d in self.deltas]
        inputs = TensorInputs(
            piece.name,
            piece.shape,
            readers,
            self.labels,
            device=self.device,
            block_bytes=self.block_bytes,
            workspace=self.workspace,
        )
        clock = Clock()
        for i in inputs.blocks:
            self.meter.add(list(inputs.block(i)))
        inputs.forget()
        self.seconds["drift"] += clock.lap()
        g = merge_tensor(method, params, inputs, self.weights, TensorContext(piece.name, self.seed))
        self.seconds["merge"] += clock.lap()
        return g


def worker_weights(plan: DilocoPlan, metas: list[dict[str, Any]]) -> torch.Tensor:
    """The workers' weights in the aggregate: the tokens each trained on this round, or equal."""
    return plan.policy.weights([m["tokens"] for m in metas])


def outer_of(method: DilocoMethod) -> OuterSGD:
    return OuterSGD(lr=method.outer_lr, momentum=method.outer_momentum, nesterov=method.nesterov)


def _record(
    plan: DilocoPlan,
    r: int,
    made_of: dict[str, Any],
    metas: list[dict[str, Any]],
    theta: ModelView,
    deltas: list[Payload],
    parts: list[dict[str, Any]],
) -> dict:
    """The round as the report shows it. Bytes: each worker sends its payload (what it stores: a
    LoRA worker's adapter factors, not the dense Δ they stand for) and receives the trained
    tensors of the new global in fp32 (dense, LoRA or not); each aggregator (part) reads its share
    of every payload twice, θ's and the momentum's; data-parallel training of the same tokens
    would all-reduce the fp32 gradients of what trains (the adapters, for LoRA workers) every
    inner step: with a ring, 2 (R − 1) / R of them sent by each worker (and as many received).
    ``made_of``: the workers and their payloads' digests."""
    workers = made_of["workers"]
    fp32 = sum(4 * math.prod(theta.layout.stored[n].shape) for n in deltas[0].trained)
    meter = DriftMeter(len(workers))
    meter.gram = sum(torch.tensor(part["gram"], dtype=torch.float64) for part in parts)
    seconds = {k: round(sum(part["seconds"][k] for part in parts), 4) for k in ("drift", "merge", "outer")}
    return {
        "round": r,
        "workers": workers,
        "digests": made_of["digests"],
        "dropped": [k for k in range(plan.size) if k not in workers],
        "weights": [round(w, 6) for w in worker_weights(plan, metas).tolist()],
        "tokens": [m["tokens"] for m in metas],
        "delta_norms": meter.norms(),
        "mean_cosine": meter.mean_cosine(),
        "aggregators": len(parts),
        "bytes": {
            "sent": sum(d.sent for d in deltas),
            "received": len(workers) * fp32,
            "aggregator_read": max(part["read"] for part in parts),  # the busiest aggregator's
            "data_parallel": plan.inner_steps * 2 * (plan.size - 1) * deltas[0].gradient,  # sent, by all workers
        },
        "seconds": {
            "inner": max(m["seconds"]["inner"] for m in metas),
            "worker_io": max(m["seconds"]["load"] + m["seconds"]["save"] for m in metas),
            "launch": max(m["seconds"].get("launch", 0.0) for m in metas),
            **seconds,
            # The parts' seconds summed (their machine time); run at once, the round's wall time
            # holds only the slowest part's.
            "aggregate": round(sum(part["seconds"]["aggregate"] for part in parts), 4),
        },
    }


def outer_state(plan: DilocoPlan, r: int) -> CheckpointReader | None:
    """The momentum buffers saved with global r (none at round 0 or without momentum)."""
    folder = global_dir(plan, r) / OUTER
    return CheckpointReader(folder) if r > 0 and folder.is_dir() else None


def send(source: Path, plan: DilocoPlan, r: int, k: int, save_s: float = 0.0) -> None:
    """Publish a worker's payload folder (its round's files and manifest) as ``deltas/<r>/<k>``,
    with the seconds its checkpoint took: hard links where the file system allows (no second
    copy of the bytes), else a copy."""
    manifest = read_manifest(source)
    meta = {k: v for k, v in manifest.items() if k != "files"}
    meta["seconds"] = {**meta.get("seconds", {}), "save": save_s}
    with staged_dir(delta_dir(plan, r, k)) as tmp:
        for name in manifest["files"]:
            link(source / name, tmp / name)
        write_manifest(tmp, manifest["files"], **meta)


def link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` where the file system allows (no second copy of the
    bytes), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def recover(plan: DilocoPlan, r: int) -> None:
    """Round r's record after a kill between writing global r + 1 and recording it (the record is
    kept in the global's folder); the clean-up is the caller's (``retire``)."""
    if all(x["round"] != r for x in records(plan)):
        save_record(plan, json.loads((global_dir(plan, r + 1) / "round.json").read_text()))


def retire(plan: DilocoPlan, r: int) -> None:
    """After global r + 1 is written: round r's deltas, its parts (assembly removes them, unless
    killed just before) and global r − 1 are no longer needed (a late worker may still read
    global r)."""
    shutil.rmtree(Path(plan.folder) / DELTAS / str(r), ignore_errors=True)
    shutil.rmtree(parts_dir(plan, r), ignore_errors=True)
    if r >= 2:  # global 0 is θ0 itself
        shutil.rmtree(global_dir(plan, r - 1), ignore_errors=True)
