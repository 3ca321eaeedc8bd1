"""The round loop of one DiLoCo variant over a run directory, without Prefect: R workers alive for
the whole run, the rounds aggregated here as their payloads arrive (sync, quorum) or each payload
applied as it arrives (async), the held-out loss of the global weights beside them.

Where the workers and a round's parts run is the caller's: ``launch(k)`` starts worker k and
returns a future (a ``concurrent.futures.Future``, or a Prefect task's future: both have
``add_done_callback`` and ``result``); ``run_parts(r, workers)`` aggregates round r's S parts.
By default (``run_rounds`` from Python) the workers are processes of this machine started from
threads, and the parts threads of this process; the diloco flow (``flows/diloco.py``) passes
Prefect tasks and deployments instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import MANIFEST
from pipeline.config import RunConfig
from pipeline.devices import usable_gpus
from pipeline.diloco.asynchronous import (
    Arrival,
    apply_arrival,
    arrivals,
    closes_window,
    next_arrival,
    save_arrivals,
)
from pipeline.diloco.asynchronous import retire as retire_arrivals
from pipeline.diloco.plan import DilocoPlan
from pipeline.diloco.rounds import (
    POLL_S,
    abort,
    aggregate_part,
    aggregate_round,
    decide_round,
    delta_dir,
    global_dir,
    records,
    recover,
    retire,
    rounds_done,
    save_record,
)

Launch = Callable[[int], Any]  # worker k -> a future of its run
RunParts = Callable[[int, list[int]], None]  # (round, the workers aggregated) -> the round's parts written


def worker_slots(cfg: RunConfig, workers: int) -> list[list[int] | None]:
    """The devices of each worker: all R train at once (they meet every round). On CPU they share
    the cores; on GPUs each takes ``train.processes`` of them (preflight checked that they fit);
    on a deployment, machines of their own."""
    gpus = usable_gpus(cfg)
    if cfg.flow.branch_deployment or not gpus:
        return [None] * workers
    per = cfg.train.processes
    return [gpus[k * per : (k + 1) * per] for k in range(workers)]


def local_launch(cfg: RunConfig, plan: DilocoPlan) -> Launch:
    """Workers as processes of this machine (``train_worker``), each waited on by a thread."""
    from pipeline.diloco.launch import train_worker

    slots, pool = worker_slots(cfg, plan.size), ThreadPoolExecutor(plan.size)
    return lambda k: pool.submit(train_worker, plan, k, False, slots[k], plan.size)


def local_parts(cfg: RunConfig, plan: DilocoPlan) -> RunParts:
    """A round's S parts at once, a thread each (torch releases the GIL: S cores)."""

    def run(r: int, workers: list[int]) -> None:
        with ThreadPoolExecutor(plan.aggregators) as pool:
            futures = [
                pool.submit(aggregate_part, plan, r, workers, s, cfg.merge.device, cfg.merge.block_mb)
                for s in range(plan.aggregators)
            ]
            for future in futures:
                future.result()

    return run


class Workers:
    """The R workers of a variant as futures; one that fails for good is started again for the
    next round (it resumes from its last checkpoint and joins the newest global weights)."""

    def __init__(self, plan: DilocoPlan, launch: Launch):
        self.plan, self.launch = plan, launch
        self.ended: queue.Queue[int] = queue.Queue()
        self.futures: dict[int, Any] = {}
        self.failures: dict[int, str] = {}
        self.running: set[int] = set()
        for k in range(plan.size):
            self.start(k)

    def start(self, k: int) -> None:
        future = self.launch(k)
        future.add_done_callback(lambda _, k=k: self.ended.put(k))
        self.futures[k] = future
        self.failures.pop(k, None)
        self.running.add(k)

    def collect(self) -> None:
        """Note the workers that ended, and those that ended with an error."""
        while not self.ended.empty():
            k = self.ended.get()
            self.running.discard(k)
            try:
                self.futures[k].result()
            except Exception as err:
                self.failures[k] = str(err)

    def wait_round(self, r: int) -> list[int]:
        """The workers whose round-r payload is published, once every other one has failed; in
        quorum mode also once ``quorum`` of them have, or ``round_timeout_s`` after the first."""
        policy, timeout_s, first = self.plan.policy, self.plan.round_timeout_s, None
        while True:
            self.collect()
            sent = [k for k in range(self.plan.size) if (delta_dir(self.plan, r, k) / MANIFEST).is_file()]
            if policy.round_closes(sent, self.failures):
                return sent
            if sent and first is None:
                first = time.monotonic()
            if timeout_s is not None and first is not None and time.monotonic() - first >= timeout_s:
                return sent
            time.sleep(POLL_S)

    def finish(self) -> None:
        for future in self.futures.values():
            with contextlib.suppress(Exception):  # a failure is recorded already (collect)
                future.result()


