"""``merit bench diloco --slow K:F``: DiLoCo with a straggler, its R workers real concurrent
processes, under four sync modes, in wall time.

The setting is ``merit bench diloco``'s (:mod:`merit.bench.diloco`: the stdlib corpus, the
tiny Qwen2, θ0, each worker's ``Learner`` with AdamW, the schedule and clipping, its iid shard
stream from ``shard_batches`` with the same seeds, batch 8, H inner steps), but each worker is a
process of its own (``torch.multiprocessing``, start method ``forkserver`` with this module
preloaded: a fresh interpreter imports torch and transformers once, and each worker is forked
from it, from a process that never ran torch's OpenMP pool — a plain ``fork`` of the server could
hang in it, and ``spawn`` imports everything once per worker: 74 s for 4 workers on 2 busy cores
against 7 s; one torch thread each). Worker K of ``--slow K:F``
runs F× slower in wall time: after each inner step it sleeps (F − 1) × that step's duration (a
1/F duty cycle, as the flow's ``diloco.slow_workers``). The main process is the server: it holds
the global θ (fp32) and the outer state, sends a global (its version and its tensors) to a worker,
and gets back (k, its payload index, the base version, steps, tokens, Δ = θ_base − θ_k
compressed as sent, with error feedback when compressed, the inner seconds), all through
multiprocessing queues (state dicts serialised with ``torch.save``).

The rounds are the library's: :class:`pipeline.diloco.policy.RoundPolicy` (the rule the flow's
round loop decides by) closes a round, tells a late payload, weighs a round's payloads and gives an
async worker its steps; :func:`pipeline.diloco.aggregate.aggregate_deltas` (a round) and
:class:`pipeline.diloco.aggregate.AsyncOuter` (an arrival) step θ. The bench adds the processes,
the slow worker's clock and one rule of its own. Modes, all from the same θ0, shards and seeds:

- ``sync``: a round closes when all R payloads are in, weighted by tokens, merged and stepped
  (the workers send Δ: the compression half of :func:`pipeline.diloco.aggregate` runs in them).
- ``quorum-drop``: the flow's ``diloco.sync: quorum``, Q = ``--quorum`` (default R − 1): a round
  closes at the Q-th payload from its global; the others are stragglers and go on training. A
  payload of a round gone on without its worker is dropped and the worker joins the newest global
  with its own inner state (OpenDiLoCo's rule; one that sees this before sending sends no Δ, as
  the flow's worker). No round timeout.
- ``quorum-discount``: the bench's own, what dropping was measured against: a late payload enters
  the NEXT aggregate, its weight × 1 / (1 + s), s the rounds since its base global, the weights
  renormalised (a weighted mean of pseudo-gradients still: η keeps its meaning).
- ``async``: the flow's ``diloco.sync: async``: each payload applied as it arrives (window R,
  1 / R each, delayed Nesterov), its worker sent the newest global at once for H_k steps (dynamic
  local steps, DyLU, Liu et al. 2024, arXiv 2401.09135); each worker sends T payloads.

Choices:

- Each worker's lr schedule runs over H·T steps (its budget in ``sync``), in every mode: a worker
  that trains fewer steps (a straggler, DyLU) ends earlier in its schedule.
- ``isoloco`` (Iso-C aggregates several payloads at once: no per-arrival form) and ``dp`` are
  refused with ``--slow``; ``diloco`` (η 0.7, μ 0.9, the default) and ``average`` (η 1, μ 0) run.
- Wall time runs from the moment θ0 is sent to the workers (started, imports done, each its
  Learner built) to the last outer step (the T-th round, the R·T-th arrival). Work still in
  flight then is cancelled (a worker checks after each step) and not counted.
- Evaluation costs the compared runs nothing: the server keeps a copy of θ with its time after
  every outer step (every round; every R arrivals in ``async``, the last among them) and θ0 at 0 s;
  after the run the idle workers evaluate them (the held-out windows, one thread each). "Loss at
  sync's wall time" is the loss of the latest snapshot taken at or before ``sync``'s wall time.
- Bytes sent: every Δ payload a worker sent during the run, as compressed (fp32 with
  ``none``), applied or not; a payload already under way when its round closed counts, then is
  dropped.
- A worker's local steps are those of the payloads it completed during the run (sent or not).
- Each snapshot records the machine's 1-minute load average: wall times are only comparable
  between modes run under the same load, and the table shows it.
- Outputs: ``stragglers-<method>[-<compression>].json`` and ``.png`` (held-out loss against wall
  time per mode) in ``--out``, beside the plain bench's ``results.json``, never over it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from merit.bench.diloco import (
    BATCH,
    CONTEXT,
    METHODS,
    Corpus,
    Learner,
    heldout_loss,
    load_corpus,
    markdown,
    shard_batches,
    tiny_qwen2,
)
from pipeline.checkpoint import write_text_atomic
from pipeline.diloco.aggregate import AsyncOuter, aggregate_deltas
from pipeline.diloco.compress import compress_with_feedback, decompress, payload_bytes
from pipeline.diloco.policy import RoundPolicy, default_weighting
from pipeline.figures import save_figure
from pipeline.train.lifetime import die_with_parent

MODES = ("sync", "quorum-drop", "quorum-discount", "async")
ARRIVAL_METHODS = ("diloco", "average")  # those with a per-arrival form
START_METHOD = "forkserver"
POLL_S = 1.0  # how often a waiting server checks that its workers are alive


class SettingError(ValueError):
    """A setting the straggler bench refuses (printed as one line by ``main``)."""


class WorkerFailed(RuntimeError):
    """A worker process raised (its traceback is the message) or died."""


@dataclass(frozen=True)
class Setting:
    workers: int  # R
    inner_steps: int  # H
    rounds: int  # T
    slow: dict[int, float]  # worker: F
    quorum: int  # Q
    method: str = "diloco"
    compression: str = "none"
    seed: int = 0

    def policy(self, mode: str) -> RoundPolicy:
        """The library's rule for ``mode``, as the flow builds it from ``diloco.sync`` and ``diloco.quorum``."""
        sync = "async" if mode == "async" else "quorum" if mode.startswith("quorum") else "sync"
        quorum = self.quorum if sync == "quorum" else None
        return RoundPolicy(self.workers, self.inner_steps, quorum, default_weighting(sync))


