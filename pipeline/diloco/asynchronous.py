"""Asynchronous DiLoCo over a run directory (``diloco.sync: async``): each payload is applied
when it arrives, and a worker goes on from the newest global weights without waiting for the
others (asynchronous Local-SGD, Liu et al. 2024, arXiv 2401.09135).

    diloco/<variant>/global/<v>/            θ after v arrivals (v = 0: θ0), the outer state, the
                                            arrival's record (round.json)
    diloco/<variant>/deltas/<n>/<k>/        worker k's n-th payload: Δ against the global it began from
    diloco/<variant>/arrivals.json          the payloads in the order they were applied
    diloco/<variant>/workers/<k>/next.json  the payload worker k trains now: its base global, its steps

Arrival v applies payload i of worker k, taken from global b_i ≤ v (its staleness is v − b_i):
θ_{v+1} = θ_v − η c w_i Δ_i, with w_i = 1 / R (``weighting: equal``, the default, as Liu et al.
weigh every arrival alike) or its tokens over R times the mean payload's (``weighting: tokens``;
:func:`~pipeline.diloco.aggregate.arrival_weight`) and c the linear method's scale (1 for
averaging). Every R arrivals the momentum takes the window's Σ c w_i Δ_i (delayed Nesterov,
``OuterSGD.momentum_step``), read again from the window's payloads, which are kept until then:
so the aggregator holds per tensor θ, one Δ, the window's sum and the momentum, whatever R.

Dynamic local steps: before each payload a worker takes H_k = round(H · s_k / max_j s_j) steps
(at least 1), s_j the steps per second of worker j's latest applied payload, so that the workers
send at about the same wall-time cadence and a slow worker's Δ is not many globals stale.

Every worker sends T payloads; the run's last global is R·T (fewer when a worker failed for good).

Replay: arrivals.json is written before the global it leads to, with the digest of the payload
each arrival applies, and a worker's base and steps are noted (next.json) before it trains. A
re-run takes both from there, so a flow killed at any point applies the same payloads in the same
order, trained from the same globals for the same steps: the same weights. Given an earlier run's
arrivals.json (``diloco.replay``), a run replays that run (its payloads trained again here: their
digests are not carried over).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from pipeline.checkpoint import (
    MANIFEST,
    read_manifest,
    staged_dir,
    verify_checkpoint,
    write_json_atomic,
    write_manifest,
)
from pipeline.diloco.aggregate import arrival_weight
from pipeline.diloco.payload import open_payload, stored_delta
from pipeline.diloco.plan import DilocoPlan
from pipeline.diloco.rounds import (
    OUTER,
    Clock,
    delta_dir,
    global_dir,
    global_reader,
    layout_meta,
    link,
    outer_of,
    outer_state,
    payload_digest,
    records,
    rounds_done,
    write_stepped,
)
from pipeline.merge.io import CheckpointReader, MergeInputError, TensorInfo, copy_aux_files
from pipeline.merge.layout import ModelView
from pipeline.merge.rules import choose

ARRIVALS, NEXT = "arrivals.json", "next.json"


class Arrival(BaseModel):
    """One payload as the aggregator applied it (or will, when replayed)."""

    model_config = ConfigDict(extra="forbid")
    worker: int
    payload: int  # the worker's n-th
    base: int  # the global it was trained from
    steps: int
    tokens: int
    weight: float
    # The payload's digest (``rounds.payload_digest``), checked when it is applied; none in a file
    # from another run (``diloco.replay``: its payloads are trained again here) or an older one.
    digest: str | None = None


def arrivals(plan: DilocoPlan) -> list[Arrival]:
    path = Path(plan.folder) / ARRIVALS
    return [Arrival.model_validate(a) for a in json.loads(path.read_text())] if path.is_file() else []


def save_arrivals(plan: DilocoPlan, items: list[Arrival]) -> None:
    write_json_atomic(Path(plan.folder) / ARRIVALS, [a.model_dump() for a in items])


def note_path(plan: DilocoPlan, k: int) -> Path:
    return Path(plan.workers[k].out_dir) / NEXT


def read_note(plan: DilocoPlan, k: int) -> dict[str, int] | None:
    path = note_path(plan, k)
    return json.loads(path.read_text()) if path.is_file() else None


# ---- the worker's side ------------------------------------------------------------------------


def start_payload(plan: DilocoPlan, k: int, n: int, speed: float | None) -> tuple[int, int]:
    """(base global, steps) of worker k's n-th payload: as arrivals.json or the worker's note
    recorded them (a replay, or a re-run after a kill), else the newest global and the worker's
    dynamic steps, noted before they are used. The note pins the base: the aggregator keeps a
    global a worker's note names (see ``retire_globals``)."""
    recorded = next((a for a in arrivals(plan) if (a.worker, a.payload) == (k, n)), None)
    note = read_note(plan, k)
    if recorded is not None:
        base, steps = recorded.base, recorded.steps
    elif note is not None and note["payload"] == n:
        base, steps = note["base"], note["steps"]
    else:
        steps = dynamic_steps(plan, k, speed)
        while True:
            base = rounds_done(plan)
            write_json_atomic(note_path(plan, k), {"payload": n, "base": base, "steps": steps})
            # Retired between the look and the note? Then the newest is newer: look again.
            if base == 0 or (global_dir(plan, base) / MANIFEST).is_file():
                break
    write_json_atomic(note_path(plan, k), {"payload": n, "base": base, "steps": steps})
    return base, steps