class Evaluator:
    """Held-out loss of the global weights in a background thread (the next round does not wait
    for it), added to the rounds' records; every ``diloco.eval_every`` rounds and the last."""

    def __init__(self, cfg: RunConfig, run_dir: str, plan: DilocoPlan):
        self.cfg, self.run_dir, self.plan = cfg, run_dir, plan
        self.pool, self.lock, self.pending = ThreadPoolExecutor(1), threading.Lock(), {}

    def save(self, record: dict) -> None:
        with self.lock:
            save_record(self.plan, record)

    def submit(self, r: int, last: bool = False) -> None:
        """Evaluate global r + 1 if due: every ``eval_every`` rounds (async: R arrivals each), and
        the run's ``last``."""
        per_round = self.plan.size if self.plan.sync == "async" else 1
        every, done = self.cfg.diloco.eval_every * per_round, r + 1
        if (last or done == self.plan.final or (every > 0 and done % every == 0)) and r not in self.pending:
            self.pending[r] = self.pool.submit(self._evaluate, r)

    def resume(self) -> None:
        """Evaluate the globals whose evaluation a kill interrupted: due, still there, their record
        without a loss."""
        for record in records(self.plan):
            if "heldout_loss" not in record and (global_dir(self.plan, record["round"] + 1) / MANIFEST).is_file():
                self.submit(record["round"])

    def wait_before(self, v: int) -> None:
        """Wait for the evaluations of the globals older than v (about to be deleted)."""
        for r, future in list(self.pending.items()):
            if r + 1 < v:
                future.result()

    def finish(self) -> None:
        self.pool.shutdown(wait=True)
        for future in self.pending.values():
            future.result()

    def _evaluate(self, r: int) -> None:
        from pipeline.eval import score_heldout

        name, folder = f"{self.plan.variant}-round{r + 1}", str(global_dir(self.plan, r + 1))
        result = score_heldout(self.cfg, self.run_dir, name, folder)
        with self.lock:
            record = next(x for x in records(self.plan) if x["round"] == r)
            save_record(
                self.plan, record | {"heldout_loss": result["loss"], "token_accuracy": result["token_accuracy"]}
            )


def run_rounds(
    cfg: RunConfig,
    run_dir: str,
    plan: DilocoPlan,
    launch: Launch | None = None,
    run_parts: RunParts | None = None,
    log: logging.Logger | logging.LoggerAdapter | None = None,
    progress: Callable[[float], None] | None = None,
) -> None:
    """Train one DiLoCo variant to its last global (or resume it); ``progress`` gets the % done."""
    log = log or logging.getLogger(__name__)
    plan.fix()
    done, evaluator = rounds_done(plan), Evaluator(cfg, run_dir, plan)
    if done:  # killed after writing global `done`, maybe before its bookkeeping: finish it (the last round's too)
        recover(plan, done - 1)
        if plan.sync == "async":
            retire_arrivals(plan, done - 1, arrivals(plan))
        else:
            retire(plan, done - 1)
        evaluator.resume()
    if done >= plan.final:
        evaluator.finish()
        return
    log.info(
        f"DiLoCo {plan.variant}: {plan.size} workers, {plan.rounds} rounds of {plan.inner_steps} steps ({plan.sync})"
    )
    if cfg.diloco.replay and not arrivals(plan):
        save_arrivals(plan, replayed(cfg.diloco.replay, plan))
    abort(plan, None)
    workers = Workers(plan, launch or local_launch(cfg, plan))
    loop = _Loop(cfg, plan, workers, evaluator, run_parts or local_parts(cfg, plan), log)
    try:
        with _cpu_shared_with_workers(cfg):
            began = time.perf_counter()
            for r in range(done, plan.final):
                if (began := loop.step(r, began)) is None:
                    evaluator.submit(r - 1, last=True)  # every worker ended before its last payload
                    break
                if progress is not None:
                    progress(100.0 * (r + 1) / plan.final)
    except BaseException as err:
        # The workers wait for the next global weights: tell them none will come, or they would
        # hold their machines until train.timeout_s.
        abort(plan, f"{type(err).__name__}: {err}")
        raise
    workers.finish()
    evaluator.finish()