def parse_slow(specs: list[str], workers: int) -> dict[int, float]:
    """``["K:F", ...]`` → {K: F}."""
    slow = {}
    for spec in specs:
        try:
            k, f = spec.split(":")
            slow[int(k)] = float(f)
        except ValueError:
            raise SettingError(f"--slow {spec}: expected K:F, a worker index and a factor, e.g. 3:3") from None
        if not 0 <= int(k) < workers:
            raise SettingError(f"--slow {spec}: worker {k} is not one of the {workers} workers 0..{workers - 1}")
        if not slow[int(k)] >= 1:
            raise SettingError(f"--slow {spec}: the factor must be at least 1")
    return slow


def pack(state: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def unpack(blob: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(blob), weights_only=True)


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().float().clone() for name, t in state.items()}


# --- the worker process ---------------------------------------------------------------------


def _worker(k: int, train: torch.Tensor, heldout: torch.Tensor, inbox, outbox, version, cancel) -> None:
    die_with_parent()
    torch.set_num_threads(1)
    try:
        _serve(k, train, heldout, inbox, outbox, version, cancel)
    except BaseException:
        outbox.put(("error", k, traceback.format_exc()))


def _serve(k: int, train: torch.Tensor, heldout: torch.Tensor, inbox, outbox, version, cancel) -> None:
    """Answer the server's messages until told to stop: reset (a new mode), global (train one
    payload from it), eval (a snapshot's held-out loss)."""
    learner = stream = residual = None
    evaluator = None
    while True:
        message = inbox.get()
        kind = message[0]
        if kind == "stop":
            return
        if kind == "reset":
            setting, drop_late = Setting(**message[1]), message[2]
            learner = Learner(tiny_qwen2(), setting.inner_steps * setting.rounds)
            stream = shard_batches(len(train), setting.workers, setting.seed)[k]
            residual = None if setting.compression == "none" else {}
            slow, n = setting.slow.get(k, 1.0), 0
            outbox.put(("ready", k, None))
        elif kind == "global":
            _, base_version, blob, steps = message
            base = unpack(blob)
            learner.model.load_state_dict(base)
            start, done = time.perf_counter(), 0
            for _ in range(steps):
                step = time.perf_counter()
                learner.train([train[next(stream)]])
                done += 1
                if slow > 1:
                    cancel.wait((slow - 1) * (time.perf_counter() - step))  # a 1/F share of the time
                if cancel.is_set():
                    break
            if cancel.is_set():  # the run is over: this payload is abandoned
                outbox.put(("aborted", k, None))
                continue
            inner = time.perf_counter() - start
            delta, sent = None, 0
            # A straggler that sees its round gone on without it sends no Δ (the flow's worker's rule).
            if not (drop_late and RoundPolicy.closed_to(base_version, k, version.value, None)):
                delta = {}
                for name, theta_k in learner.model.state_dict().items():
                    kept = residual.setdefault(name, torch.zeros_like(base[name])) if residual is not None else None
                    payload, kept = compress_with_feedback(
                        name, base[name] - theta_k.float(), setting.compression, kept
                    )
                    if residual is not None:
                        residual[name] = kept
                    delta.update(payload)
                sent = payload_bytes(delta)
                delta = pack(delta)
            outbox.put(
                (
                    "payload",
                    k,
                    {
                        "worker": k,
                        "n": n,
                        "base": base_version,
                        "steps": done,
                        "tokens": done * BATCH * CONTEXT,
                        "delta": delta,
                        "bytes": sent,
                        "inner_seconds": inner,
                    },
                )
            )
            n += 1
        elif kind == "eval":
            _, index, blob = message
            evaluator = evaluator or tiny_qwen2()
            evaluator.load_state_dict(unpack(blob))
            outbox.put(("loss", k, (index, heldout_loss(evaluator, heldout))))
        else:
            raise ValueError(f"unknown message {kind!r}")


