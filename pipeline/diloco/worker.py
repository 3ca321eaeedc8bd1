"""One DiLoCo worker: ``python -m pipeline.diloco.worker JOB.json`` (one rank, or under torchrun).

The worker lives for the whole run, so a round costs no process start, no engine build and no
reload of θ0 (at toy scale those take longer than 50 inner steps). Each round:

1. wait for ``global/<r>`` (the newest: a worker left out of rounds joins the latest one; not
   one of a round decided without it, ``members.json``);
2. set its weights (and fp32 master copy) to it, keeping its own AdamW moments, data position
   and lr schedule, as in DiLoCo;
3. train H steps;
4. compute Δ = θ_global − θ_worker from the fp32 masters, compress it (with error feedback if
   asked), save its inner state with the payload in one checkpoint, then publish the payload as
   ``deltas/<r>/<k>``.

A worker killed at any point restarts from its last checkpoint: a payload saved but not
published is published (unless its round went on without it); a round not saved is trained
again from the same global, with the same batches, to the same result.

A LoRA worker (``train.finetuning_type: lora``) sets the base weights in step 2 and trains a fresh
adapter each round, whose factors are its payload (:mod:`pipeline.diloco.lora`).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load_file, save_file

from pipeline.checkpoint import is_complete, staged_dir, write_json_atomic, write_manifest
from pipeline.diloco.asynchronous import start_payload
from pipeline.diloco.compress import compress_with_feedback, payload_infos
from pipeline.diloco.lora import LoraWeights, round_seed, save_adapter
from pipeline.diloco.plan import DilocoPlan
from pipeline.diloco.rounds import (
    MAX_SHARD,
    POLL_S,
    Clock,
    aborted,
    closed_to,
    delta_dir,
    global_dir,
    global_reader,
    rounds_done,
    send,
)
from pipeline.diloco.weights import check_masters, masters, set_weights, trained_parameters
from pipeline.merge.io import ShardedWriter, TensorInfo
from pipeline.merge.layout import ModelView
from pipeline.train.curves import plot_loss
from pipeline.train.lifetime import die_with_parent
from pipeline.train.spec import BranchSpec
from pipeline.train.worker import Branch

PAYLOAD, RESIDUAL = "delta", "residual.safetensors"


class WorkerJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    plan: DilocoPlan
    index: int

    @property
    def spec(self) -> BranchSpec:
        return self.plan.workers[self.index]

    def save(self, path: Path) -> Path:
        write_json_atomic(path, self.model_dump(mode="json"))
        return path


def wait_for_global(plan: DilocoPlan, r: int, timeout_s: float) -> int:
    """The newest round ≥ r whose global weights exist, once one does; an error if the aggregator
    gave up (its abort note) or nothing came for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (done := rounds_done(plan)) < r:
        if (note := aborted(plan)) is not None:
            raise RuntimeError(f"DiLoCo {plan.variant}: the aggregator stopped the run: {note}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"DiLoCo {plan.variant}: no global weights of round {r} after {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return done


def next_open_round(plan: DilocoPlan, k: int, n: int, timeout_s: float) -> int:
    """The newest round ≥ n whose global exists and whose members were not decided without worker
    k (a worker restarted after a kill joins the round the killed run would have restarted it for,
    not one it was left out of)."""
    r = wait_for_global(plan, n, timeout_s)
    while r < plan.rounds and closed_to(plan, r, k):
        r = wait_for_global(plan, r + 1, timeout_s)
    return r


def agreed(value_of, rank: int):
    """``value_of()`` as rank 0 finds it, on every rank of the worker (they must act alike)."""
    value = [value_of() if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(value, src=0)
    return value[0]


def begin_round(job: WorkerJob, n: int, speed: float | None, rank: int) -> tuple[int, int, int]:
    """(round, base global, inner steps) of this worker's next payload, the same on every rank.
    Synchronous: the next round whose global exists and that was not decided without this worker
    (the newest: a worker left out of rounds joins the latest), trained from that global for H
    steps. Async: its n-th payload, from the global and for the steps ``start_payload`` gives,
    once that global exists."""
    plan, timeout_s = job.plan, job.spec.train.timeout_s
    if plan.sync != "async":
        r = agreed(lambda: next_open_round(plan, job.index, n, timeout_s), rank)
        return r, r, plan.inner_steps
    base, steps = agreed(lambda: start_payload(plan, job.index, n, speed), rank)
    agreed(lambda: wait_for_global(plan, base, timeout_s), rank)  # a replayed base may be still to come
    return n, base, steps


def payload_plan(params: dict[str, torch.nn.Parameter], compression: str) -> dict[str, TensorInfo]:
    return {k: i for name, p in params.items() for k, i in payload_infos(name, tuple(p.shape), compression).items()}


def write_payload(
    job: WorkerJob,
    r: int,
    base: int,
    params: dict[str, torch.nn.Parameter],
    residual: dict | None,
    folder: Path,
    rank: int,
    **meta,
) -> dict | None:
    """Δ of round r (async: the worker's r-th payload) against global ``base`` from the fp32
    masters, compressed, into ``folder/delta`` (rank 0; the other ranks take part in gathering
    the masters); returns the new error-feedback residual."""
    if rank != 0:
        for _ in masters(params):
            pass
        return None
    plan = job.plan
    theta, kept = global_reader(plan, base), ({} if residual is not None else None)
    with staged_dir(folder) as tmp:
        out = tmp / PAYLOAD
        out.mkdir()
        with ShardedWriter(out, payload_plan(params, plan.compression), MAX_SHARD) as writer:
            for name, weights in masters(params):
                delta = theta.get_loaded(name).float().sub_(weights)
                previous = None if kept is None else residual.get(name, torch.zeros_like(delta))
                payload, kept_residual = compress_with_feedback(name, delta, plan.compression, previous)
                if kept is not None:
                    kept[name] = kept_residual
                for key, tensor in payload.items():
                    writer.write(key, tensor)
            writer.close()
        write_manifest(out, writer.sha256, kind="diloco_delta", round=r, worker=job.index, base=base, **meta)
        if kept is not None:
            save_file(kept, tmp / RESIDUAL)
    return kept


def write_adapter_payload(
    job: WorkerJob, r: int, base: int, lora: LoraWeights, peft, folder: Path, rank: int, **meta
) -> None:
    """A LoRA worker's payload of round r (async: its r-th) trained from global ``base``: its
    adapter from the fp32 masters (bf16 with ``diloco.compression: bf16``), a PEFT adapter folder in
    ``folder/delta`` (rank 0; the other ranks take part in gathering the masters)."""
    if rank != 0:
        for _ in lora.masters():
            pass
        return
    plan = job.plan
    dtype = torch.bfloat16 if plan.compression == "bf16" else torch.float32
    state = {name: value.to(dtype) for name, value in lora.masters()}
    with staged_dir(folder) as tmp:
        out = tmp / PAYLOAD
        out.mkdir()
        save_adapter(peft, state, out, str(global_dir(plan, base)))
        write_manifest(out, kind="diloco_delta", round=r, worker=job.index, base=base, lora=True, **meta)


def keep_residual(residual: dict | None, folder: Path, rank: int) -> None:
    """A round's checkpoint extra without a payload: the error-feedback residual only."""
    if rank == 0:
        with staged_dir(folder) as tmp:
            if residual is not None:
                save_file(residual, tmp / RESIDUAL)


def publish(job: WorkerJob, saved: Path | None, r: int, save_s: float = 0.0) -> None:
    """Publish the payload saved in checkpoint ``saved`` as round r's, unless it already is or the
    round is over (the aggregator went on without this worker; in async no round closes)."""
    source = saved / "diloco" / PAYLOAD if saved is not None else None
    if source is None or not source.is_dir() or (job.plan.sync != "async" and closed_to(job.plan, r, job.index)):
        return
    if not is_complete(delta_dir(job.plan, r, job.index)):
        send(source, job.plan, r, job.index, save_s=save_s)


def main(job_path: str) -> None:
    die_with_parent()
    job = WorkerJob.model_validate_json(Path(job_path).read_text())
    plan = job.plan
    branch = Branch.start(job.spec)
    launch_s = time.time() - psutil.Process().create_time()  # process start, imports, engine, resume
    peft, rank = branch.engine.peft, branch.rank.rank
    lora = LoraWeights.of(branch.engine.model, ModelView.open(plan.init)) if peft is not None else None
    params = trained_parameters(branch.engine.model) if lora is None else lora.trained
    slow = plan.slow_workers.get(job.index, 1.0)
    check_masters(params)
    saved = branch.checkpointer.latest()
    residual = _residual(saved) if plan.error_feedback else None
    if rank == 0:
        for leftover in branch.checkpointer.folder.glob(".round*"):  # a payload a kill kept from its checkpoint
            shutil.rmtree(leftover, ignore_errors=True)
        publish(job, saved, branch.state.rounds - 1)  # saved before a kill, maybe not yet published
    speed = None  # async: this worker's inner steps per second in its latest payload
    try:
        while branch.state.rounds < plan.rounds:
            clock = Clock()
            r, base, steps = begin_round(job, branch.state.rounds, speed, rank)
            if r >= plan.rounds:  # a straggler left out of the last round: the run is over
                break
            waited = clock.lap()
            if lora is not None:  # the global's base weights (round 0: θ0's, as loaded), a fresh adapter
                if base > 0 or branch.state.rounds > 0:
                    lora.set_base(global_dir(plan, base))
                seed = round_seed(branch.spec.config.run.seed, job.index, r)
                lora.fresh_adapters(seed, branch.engine.engine.optimizer)
            elif base > 0 or branch.state.rounds > 0:
                set_weights(params, str(global_dir(plan, base)))
            loaded, before = clock.lap(), branch.state
            for _ in range(steps):
                step = Clock()
                branch.step()
                time.sleep((slow - 1) * step.lap())  # a share of 1/slow of this machine's time
            seconds = {"wait": waited, "load": loaded, "inner": clock.lap(), "launch": launch_s}
            speed = steps / seconds["inner"]
            meta = {
                "tokens": branch.state.tokens_seen - before.tokens_seen,
                "examples": branch.state.examples_seen - before.examples_seen,
                "steps": [before.step, branch.state.step],
                "seconds": {k: round(v, 4) for k, v in seconds.items()},
            }
            pending = branch.checkpointer.folder / f".round{r}"
            if plan.sync != "async" and agreed(lambda r=r: closed_to(plan, r, job.index), rank):
                # A straggler: the round went on without it (quorum mode) and its global may be
                # gone; its Δ is dropped, its residual kept, and it joins the next open global.
                keep_residual(residual, pending, rank)
            elif lora is not None:
                write_adapter_payload(job, r, base, lora, peft, pending, rank, **meta)
            else:
                residual = write_payload(job, r, base, params, residual, pending, rank, **meta)
            branch.state = replace(branch.state, rounds=r + 1)
            branch.checkpointer.save(branch.state, extra=lambda tag, pending=pending: _keep(pending, tag / "diloco"))
            branch.metrics.flush()
            if rank == 0:
                publish(job, branch.checkpointer.latest(), r, save_s=round(clock.lap(), 4))
            launch_s = 0.0
    finally:
        branch.metrics.close()  # the event files, up to the failure
    if rank == 0:
        out = Path(branch.spec.out_dir)
        plot_loss(out / "metrics.jsonl", out / "loss.png", title=f"DiLoCo worker {branch.spec.name}")


def _keep(pending: Path, dst: Path) -> None:
    """Move the round's payload into its checkpoint. A worker killed after this but before the
    checkpoint became the latest one trains the round again into the same tag: replace it."""
    shutil.rmtree(dst, ignore_errors=True)
    pending.rename(dst)


def _residual(saved: Path | None) -> dict[str, torch.Tensor]:
    path = saved / "diloco" / RESIDUAL if saved is not None else None
    return load_file(path) if path is not None and path.is_file() else {}


if __name__ == "__main__":
    main(sys.argv[1])