class _Loop:
    """One step of the loop: a synchronous round, or an async arrival."""

    def __init__(
        self, cfg: RunConfig, plan: DilocoPlan, workers: Workers, evaluator: Evaluator, run_parts: RunParts, log
    ):
        self.cfg, self.plan, self.workers, self.evaluator, self.log = cfg, plan, workers, evaluator, log
        self.run_parts = run_parts

    def step(self, r: int, began: float) -> float | None:
        return self.arrive(r, began) if self.plan.sync == "async" else self.aggregate(r, began)

    def aggregate(self, r: int, began: float) -> float:
        """Round r once its payloads are in: decide its members (or take those a killed run
        recorded), aggregate, outer step, record; returns when it ended."""
        plan, workers = self.plan, self.workers
        entry = decide_round(plan, r, lambda: self.wait(r))
        sent, notes = entry["workers"], {"failures": entry["failures"], "stragglers": entry["stragglers"]}
        if plan.aggregators > 1:
            self.run_parts(r, sent)
        # With parts written, this only assembles them.
        record = aggregate_round(plan, r, sent, self.cfg.merge.device, self.cfg.merge.block_mb, notes, began)
        ended = time.perf_counter()
        self.evaluator.save(record)
        if record["failures"]:
            self.log.warning(f"DiLoCo {plan.variant} round {r}: left out workers {record['failures']}")
        if record["stragglers"]:
            self.log.info(f"DiLoCo {plan.variant} round {r}: stragglers {record['stragglers']} left out")
        self.evaluator.wait_before(r)  # global r - 1 is about to go
        retire(plan, r)
        self.evaluator.submit(r)
        # Back for the next round, from their last checkpoint: the workers that failed now (after a
        # re-run, those the record names were started with the others already).
        for k in [k for k in workers.failures if k not in workers.running and k not in sent]:
            workers.start(k)
        self.log.info(f"DiLoCo {plan.variant}: round {r + 1}/{plan.rounds} done")
        return ended

    def wait(self, r: int) -> tuple[list[int], dict]:
        """The workers round r aggregates, once their payloads are in, and the notes on the others."""
        plan, workers = self.plan, self.workers
        sent = workers.wait_round(r)
        dropped = {k: workers.failures[k] for k in workers.failures if k not in sent}
        if len(sent) < self.cfg.diloco.min_workers:
            raise RuntimeError(
                f"DiLoCo {plan.variant} round {r}: {len(sent)} of {plan.size} workers sent their pseudo-gradients, "
                f"fewer than diloco.min_workers = {self.cfg.diloco.min_workers}; failed: {dropped}"
            )
        notes = {
            "failures": {str(k): why for k, why in dropped.items()},
            # Still training round r: their payload will find the round closed and be dropped, and
            # they join the next global with their own inner state (OpenDiLoCo's rule).
            "stragglers": plan.policy.stragglers(sent, dropped),
        }
        return sent, notes

    def arrive(self, v: int, began: float) -> float | None:
        """Async: arrival v once a payload is in (the recorded one when replaying): apply it, record
        it; returns when it ended, or None when every worker has ended and no payload is left."""
        plan, workers = self.plan, self.workers
        schedule = arrivals(plan)
        while (arrival := next_arrival(plan, schedule[:v])) is None:
            workers.collect()
            if not workers.running:  # ended: a payload published just before the end is there now
                if (arrival := next_arrival(plan, schedule[:v])) is None:
                    return None
                break
            time.sleep(POLL_S)
        if len(schedule) == v:  # recorded before the global it leads to: a re-run applies the same
            schedule.append(arrival)
            save_arrivals(plan, schedule)
        failed = {k: why for k, why in workers.failures.items() if k not in workers.running}
        notes = {"dropped": sorted(failed), "failures": {str(k): why for k, why in failed.items()}, "stragglers": []}
        record = apply_arrival(plan, v, schedule, self.cfg.merge.device, notes, began)
        ended = time.perf_counter()
        self.evaluator.save(record)
        self.evaluator.wait_before(v)  # globals older than v may go
        retire_arrivals(plan, v, schedule)
        self.evaluator.submit(v)
        if closes_window(plan, v):
            for k in failed if workers.running else []:  # back from their last checkpoint, as in sync mode
                workers.start(k)
            self.log.info(f"DiLoCo {plan.variant}: {v + 1}/{plan.final} arrivals applied")
        return ended


def replayed(path: str, plan: DilocoPlan) -> list[Arrival]:
    """An earlier run's arrivals, to replay (``diloco.replay``): they must name this run's workers.
    Their digests name that run's payloads, not the ones trained again here: left out."""
    source = Path(path)
    try:
        items = [Arrival.model_validate(a).model_copy(update={"digest": None}) for a in json.loads(source.read_text())]
    except (OSError, ValueError) as err:
        raise ValueError(f"diloco.replay: {source}: not an arrivals.json of a DiLoCo async run ({err})") from err
    if any(a.worker >= plan.size for a in items):
        raise ValueError(f"diloco.replay: {source} names workers beyond the {plan.size} of this run")
    return items


@contextlib.contextmanager
def _cpu_shared_with_workers(cfg: RunConfig) -> Iterator[None]:
    """Aggregate with one thread when the workers share this machine's CPU cores: their data
    loaders encode the next round's batches while the aggregator runs, and torch's OpenMP
    threads then spin on descheduled cores (measured on the demo: Iso-C of a round 5.9 s with 2
    threads, 0.02 s with 1)."""
    if cfg.flow.branch_deployment or torch.cuda.device_count():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