# --- the server's side ------------------------------------------------------------------------


class Pool:
    """R worker processes and their queues. A worker's exception surfaces in ``receive`` with its
    traceback; a worker that dies without a word is noticed within ``POLL_S``; ``close`` (or
    leaving the ``with`` block, on any error) stops, joins and if need be kills them all."""

    def __init__(self, train: torch.Tensor, heldout: torch.Tensor, workers: int):
        context = torch.multiprocessing.get_context(START_METHOD)
        if START_METHOD == "forkserver":  # imported once by the fork server, not once per worker
            context.set_forkserver_preload([__name__])
        self.workers = workers
        self.outbox = context.Queue()
        self.inboxes = [context.Queue() for _ in range(workers)]
        self.version = context.Value("i", 0)  # the newest global's version, read by drop-rule workers
        self.cancel = context.Event()  # set at the end of a run: in-flight payloads are abandoned
        self.processes = [
            context.Process(
                target=_worker,
                args=(k, train, heldout, self.inboxes[k], self.outbox, self.version, self.cancel),
                name=f"straggler-bench-worker-{k}",
                daemon=True,
            )
            for k in range(workers)
        ]
        try:
            for process in self.processes:
                process.start()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, k: int, *message) -> None:
        self.inboxes[k].put(message)

    def receive(self) -> tuple[str, int, object]:
        while True:
            try:
                message = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                dead = [(k, p.exitcode) for k, p in enumerate(self.processes) if not p.is_alive()]
                if not dead:
                    continue
                try:  # its last words may still be on their way
                    message = self.outbox.get(timeout=POLL_S)
                except queue.Empty:
                    raise WorkerFailed(f"worker process(es) died without a word (worker, exit code): {dead}") from None
            if message[0] == "error":
                raise WorkerFailed(f"worker {message[1]} failed:\n{message[2]}")
            return message

    def reset(self, setting: Setting, drop_late: bool) -> None:
        """A fresh Learner, stream and residual in every worker; returns when all are ready."""
        self.version.value = 0
        self.cancel.clear()
        for k in range(self.workers):
            self.send(k, "reset", asdict(setting), drop_late)
        ready = set()
        while len(ready) < self.workers:
            kind, k, _ = self.receive()
            if kind != "ready":
                raise WorkerFailed(f"worker {k} sent {kind!r} while resetting")
            ready.add(k)

    def finish(self, busy: set[int]) -> None:
        """Cancel the payloads in flight at the end of a run and wait until every worker is idle."""
        self.cancel.set()
        while busy:
            _, k, _ = self.receive()  # its payload, finished just now, or "aborted"
            busy.discard(k)
        self.cancel.clear()

    def evaluate(self, states: list[dict[str, torch.Tensor]]) -> list[float]:
        """Held-out losses of ``states``, spread over the idle workers."""
        for i, state in enumerate(states):
            self.send(i % self.workers, "eval", i, pack(state))
        losses: dict[int, float] = {}
        for _ in tqdm(states, desc="held-out loss of the snapshots", unit="θ", leave=False):
            kind, k, answer = self.receive()
            if kind != "loss":
                raise WorkerFailed(f"worker {k} sent {kind!r} while evaluating")
            losses[answer[0]] = answer[1]
        return [losses[i] for i in range(len(states))]

    def close(self) -> None:
        for inbox, process in zip(self.inboxes, self.processes):
            if process.is_alive():
                with contextlib.suppress(OSError, ValueError):  # a closed queue: the worker is going anyway
                    inbox.put(("stop",))
        for process in self.processes:
            if process.pid is not None:
                process.join(timeout=10)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        for q in (self.outbox, *self.inboxes):
            q.cancel_join_thread()
            q.close()


