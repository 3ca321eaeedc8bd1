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

Modes, all from the same θ0 with the same shards, seeds and outer method:

- ``sync``: each of T rounds waits for all R payloads, then the library's weighted averaging
  (``merge_state_dicts``, weights by tokens) and the ``OuterSGD`` step, exactly the last line of
  :func:`pipeline.diloco.aggregate` (the workers send Δ, not θ_k, so its first half — computing
  and compressing Δ — runs in the workers).
- ``quorum-drop`` / ``quorum-discount``: a round aggregates as soon as Q workers (``--quorum``,
  default R − 1) sent a payload from the current global; the others are stragglers and go on with
  the round they are training. A straggler's late payload, then: ``drop`` — discarded, the worker
  joins the newest global with its own inner state (the flow's rule, OpenDiLoCo's): the worker
  sees that the global has moved on before sending and sends no Δ (0 bytes), as the flow's worker
  does; ``discount`` — kept for the NEXT aggregate, its weight (tokens) multiplied by
  1 / (1 + s), s = the rounds elapsed since its base global at that aggregate (s = 0 for the
  round's own payloads), and the worker joins the newest global at once. The weights are
  renormalised (the merge library always normalises them): the aggregate stays a weighted mean
  of pseudo-gradients, so η keeps its meaning and a late payload only takes a smaller share. Δ is
  relative, so a late payload needs no old global. No round timeout (the flow's
  ``round_timeout_s``): a round closes at the Q-th payload. T rounds of the server.
- ``async``: every payload is applied when it arrives (:class:`pipeline.diloco.aggregate.AsyncOuter`,
  window R, each arrival weighing 1 / R: delayed Nesterov) and its worker gets the newest global at once;
  dynamic local steps (DyLU, Liu et al. 2024, arXiv 2401.09135): a worker's next payload has
  H_k = max(1, round(H × speed_k / max_j speed_j)) steps, speed = steps / inner seconds of each
  worker's latest payload (H while a worker has none). Each worker sends T payloads; the run ends
  when all R·T are applied.

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
from pipeline.diloco.aggregate import AsyncOuter
from pipeline.diloco.compress import compress_with_feedback, decompress, payload_bytes
from pipeline.figures import save_figure
from pipeline.merge import merge_state_dicts
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
            if not (drop_late and version.value > base_version):  # a dropped straggler sends no Δ
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


@dataclass
class ModeRun:
    mode: str
    wall_seconds: float
    bytes_sent: int
    snapshots: list[Snapshot]
    workers: list[WorkerStats]
    rounds: list[dict] = field(default_factory=list)  # sync, quorum
    arrivals: list[dict] = field(default_factory=list)  # async


def _received(stats: list[WorkerStats], p: dict) -> None:
    s = stats[p["worker"]]
    s.payloads, s.steps, s.bytes_sent = s.payloads + 1, s.steps + p["steps"], s.bytes_sent + p["bytes"]
    s.steps_per_payload.append(p["steps"])


def _applied(stats: list[WorkerStats], p: dict) -> None:
    s = stats[p["worker"]]
    s.applied, s.steps_applied = s.applied + 1, s.steps_applied + p["steps"]


def _delta(p: dict, theta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    payload = unpack(p["delta"])
    return {name: decompress(payload, name, tuple(t.shape)) for name, t in theta.items()}


def launch(pool: Pool, theta: dict[str, torch.Tensor], R: int, H: int) -> tuple[float, list[Snapshot], set[int], bytes]:
    """θ0 to every worker: the run's clock starts, its first snapshot, every worker busy, and θ0
    as sent."""
    start = time.perf_counter()
    blob = pack(theta)
    for k in range(R):
        pool.send(k, "global", 0, blob, H)
    return start, [Snapshot(0.0, 0, clone(theta))], set(range(R)), blob


def run_rounds(pool: Pool, setting: Setting, theta0: dict[str, torch.Tensor], mode: str) -> ModeRun:
    """``sync`` (a quorum of R) or ``quorum-drop`` / ``quorum-discount`` (a quorum of Q; the rule
    for a late payload)."""
    outer, rules = METHODS[setting.method].outer, list(METHODS[setting.method].rules)
    R, H, T = setting.workers, setting.inner_steps, setting.rounds
    quorum, rule = (R, "drop") if mode == "sync" else (setting.quorum, mode.removeprefix("quorum-"))
    theta, momentum = clone(theta0), {}
    stats = [WorkerStats() for _ in range(R)]
    pool.reset(setting, drop_late=rule == "drop")
    version, fresh, late, dropped, rounds = 0, [], [], [], []
    start, snapshots, busy, blob = launch(pool, theta, R, H)
    with tqdm(total=T, desc=f"{mode} R={R}", unit="round", leave=False) as bar:
        while version < T:
            _, k, p = pool.receive()
            busy.discard(k)
            _received(stats, p)
            if p["base"] == version:
                fresh.append(p)
            else:  # a straggler's: it joins the newest global at once
                if rule == "drop" or p["delta"] is None:
                    stats[k].dropped += 1
                    dropped.append({"worker": k, "base": p["base"], "arrived_at_version": version})
                else:
                    late.append(p)
                pool.send(k, "global", version, blob, H)
                busy.add(k)
            if len(fresh) < quorum:
                continue
            # In worker order, not arrival order: the same sums in the same order in every run
            # (with momentum, rounding differences grow over the rounds).
            fresh.sort(key=lambda p: p["worker"])
            entries = [(p, version - p["base"]) for p in fresh + late]
            weights = [p["tokens"] / (1 + s) for p, s in entries]
            outer.step_all(theta, merge_state_dicts([_delta(p, theta) for p, _ in entries], weights, rules), momentum)
            version += 1
            pool.version.value = version
            snapshots.append(Snapshot(time.perf_counter() - start, version, clone(theta)))
            for p, _ in entries:
                _applied(stats, p)
            aggregated = [p["worker"] for p in fresh]
            rounds.append(
                {
                    "round": version,
                    "seconds": snapshots[-1].seconds,
                    "aggregated": aggregated,
                    "stragglers": [j for j in range(R) if j not in aggregated],
                    "late_applied": [
                        {"worker": p["worker"], "base": p["base"], "staleness": s, "factor": 1 / (1 + s)}
                        for p, s in entries
                        if s > 0
                    ],
                    "late_dropped": dropped,
                    "weights": [w / sum(weights) for w in weights],
                }
            )
            blob = pack(theta)
            if version < T:
                for j in aggregated:
                    pool.send(j, "global", version, blob, H)
                    busy.add(j)
            fresh, late, dropped = [], [], []
            bar.update()
    pool.finish(busy)
    return ModeRun(mode, snapshots[-1].seconds, sum(s.bytes_sent for s in stats), snapshots, stats, rounds=rounds)


def dylu_steps(inner_steps: int, speeds: dict[int, float], k: int) -> int:
    """DyLU: H_k = max(1, round(H × speed_k / max_j speed_j)); H before k's speed is measured."""
    if k not in speeds:
        return inner_steps
    return max(1, round(inner_steps * speeds[k] / max(speeds.values())))


def run_async(pool: Pool, setting: Setting, theta0: dict[str, torch.Tensor]) -> ModeRun:
    """Every payload applied as it arrives (AsyncOuter, window R, each weighing 1 / R); DyLU steps."""
    outer = METHODS[setting.method].outer
    R, H, T = setting.workers, setting.inner_steps, setting.rounds
    theta = clone(theta0)
    server = AsyncOuter(theta, outer, window=R)
    stats = [WorkerStats() for _ in range(R)]
    pool.reset(setting, drop_late=False)
    speeds: dict[int, float] = {}
    arrivals: list[dict] = []
    start, snapshots, busy, blob = launch(pool, theta, R, H)
    with tqdm(total=R * T, desc=f"async R={R}", unit="arrival", leave=False) as bar:
        while len(arrivals) < R * T:
            _, k, p = pool.receive()
            busy.discard(k)
            _received(stats, p)
            weight = server.apply(_delta(p, theta), p["tokens"])
            _applied(stats, p)
            speeds[k] = p["steps"] / p["inner_seconds"]
            arrivals.append(
                {
                    "worker": k,
                    "n": p["n"],
                    "base": p["base"],
                    "staleness": len(arrivals) - p["base"],  # arrivals applied since its global
                    "steps": p["steps"],
                    "weight": weight,
                    "seconds": time.perf_counter() - start,
                }
            )
            if len(arrivals) % R == 0:
                snapshots.append(Snapshot(time.perf_counter() - start, len(arrivals), clone(theta)))
            if stats[k].payloads < T:
                blob = pack(theta)
                pool.send(k, "global", len(arrivals), blob, dylu_steps(H, speeds, k))
                busy.add(k)
            bar.update()
    pool.finish(busy)
    return ModeRun(
        "async", snapshots[-1].seconds, sum(s.bytes_sent for s in stats), snapshots, stats, arrivals=arrivals
    )


def run_mode(pool: Pool, mode: str, setting: Setting, theta0: dict[str, torch.Tensor]) -> ModeRun:
    return run_async(pool, setting, theta0) if mode == "async" else run_rounds(pool, setting, theta0, mode)


def figures(run: ModeRun, losses: list[float], sync_wall: float | None) -> dict:
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
        "wall_seconds": run.wall_seconds,
        "loss_at_sync_wall": at_sync,
        "bytes_sent": run.bytes_sent,
        "load_average": sum(c["load"] for c in curve[1:]) / (len(curve) - 1),  # during the run, for the record
        "workers": [asdict(s) for s in run.workers],
        "curve": curve,
    }
    if run.rounds:
        result["stragglers_per_round"] = [r["stragglers"] for r in run.rounds]
        result["rounds"] = run.rounds
    if run.arrivals:
        result["arrivals"] = run.arrivals
    return result


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
            sync_wall = run.wall_seconds if mode == "sync" else sync_wall
            losses = [initial, *pool.evaluate([s.state for s in run.snapshots[1:]])]
            results[mode] = figures(run, losses, sync_wall)
            print(
                f"{mode}: wall {run.wall_seconds:.1f} s, final held-out loss {losses[-1]:.4f}, "
                f"{run.bytes_sent / 1e6:,.1f} MB sent; load average {results[mode]['load_average']:.1f} "
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
                "discount": "a late payload's weight × 1 / (1 + staleness), weights renormalised",
                "dylu": "H_k = max(1, round(H · speed_k / max_j speed_j))",
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
