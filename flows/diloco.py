"""The DiLoCo flow: multi-round training with the merge library as the aggregator.

diloco: preflight → prepare → init → warm-up (θ0) → [calibrate, for merit shards] → per method
of ``diloco.methods``: R workers (alive for the whole run: a task each on this machine, or a flow
run each of ``flow.branch_deployment``), and the rounds, aggregated here as the workers' payloads
arrive → held-out evaluation → report. A re-run resumes after the last round whose global
weights exist; the workers resume their inner state from their own checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import prefect.runtime
import torch
from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger

from flows import tasks
from flows.heartbeat import heartbeat
from flows.merit import evaluate_and_report, start
from flows.report import artifact_key
from pipeline.checkpoint import MANIFEST
from pipeline.config import DilocoMethod, RunConfig
from pipeline.diloco.asynchronous import Arrival, apply_arrival, arrivals, closes_window, next_arrival, save_arrivals
from pipeline.diloco.asynchronous import retire as retire_arrivals
from pipeline.diloco.plan import DilocoPlan, diloco_plan, plan_of, worker_name
from pipeline.diloco.rounds import (
    POLL_S,
    abort,
    aggregate_round,
    delta_dir,
    global_dir,
    part_beat_dir,
    records,
    recover,
    retire,
    rounds_done,
    save_record,
)
from pipeline.eval import score_heldout
from pipeline.layout import start_run


def worker_slots(cfg: RunConfig, workers: int) -> list[list[int] | None]:
    """The devices of each worker: all R train at once (they meet every round). On CPU they share
    the cores; on GPUs each takes ``train.processes`` of them (preflight checked that they fit);
    on a deployment, machines of their own."""
    if cfg.flow.branch_deployment or torch.cuda.device_count() == 0:
        return [None] * workers
    per = cfg.train.processes
    return [list(range(k * per, (k + 1) * per)) for k in range(workers)]


class Workers:
    """The R workers of a variant as Prefect futures; one that fails for good is started again for
    the next round (it resumes from its last checkpoint and joins the newest global weights)."""

    def __init__(self, cfg: RunConfig, run_dir: str, plan: DilocoPlan):
        self.cfg, self.run_dir, self.plan = cfg, run_dir, plan
        self.slots = worker_slots(cfg, plan.size)
        retries = {"retries": cfg.flow.branch_retries, "retry_delay_seconds": cfg.flow.retry_delay_s}
        self.local = tasks.train.with_options(**retries, retry_condition_fn=tasks.worth_retrying)
        self.remote = tasks.train_remote.with_options(**retries)
        self.ended: queue.Queue[int] = queue.Queue()
        self.futures: dict[int, PrefectFuture] = {}
        self.failures: dict[int, str] = {}
        self.running: set[int] = set()
        for k in range(plan.size):
            self.start(k)

    def start(self, k: int) -> None:
        name = worker_name(self.plan.variant, k)
        if self.cfg.flow.branch_deployment:
            future = self.remote.submit(self.cfg.flow.branch_deployment, self.run_dir, name)
        else:
            future = self.local.submit(self.run_dir, name, gpus=self.slots[k], sharing=len(self.slots))
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
        quorum, timeout_s, first = self.plan.quorum or self.plan.size, self.plan.round_timeout_s, None
        while True:
            self.collect()
            sent = [k for k in range(self.plan.size) if (delta_dir(self.plan, r, k) / MANIFEST).is_file()]
            if len(sent) + len(set(self.failures) - set(sent)) >= self.plan.size or len(sent) >= quorum:
                return sent
            if sent and first is None:
                first = time.monotonic()
            if timeout_s is not None and first is not None and time.monotonic() - first >= timeout_s:
                return sent
            time.sleep(POLL_S)

    def finish(self) -> None:
        for future in self.futures.values():
            future.wait()


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
        name, folder = f"{self.plan.variant}-round{r + 1}", str(global_dir(self.plan, r + 1))
        result = score_heldout(self.cfg, self.run_dir, name, folder)
        with self.lock:
            record = next(x for x in records(self.plan) if x["round"] == r)
            save_record(
                self.plan, record | {"heldout_loss": result["loss"], "token_accuracy": result["token_accuracy"]}
            )


def run_rounds(cfg: RunConfig, run_dir: str, method: DilocoMethod) -> None:
    """Train one DiLoCo variant to its last round (or resume it)."""
    plan = diloco_plan(cfg, run_dir, method)
    plan.fix()
    done, log = rounds_done(plan), get_run_logger()
    if done >= plan.final:
        return
    log.info(
        f"DiLoCo {plan.variant}: {plan.size} workers, {plan.rounds} rounds of {plan.inner_steps} steps, {plan.sync}"
    )
    key = artifact_key(cfg.run.name, plan.variant, "rounds")
    progress = create_progress_artifact(100.0 * done / plan.final, key=key, description=plan.variant)
    evaluator = Evaluator(cfg, run_dir, plan)
    if done:  # a flow killed between writing global `done` and recording it: finish that round's bookkeeping
        recover(plan, done - 1)
        if plan.sync == "async":
            retire_arrivals(plan, done - 1, arrivals(plan))
        else:
            retire(plan, done - 1)
    if cfg.diloco.replay and not arrivals(plan):
        save_arrivals(plan, replayed(cfg.diloco.replay, plan))
    abort(plan, None)
    workers = Workers(cfg, run_dir, plan)
    step = arrive if plan.sync == "async" else aggregate
    try:
        with _cpu_shared_with_workers(cfg):
            began = time.perf_counter()
            for r in range(done, plan.final):
                if (began := step(cfg, plan, workers, evaluator, r, began)) is None:
                    evaluator.submit(r - 1, last=True)  # every worker ended before its last payload
                    break
                update_progress_artifact(progress, 100.0 * (r + 1) / plan.final)
    except BaseException as err:
        # The workers wait for the next global weights: tell them none will come, or they would
        # hold their machines until train.timeout_s.
        abort(plan, f"{type(err).__name__}: {err}")
        raise
    workers.finish()
    evaluator.finish()


def aggregate(cfg: RunConfig, plan: DilocoPlan, workers: Workers, evaluator: Evaluator, r: int, began: float) -> float:
    """Round r once its payloads are in: aggregate, outer step, record; returns when it ended."""
    sent = workers.wait_round(r)
    dropped = {k: workers.failures[k] for k in workers.failures if k not in sent}
    if len(sent) < cfg.diloco.min_workers:
        raise RuntimeError(
            f"DiLoCo {plan.variant} round {r}: {len(sent)} of {plan.size} workers sent their pseudo-gradients, "
            f"fewer than diloco.min_workers = {cfg.diloco.min_workers}; failed: {dropped}"
        )
    notes = {
        "failures": {str(k): why for k, why in dropped.items()},
        # Still training round r: their payload will find the round closed and be dropped, and they
        # join the newest global with their own inner state (OpenDiLoCo's rule: applying a Δ taken
        # from an older global would need that global kept and a staleness rule).
        "stragglers": [k for k in range(plan.size) if k not in sent and k not in dropped],
    }
    if plan.aggregators > 1:
        aggregate_parts(cfg, plan, r, sent)
    record = aggregate_round(plan, r, sent, cfg.merge.device, cfg.merge.block_mb, notes, began)  # parts: assembled
    ended = time.perf_counter()
    evaluator.save(record)
    if dropped:
        get_run_logger().warning(f"DiLoCo {plan.variant} round {r}: left out workers {sorted(dropped)}: {dropped}")
    if record["stragglers"]:
        get_run_logger().info(f"DiLoCo {plan.variant} round {r}: stragglers {record['stragglers']} left out")
    evaluator.wait_before(r)  # global r - 1 is about to go
    retire(plan, r)
    evaluator.submit(r)
    for k in dropped:  # back for the next round, from their last checkpoint
        workers.start(k)
    get_run_logger().info(f"DiLoCo {plan.variant}: round {r + 1}/{plan.rounds} done")
    return ended


def aggregate_parts(cfg: RunConfig, plan: DilocoPlan, r: int, sent: list[int]) -> None:
    """Round r's S parts at once: each a flow run of ``diloco.aggregator_deployment`` (a machine
    of its pool each: every machine reads 1/S of the payloads), or a task of this flow (a thread
    each, so S cores of this machine). A part whose machine is lost is run again by its retries."""
    run_dir, deployment = plan.workers[0].run_dir, cfg.diloco.aggregator_deployment
    retries = {"retries": cfg.flow.branch_retries, "retry_delay_seconds": cfg.flow.retry_delay_s}
    futures = [
        tasks.aggregate_part_remote.with_options(**retries).submit(deployment, run_dir, plan.variant, r, sent, s)
        if deployment
        else tasks.aggregate_part.submit(run_dir, plan.variant, r, sent, s)
        for s in range(plan.aggregators)
    ]
    for future in futures:
        future.result()


@flow(name="diloco-part", log_prints=True)
def part(run_dir: str, variant: str, r: int, workers: list[int], s: int) -> dict:
    """Part s of round r of a DiLoCo variant on whatever machine runs this flow: the unit a diloco
    run fans its aggregation out to when ``diloco.aggregator_deployment`` names this deployment."""
    cfg = tasks.run_config(run_dir)
    folder = part_beat_dir(plan_of(cfg, run_dir, variant), r, s)
    with heartbeat(folder, str(prefect.runtime.flow_run.id), cfg.flow.heartbeat_s):
        return tasks.aggregate_part(run_dir, variant, r, workers, s)


def arrive(
    cfg: RunConfig, plan: DilocoPlan, workers: Workers, evaluator: Evaluator, v: int, began: float
) -> float | None:
    """Async: arrival v once a payload is in (the recorded one when replaying): apply it, record
    it; returns when it ended, or None when every worker has ended and no payload is left."""
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
    record = apply_arrival(plan, v, schedule, cfg.merge.device, notes, began)
    ended = time.perf_counter()
    evaluator.save(record)
    evaluator.wait_before(v)  # globals older than v may go
    retire_arrivals(plan, v, schedule)
    evaluator.submit(v)
    if closes_window(plan, v):
        for k in failed if workers.running else []:  # back from their last checkpoint, as in sync mode
            workers.start(k)
        log = get_run_logger()
        log.info(
            f"DiLoCo {plan.variant}: {v + 1}/{plan.final} arrivals (worker {arrival.worker}, {arrival.steps} steps)"
        )
    return ended


def replayed(path: str, plan: DilocoPlan) -> list[Arrival]:
    """An earlier run's arrivals, to replay (``diloco.replay``): they must name this run's workers."""
    source = Path(path)
    try:
        items = [Arrival.model_validate(a) for a in json.loads(source.read_text())]
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


@flow(name="diloco", log_prints=True)
def diloco(
    config: str | None = "configs/demo.yaml", overrides: list[str] | None = None, run_dir: str | None = None
) -> str:
    """DiLoCo / IsoLoCo on one run directory (every method of ``diloco.methods``, from the same θ0
    and budget); returns the path of the report."""
    cfg, run_dir = start_run(config, overrides or [], run_dir)
    run_dir = str(run_dir.absolute())
    start(run_dir, cfg, diloco=True)
    if cfg.diloco.shards == "merit":
        tasks.calibrate(run_dir)
    for method in cfg.diloco.methods:
        run_rounds(cfg, run_dir, method)
    return evaluate_and_report(cfg, run_dir)