@dataclass
class Snapshot:
    seconds: float  # since θ0 was sent
    version: int  # outer steps (sync, quorum) or arrivals applied (async)
    state: dict[str, torch.Tensor]
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # the machine's, 1-minute average


@dataclass
class WorkerStats:
    payloads: int = 0  # completed during the run (Δ sent or, dropped, not)
    applied: int = 0
    dropped: int = 0
    steps: int = 0  # local steps of the completed payloads
    steps_applied: int = 0
    bytes_sent: int = 0
    steps_per_payload: list[int] = field(default_factory=list)

    def received(self, p: dict) -> None:
        self.payloads, self.steps = self.payloads + 1, self.steps + p["steps"]
        self.bytes_sent += p["bytes"]
        self.steps_per_payload.append(p["steps"])

    def took(self, p: dict) -> None:
        self.applied, self.steps_applied = self.applied + 1, self.steps_applied + p["steps"]


class Server:
    """One mode's global θ, its snapshots (after every outer step) and what each worker sent, with
    the library's rule for the mode. ``take`` gets each payload as it arrives and returns the
    workers to send the newest global to, each with its steps; ``clock``: seconds since θ0 was sent."""

    drops_late = False  # whether a worker that finds its round gone on sends no Δ

    def __init__(self, setting: Setting, mode: str, theta0: dict[str, torch.Tensor], clock: Callable[[], float]):
        self.setting, self.policy, self.clock = setting, setting.policy(mode), clock
        self.method, self.theta = METHODS[setting.method], clone(theta0)
        self.version, self.total = 0, setting.rounds  # the newest global's, the last one's
        self.stats = [WorkerStats() for _ in range(setting.workers)]
        self.snapshots = [Snapshot(0.0, 0, clone(theta0))]

    @property
    def done(self) -> bool:
        return self.version >= self.total

    def delta(self, p: dict) -> dict[str, torch.Tensor]:
        payload = unpack(p["delta"])
        return {name: decompress(payload, name, tuple(t.shape)) for name, t in self.theta.items()}

    def snapshot(self) -> float:
        self.snapshots.append(Snapshot(self.clock(), self.version, clone(self.theta)))
        return self.snapshots[-1].seconds