def speeds(plan: DilocoPlan) -> dict[int, float]:
    """Each worker's inner steps per second in its latest applied payload."""
    found = {}
    for record in records(plan):
        if record.get("steps") and record["seconds"]["inner"] > 0:
            found[record["workers"][0]] = record["steps"] / record["seconds"]["inner"]
    return found


def dynamic_steps(plan: DilocoPlan, k: int, speed: float | None) -> int:
    """H scaled by worker k's speed against the fastest worker's (``speed``: its own latest,
    measured; the others' from the records); H itself before anything is measured."""
    known = speeds(plan) if plan.dynamic_steps else {}  # off: H whatever the speeds, no records read
    if speed is not None:
        known[k] = speed
    return plan.policy.local_steps(known, k)


# ---- the aggregator's side --------------------------------------------------------------------


def next_arrival(plan: DilocoPlan, applied: list[Arrival]) -> Arrival | None:
    """What to apply after ``applied`` (arrivals.json up to the newest global): the recorded next
    arrival once its payload is published (a replay), else of the payloads published so far
    (each worker's next) the one published first; None while there is none."""
    recorded = arrivals(plan)
    if len(recorded) > len(applied):
        a = recorded[len(applied)]
        return a if (delta_dir(plan, a.payload, a.worker) / MANIFEST).is_file() else None
    sent = [sum(a.worker == k for a in applied) for k in range(plan.size)]
    published = [
        (path.stat().st_mtime, k)
        for k in range(plan.size)
        if (path := delta_dir(plan, sent[k], k) / MANIFEST).is_file()
    ]
    if not published:
        return None
    k = min(published)[1]
    meta = read_manifest(delta_dir(plan, sent[k], k))
    counted = [a.tokens for a in applied] + [int(meta["tokens"])]
    if plan.method.weighting == "equal":  # every arrival alike (Liu et al.): 1 / R each
        counted = [1] * len(counted)
    return Arrival(
        worker=k,
        payload=sent[k],
        base=meta["base"],
        steps=meta["steps"][1] - meta["steps"][0],
        tokens=int(meta["tokens"]),
        weight=arrival_weight(counted[-1], len(counted), sum(counted), plan.size),
        digest=payload_digest(delta_dir(plan, sent[k], k)),
    )


def window(plan: DilocoPlan, schedule: list[Arrival], v: int) -> list[Arrival]:
    """The arrivals of arrival v's momentum window, up to v."""
    return schedule[v - v % plan.size : v + 1]


def closes_window(plan: DilocoPlan, v: int) -> bool:
    return (v + 1) % plan.size == 0