class RoundServer(Server):
    """``sync`` and the quorum modes: T rounds, closed (``round_closes``: all R, or the first Q
    from the round's global), weighed (``weights``) and stepped (``aggregate_deltas``) as the
    flow's; a late payload told by ``closed_to``, dropped, or with ``quorum-discount`` kept for the
    next round, its weight × 1 / (1 + staleness)."""

    def __init__(self, setting: Setting, mode: str, theta0: dict[str, torch.Tensor], clock: Callable[[], float]):
        super().__init__(setting, mode, theta0, clock)
        self.keep_late = mode == "quorum-discount"
        self.drops_late, self.momentum = not self.keep_late, {}
        self.fresh, self.late, self.dropped, self.rounds = [], [], [], []

    def take(self, p: dict) -> list[tuple[int, int]]:
        k, H = p["worker"], self.setting.inner_steps
        self.stats[k].received(p)
        # Here a round's members are decided with its global, at once: the version alone tells.
        if self.policy.closed_to(p["base"], k, self.version, None):
            if self.keep_late:
                self.late.append(p)
            else:
                self.stats[k].dropped += 1
                self.dropped.append({"worker": k, "base": p["base"], "arrived_at_version": self.version})
            return [(k, H)]  # it joins the newest global at once
        self.fresh.append(p)
        if not self.policy.round_closes([q["worker"] for q in self.fresh], failed=()):
            return []
        members = self.close_round()
        return [] if self.done else [(j, H) for j in members]

    def close_round(self) -> list[int]:
        """Step θ with the round's payloads (and the late ones kept); returns the round's members."""
        # In worker order, as the flow's rounds: the same sums in the same order in every run (with
        # momentum, rounding differences would grow over the rounds).
        taken = sorted(self.fresh, key=lambda p: p["worker"]) + self.late
        staleness = [self.version - p["base"] for p in taken]  # 0 but for the late payloads
        weights = self.policy.weights([p["tokens"] for p in taken]).double() / (1 + torch.tensor(staleness))
        deltas, rules, sent = [self.delta(p) for p in taken], list(self.method.rules), sum(p["bytes"] for p in taken)
        aggregate_deltas(self.theta, deltas, weights, rules, self.method.outer, self.momentum, sent)
        for p in taken:
            self.stats[p["worker"]].took(p)
        self.version += 1
        members = [p["worker"] for p in taken[: len(self.fresh)]]
        late = [(p, s) for p, s in zip(taken, staleness) if s]
        self.rounds.append(
            {
                "round": self.version,
                "seconds": self.snapshot(),
                "aggregated": members,
                "stragglers": self.policy.stragglers(members, failed=()),
                "late_applied": [
                    {"worker": p["worker"], "base": p["base"], "staleness": s, "factor": 1 / (1 + s)} for p, s in late
                ],
                "late_dropped": self.dropped,
                "weights": (weights / weights.sum()).tolist(),
            }
        )
        self.fresh, self.late, self.dropped = [], [], []
        return members

    def records(self) -> dict:
        return {"stragglers_per_round": [r["stragglers"] for r in self.rounds], "rounds": self.rounds}


class ArrivalServer(Server):
    """``async``: each payload applied as it arrives by ``AsyncOuter`` (window R, the library's
    arrival weight), its worker sent the newest global at once for ``local_steps`` (DyLU) steps,
    until it has sent T payloads."""

    def __init__(self, setting: Setting, mode: str, theta0: dict[str, torch.Tensor], clock: Callable[[], float]):
        super().__init__(setting, mode, theta0, clock)
        self.outer = AsyncOuter(self.theta, self.method.outer, setting.workers, self.policy.weighting)
        self.speeds: dict[int, float] = {}  # each worker's steps per second in its latest payload
        self.arrivals, self.total = [], setting.workers * setting.rounds  # a global an arrival

    def take(self, p: dict) -> list[tuple[int, int]]:
        k, stats = p["worker"], self.stats[p["worker"]]
        stats.received(p)
        weight = self.outer.apply(self.delta(p), p["tokens"])
        stats.took(p)
        self.speeds[k] = p["steps"] / p["inner_seconds"]
        arrival = {"worker": k, "n": p["n"], "base": p["base"], "staleness": self.version - p["base"]}
        self.version += 1
        seconds = self.snapshot() if self.version % self.setting.workers == 0 else self.clock()  # a window closed
        self.arrivals.append(arrival | {"steps": p["steps"], "weight": weight, "seconds": seconds})
        return [(k, self.policy.local_steps(self.speeds, k))] if stats.payloads < self.setting.rounds else []

    def records(self) -> dict:
        return {"arrivals": self.arrivals}


def run_mode(pool: Pool, mode: str, setting: Setting, theta0: dict[str, torch.Tensor]) -> Server:
    """One mode on the pool's workers: θ0 to each, then each payload to the mode's server and the
    newest global to the workers it names, to the last outer step; work in flight then is cancelled."""
    server = (ArrivalServer if mode == "async" else RoundServer)(
        setting, mode, theta0, clock=lambda: time.perf_counter() - start
    )
    pool.reset(setting, drop_late=server.drops_late)
    start, blob = time.perf_counter(), pack(server.theta)  # the server's clock runs from here
    for k in range(setting.workers):
        pool.send(k, "global", 0, blob, setting.inner_steps)
    busy = set(range(setting.workers))
    with tqdm(total=server.total, desc=f"{mode} R={setting.workers}", unit="global", leave=False) as bar:
        while not server.done:
            _, k, p = pool.receive()
            busy.discard(k)
            before = server.version
            sends = server.take(p)
            pool.version.value = server.version
            blob = pack(server.theta) if sends else blob
            for j, steps in sends:
                pool.send(j, "global", server.version, blob, steps)
                busy.add(j)
            bar.update(server.version - before)
    pool.finish(busy)
    return server


def figures(run: Server, losses: list[float], sync_wall: float | None) -> dict:
    """A mode's figures for the table and the JSON (the snapshots' states left out)."""
    curve = [
        {"seconds": s.seconds, "version": s.version, "loss": loss, "load": s.load}
        for s, loss in zip(run.snapshots, losses)
    ]
    at_sync = None
    if sync_wall is not None:
        at_sync = [c["loss"] for c in curve if c["seconds"] <= sync_wall][-1]
    result = {
        "final_loss": curve[-1]["loss"],
        "wall_seconds": run.snapshots[-1].seconds,
        "loss_at_sync_wall": at_sync,
        "bytes_sent": sum(s.bytes_sent for s in run.stats),
        "load_average": sum(c["load"] for c in curve[1:]) / (len(curve) - 1),  # during the run, for the record
        "workers": [asdict(s) for s in run.stats],
        "curve": curve,
    }
    return result | run.records()