def apply_arrival(
    plan: DilocoPlan,
    v: int,
    schedule: list[Arrival],
    device: str = "cpu",
    notes: dict[str, Any] | None = None,
    began: float | None = None,
) -> dict[str, Any]:
    """Write ``global/<v+1>``: global v with arrival v of ``schedule`` applied (and the momentum
    step when it closes a window), its outer state and its record (with ``notes`` and the wall
    time since ``began``); returns the record."""
    start, arrival = time.perf_counter(), schedule[v]
    closes = closes_window(plan, v)
    theta = global_reader(plan, v)
    folder = delta_dir(plan, arrival.payload, arrival.worker)
    meta = verify_checkpoint(folder)
    digest = payload_digest(folder)
    if arrival.digest not in (None, digest):
        raise RuntimeError(
            f"DiLoCo {plan.variant} arrival {v}: {Path(plan.folder) / ARRIVALS} records payload "
            f"{arrival.digest[:12]} of worker {arrival.worker}, and {folder} holds another"
        )
    step = _ArrivalStep(plan, theta, window(plan, schedule, v) if closes else [arrival], closes, device)
    step.previous = outer_state(plan, v)
    trained, stored = set(step.trained), theta.layout.stored
    out_plan = {n: TensorInfo(i.shape, torch.float32 if n in trained else i.dtype) for n, i in stored.items()}
    momentum = {n: TensorInfo(stored[n].shape, torch.float32) for n in step.trained} if closes else {}
    with staged_dir(global_dir(plan, v + 1)) as tmp:
        hashes, _ = write_stepped(tmp, theta.files, out_plan, trained, step, momentum if step.outer.momentum else {})
        if not closes and step.previous is not None:  # the momentum moves once a window: the same files
            hashes |= _link_outer(global_dir(plan, v), tmp)
        copy_aux_files(theta.aux_files(), tmp)
        record = _record(plan, v, arrival, digest, meta, step, closes) | (notes or {})
        record["seconds"]["aggregate"] = round(time.perf_counter() - start, 4)
        if began is not None:
            record["seconds"]["wall"] = round(time.perf_counter() - began, 4)
        write_json_atomic(tmp / "round.json", record)
        write_manifest(tmp, hashes, kind="diloco_global", round=v + 1, variant=plan.variant, **layout_meta(theta))
    return record