def run_bench(
    corpus: Corpus, setting: Setting, modes: list[str] | tuple[str, ...] = MODES, pool: Pool | None = None
) -> dict:
    """Every mode of ``setting`` from the same θ0 (``tiny_qwen2``), then every snapshot's held-out
    loss; ``sync`` first when it runs (the others' loss at its wall time needs it)."""
    check_setting(setting)
    if pool is None:
        with Pool(corpus.train, corpus.heldout, setting.workers) as own:
            return run_bench(corpus, setting, modes, own)
    if pool.workers != setting.workers:
        raise SettingError(f"a pool of {pool.workers} workers for a setting of {setting.workers}")
    modes = sorted(modes, key=MODES.index)
    theta0 = clone(tiny_qwen2(setting.seed).state_dict())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's work is small; the cores are the workers'
    try:
        results: dict = {}
        initial = pool.evaluate([theta0])[0]
        sync_wall = None
        for mode in modes:
            run = run_mode(pool, mode, setting, theta0)
            sync_wall = run.snapshots[-1].seconds if mode == "sync" else sync_wall
            losses = [initial, *pool.evaluate([s.state for s in run.snapshots[1:]])]
            results[mode] = r = figures(run, losses, sync_wall)
            print(
                f"{mode}: wall {r['wall_seconds']:.1f} s, final held-out loss {losses[-1]:.4f}, "
                f"{r['bytes_sent'] / 1e6:,.1f} MB sent; load average {r['load_average']:.1f} "
                f"on {os.cpu_count()} CPUs",
                flush=True,
            )
        return {"initial_loss": initial, "modes": results}
    finally:
        torch.set_num_threads(threads)


def check_setting(setting: Setting) -> None:
    if setting.method not in ARRIVAL_METHODS:
        why = (
            "Iso-C aggregates several payloads at once and has no per-arrival form"
            if setting.method == "isoloco"
            else "data-parallel has no rounds to straggle in"
        )
        raise SettingError(f"--slow runs {' and '.join(ARRIVAL_METHODS)}, not {setting.method}: {why}")
    if not 1 <= setting.quorum <= setting.workers:
        raise SettingError(f"--quorum {setting.quorum}: needs 1 ≤ Q ≤ R = {setting.workers}")
    if setting.workers < 2:
        raise SettingError("--slow needs at least 2 workers")


# --- the command ------------------------------------------------------------------------------


def _workers_column(values: list) -> str:
    return ", ".join(str(v) for v in values)


def mode_facts(mode: str, r: dict) -> list[str]:
    """Stragglers per round, payloads applied / arrived per worker, local steps per worker."""
    workers = r["workers"]
    if "stragglers_per_round" in r:
        per_round = r["stragglers_per_round"]
        mean = sum(map(len, per_round)) / len(per_round)
        who = sorted({k for s in per_round for k in s})
        stragglers = f"{mean:.2f} ({_workers_column(who) or 'none'})"
    else:
        stragglers = "— (async)"
    arrivals = _workers_column(f"{w['applied']}/{w['payloads']}" for w in workers)
    steps = _workers_column(w["steps"] for w in workers)
    return [stragglers, arrivals, steps]


def summary_table(result: dict, sync_wall: float | None) -> str:
    rows = []
    for mode, r in result["modes"].items():
        at_sync = "—" if r["loss_at_sync_wall"] is None else f"{r['loss_at_sync_wall']:.4f}"
        rows.append(
            [
                mode,
                f"{r['final_loss']:.4f}",
                f"{r['wall_seconds']:.1f}",
                at_sync,
                f"{r['bytes_sent'] / 1e6:,.1f} MB",
                *mode_facts(mode, r),
                f"{r['load_average']:.1f}",
            ]
        )
    at = f"loss at sync's {sync_wall:.0f} s" if sync_wall is not None else "loss at sync's wall s"
    headers = [
        "mode",
        "final loss",
        "wall s",
        at,
        "bytes sent",
        "stragglers / round",
        "applied / arrived",
        "local steps",
        "load",
    ]
    return markdown(headers, rows)