class _ArrivalStep:
    """One trained tensor of an arrival: θ − η c w Δ, and at a window's end the momentum's share
    from the window's Σ c w_i Δ_i."""

    def __init__(self, plan: DilocoPlan, theta: ModelView, payloads: list[Arrival], closes: bool, device: str):
        self.theta, self.payloads, self.closes, self.device = theta, payloads, closes, device
        # A LoRA payload's Δ is −(alpha / r)·B A whatever global it started from; a tensor it saves
        # whole would need that global, which may be gone (refused by the config: no
        # train.additional_target with LoRA workers in async mode).
        self.readers = [open_payload(delta_dir(plan, a.payload, a.worker), theta) for a in payloads]
        for reader in self.readers:
            if reader.whole:
                raise MergeInputError(
                    f"{reader.path}: an adapter with tensors saved whole ({reader.whole[0]}) cannot be applied "
                    "asynchronously (its Δ needs the global it was trained from)"
                )
        self.trained = self.readers[-1].trained
        self.outer, self.rules = outer_of(plan.method), plan.method.effective_rules
        self.previous: CheckpointReader | None = None
        self.norm2, self.seconds = 0.0, {"merge": 0.0, "outer": 0.0}

    def delta(self, i: int, name: str) -> torch.Tensor:
        return stored_delta(self.readers[i], name, self.device)

    def __call__(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        clock = Clock()
        method, params = choose((name, *(p.key for p in self.theta.layout.in_stored(name))), self.rules)
        scale = float(method.coefficients(torch.ones(1), params)[1][0])  # a linear method's c
        value, delta = self.theta.files.get(name).to(self.device, torch.float32), self.delta(-1, name)
        self.norm2 += float(delta.double().square().sum())
        value.sub_(delta, alpha=self.outer.lr * scale * self.payloads[-1].weight)
        self.seconds["merge"] += clock.lap()
        if not self.closes:
            return value.cpu(), None
        g = delta.mul_(scale * self.payloads[-1].weight)
        for i, a in enumerate(self.payloads[:-1]):
            g.add_(self.delta(i, name), alpha=scale * a.weight)
        previous = self.previous.get(name).to(self.device) if self.previous else None
        buffer = self.outer.momentum_step(value, g, previous)
        self.seconds["outer"] += clock.lap()
        return value.cpu(), None if buffer is None else buffer.cpu()


def _link_outer(previous: Path, tmp: Path) -> dict[str, str]:
    """The previous global's momentum files, linked into ``tmp/outer`` with their hashes."""
    files = {n: h for n, h in read_manifest(previous)["files"].items() if n.startswith(f"{OUTER}/")}
    for name in files:
        link(previous / name, tmp / name)
    return files


def _record(
    plan: DilocoPlan, v: int, arrival: Arrival, digest: str, meta: dict[str, Any], step: _ArrivalStep, closes: bool
) -> dict[str, Any]:
    """The arrival as the report shows it (the fields of a synchronous round's record, for one
    worker). Bytes: the payload sent (a LoRA worker's adapter), the global its worker fetches next
    (the trained tensors in fp32), what the aggregator read; data-parallel training of the same
    steps would send 2 (R − 1) / R of the fp32 gradients of what trains each step from this worker."""
    fp32 = sum(4 * math.prod(step.theta.layout.stored[n].shape) for n in step.trained)
    sent = step.readers[-1].sent
    read = sum(r.read(set(r.trained)) for r in step.readers) + fp32 * (2 if closes else 1)
    return {
        "round": v,
        "outer_round": (v + 1) / plan.size,  # in rounds of R arrivals, to set beside synchronous rounds
        "workers": [arrival.worker],
        "digests": {str(arrival.worker): digest},
        "payload": arrival.payload,
        "base": arrival.base,
        "staleness": v - arrival.base,
        "steps": arrival.steps,
        "window": plan.size,  # arrivals per momentum step
        "window_closed": closes,
        "dropped": [],
        "weights": [round(arrival.weight, 6)],
        "tokens": [arrival.tokens],
        "delta_norms": [step.norm2**0.5],
        "mean_cosine": None,
        "aggregators": 1,
        "bytes": {
            "sent": sent,
            "received": fp32,
            "aggregator_read": read,
            "data_parallel": round(arrival.steps * 2 * (plan.size - 1) / plan.size * step.readers[-1].gradient),
        },
        "seconds": {
            "inner": meta["seconds"]["inner"],
            "worker_io": meta["seconds"]["load"] + meta["seconds"]["save"],
            "launch": meta["seconds"].get("launch", 0.0),
            "drift": 0.0,
            **{k: round(s, 4) for k, s in step.seconds.items()},
        },
    }


def retire(plan: DilocoPlan, v: int, schedule: list[Arrival]) -> None:
    """After global v + 1 is written: a closed window's payloads, and the globals older than v that
    no worker's note names and no recorded arrival still to come starts from."""
    if closes_window(plan, v):
        for a in window(plan, schedule, v):
            folder = delta_dir(plan, a.payload, a.worker)
            _remove(folder)
            if folder.parent.is_dir() and not any(folder.parent.iterdir()):
                folder.parent.rmdir()
    pinned = {a.base for a in schedule[v + 1 :]}
    pinned |= {note["base"] for k in range(plan.size) if (note := read_note(plan, k)) is not None}
    folder = Path(plan.folder) / "global"
    for path in folder.iterdir() if folder.is_dir() else []:
        if path.name.isdigit() and 0 < int(path.name) < v and int(path.name) not in pinned:
            _remove(path)


def _remove(path: Path) -> None:
    """Gone at once for a reader (a rename), then deleted."""
    hidden = path.with_name(f".{path.name}.retired")
    shutil.rmtree(hidden, ignore_errors=True)  # also what a kill between the rename and the deletion left
    if path.is_dir():
        path.rename(hidden)
        shutil.rmtree(hidden, ignore_errors=True)