def plot(result: dict, setting: Setting, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, r in result["modes"].items():
        curve = r["curve"]
        ax.plot([c["seconds"] for c in curve], [c["loss"] for c in curve], marker=".", label=mode)
    if "sync" in result["modes"]:
        ax.axvline(result["modes"]["sync"]["wall_seconds"], color="grey", ls=":", lw=1)
    slow = ", ".join(f"worker {k} {f:g}× slower" for k, f in setting.slow.items())
    ax.set(
        title=f"{setting.method}, R = {setting.workers}, H = {setting.inner_steps}, T = {setting.rounds}, "
        f"quorum Q = {setting.quorum}; {slow}",
        xlabel="wall time (s)",
        ylabel="held-out loss (nats / byte)",
    )
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out)


def main(args: argparse.Namespace) -> None:
    try:
        _main(args)
    except SettingError as err:
        raise SystemExit(f"merit: error: {err}") from None


def _main(args: argparse.Namespace) -> None:
    if len(args.workers) != 1:
        raise SettingError("--slow runs one number of workers: give --workers R once")
    if len(args.compression) != 1:
        raise SettingError("--slow runs one compression: give --compression once")
    workers = args.workers[0]
    slow = parse_slow(args.slow, workers)
    quorum = workers - 1 if args.quorum is None else args.quorum
    settings = [
        Setting(workers, args.inner_steps, args.rounds, slow, quorum, method, args.compression[0])
        for method in args.methods
    ]
    for setting in settings:
        check_setting(setting)
    corpus = load_corpus()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"straggler bench: R = {workers} worker processes (forked from a fork server, 1 thread each), "
        f"H = {args.inner_steps}, T = {args.rounds}, batch {BATCH} per worker, slow: {slow}, quorum Q = {quorum}; "
        f"modes: {', '.join(args.modes)}; {len(corpus.train)} training windows, {len(corpus.heldout)} held out"
    )
    with Pool(corpus.train, corpus.heldout, workers) as pool:
        for setting in settings:
            start = time.perf_counter()
            result = run_bench(corpus, setting, args.modes, pool)
            name = f"stragglers-{setting.method}" + ("" if setting.compression == "none" else f"-{setting.compression}")
            sync_wall = result["modes"]["sync"]["wall_seconds"] if "sync" in result["modes"] else None
            result["setting"] = asdict(setting) | {
                "outer": METHODS[setting.method].outer.model_dump(),
                "batch_per_worker": BATCH,
                "modes": list(result["modes"]),
                "wall_seconds": "from θ0 sent to the last outer step (T rounds, R·T arrivals in async)",
                "loss_at_sync_wall": "the latest snapshot taken at or before sync's wall time",
                "bytes_sent": "every Δ payload the workers sent during the run, as compressed, applied or not",
                "rounds": "the library's: pipeline.diloco.policy.RoundPolicy (members, late payloads, weights, "
                "async steps), aggregate_deltas (a round), AsyncOuter (an arrival)",
                "weighting": "rounds by tokens, async arrivals 1 / R each (the library's defaults)",
                "discount": "a late payload's weight × 1 / (1 + staleness), weights renormalised",
                "dylu": "H_k = max(1, min(H, round(H · speed_k / max_j speed_j)))",
                "cpus": os.cpu_count(),
                "load": "the machine's 1-minute load average at each snapshot (os.getloadavg), for the record",
                "bench_seconds": time.perf_counter() - start,
            }
            write_text_atomic(out / f"{name}.json", json.dumps(result, indent=1))
            plot(result, setting, out / f"{name}.png")
            print(f"\n{setting.method}, R = {workers}, slow {slow}, Q = {quorum}:\n{summary_table(result, sync_wall)}")
            print(
                "\nwall s: from θ0 sent to the last outer step; loss at sync's wall time: the latest snapshot at "
                "or before it; bytes: Δ payloads sent by all workers; applied / arrived: per worker, payloads "
                "applied / payloads that reached the server; local steps: each worker's inner steps in "
                f"completed payloads; load: the machine's 1-minute load average during the run ({os.cpu_count()} CPUs)"
            )
            print(f"outputs: {out / (name + '.json')}, {out / (name + '.png')}")
