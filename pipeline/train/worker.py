"""One rank of a branch: ``python -m torch.distributed.run ... -m pipeline.train.worker SPEC.json``.

The loop only: the process group and engine (``engine``), the data (``sampling``, ``loader``),
resumable state (``checkpointing``) and the log (``metrics``) are components of their own.
One step: the rank's micro batches, already encoded by the loader's workers, each a forward
(the loss without full-vocabulary logits) and a backward, then the optimizer step. The loss is
the mean over every supervised token of the step across micro batches and ranks, so a step's
gradient does not depend on how its examples are spread over ranks and micro batches.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.models.loss import pieces_for
from pipeline.train.checkpointing import Checkpointer, TrainState
from pipeline.train.curves import plot_loss
from pipeline.train.engine import Engine, Rank, build_engine, init_distributed
from pipeline.train.lifetime import die_with_parent
from pipeline.train.loader import StepBatch, StepBatches, step_batches
from pipeline.train.metrics import MetricsLog
from pipeline.train.profile import StepProfiler
from pipeline.train.sampling import BranchData
from pipeline.train.spec import BranchSpec

# torch's collectives warn on every call that DeepSpeed uses their old names: noise in train.log.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def train_step(engine: Engine, batch: StepBatch, device: torch.device, chunk: int) -> tuple[float, int, int, int]:
    """One optimizer step; returns the step's loss and the tokens, examples and positions it ran
    (all ranks). The host waits for the device once, after the step's last kernel is queued."""
    world, accum = dist.get_world_size(), len(batch.micro)
    counts = [sum(batch.supervised), batch.tokens, batch.examples, batch.positions, 0.0]
    counts = torch.tensor(counts, dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    pieces = [pieces_for(n, chunk) for n in batch.supervised]
    if engine.zero3 is not None and world > 1:
        # Every rank projects each micro batch's answers in as many parts as the rank that has the
        # most: under ZeRO-3 each projection gathers the head's weights collectively (loss.py).
        most = torch.tensor(pieces, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        pieces = most.tolist()
    # DeepSpeed averages gradients over micro batches and ranks: undo that, and divide by the
    # step's supervised tokens instead (the same gradient as one batch of the step's examples).
    scale = (world * accum / counts[0].clamp(min=1.0)).float()
    for micro, n in zip(batch.micro, pieces):
        inputs = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in micro.items()}
        nll, _ = engine.engine(pieces=n, **inputs)
        engine.engine.backward(nll * scale)
        engine.engine.step()
        counts[4] += nll.detach().double()
    dist.all_reduce(counts[4:])
    supervised, tokens, examples, positions, nll = counts.tolist()
    return nll / max(supervised, 1.0), int(tokens), int(examples), int(positions)


@dataclass
class Branch:
    """A rank's live training: the engine, its resumable state, the batches from the state's step
    on, and the log."""

    spec: BranchSpec
    rank: Rank
    engine: Engine
    checkpointer: Checkpointer
    state: TrainState
    metrics: MetricsLog
    batches: Iterator[StepBatch]

    @classmethod
    def start(cls, spec: BranchSpec) -> Branch:
        """Join the process group, build the engine, resume the last checkpoint, start the loader."""
        rank = init_distributed()
        torch.manual_seed(spec.config.run.seed)
        engine = build_engine(spec, rank.world)
        checkpointer = Checkpointer(spec, engine.engine, rank.rank)
        state = checkpointer.resume()
        metrics = MetricsLog(Path(spec.out_dir) / "metrics.jsonl", rank.rank, state.step)
        data = BranchData.for_branch(spec, engine.processor)
        loader = StepBatches(data, spec.train, rank.rank, rank.world, pixel_dtype=engine.model.dtype)
        batches = step_batches(loader, state.step, pin_memory=rank.device.type == "cuda")
        engine.engine.train()
        return cls(spec, rank, engine, checkpointer, state, metrics, batches)

    def step(self) -> None:
        """Train one optimizer step and log it."""
        state = self.state
        start, lr = time.perf_counter(), self.engine.lr  # the lr this step trains with
        batch = next(self.batches)
        waited = time.perf_counter() - start
        loss, tokens, examples, positions = train_step(self.engine, batch, self.rank.device, self.spec.train.loss_chunk)
        seconds = time.perf_counter() - start
        self.state = state = replace(
            state,
            step=state.step + 1,
            tokens_seen=state.tokens_seen + tokens,
            examples_seen=state.examples_seen + examples,
            elapsed_s=state.elapsed_s + seconds,
        )
        norm = self.engine.engine.get_global_grad_norm()
        self.metrics.write(
            {
                "step": state.step,
                "loss": loss,
                "lr": lr,
                "tokens": state.tokens_seen,
                "examples": state.examples_seen,
                "tokens_per_s": tokens / seconds,
                "compute_tokens_per_s": tokens / (seconds - waited),  # the data wait left out
                "data_wait_s": round(waited, 4),
                "positions": positions,  # tokens, padding and filler the model ran, all ranks
                "grad_norm": None if norm is None else float(norm),
                "elapsed_s": round(state.elapsed_s, 3),
                "threads": torch.get_num_threads(),  # the rank's share of the CPUs (pipeline.threads)
            }
        )


def main(spec_path: str) -> None:
    die_with_parent()  # a killed launcher takes its ranks with it
    branch = Branch.start(BranchSpec.load(spec_path))
    spec, checkpointer = branch.spec, branch.checkpointer
    steps = spec.train.profile_steps if branch.rank.rank == 0 else 0
    profiler = StepProfiler(spec.out_dir, steps, branch.state.step)
    try:
        while branch.state.step < spec.train.steps:
            with profiler.step(branch.state.step):
                branch.step()
            if checkpointer.due(branch.state):
                checkpointer.save(branch.state)
                branch.metrics.flush()
        checkpointer.save_final(branch.engine, branch.state)
    finally:
        branch.metrics.close()  # the event files, up to the failure
    if branch.rank.rank == 0:
        out = Path(spec.out_dir)
        plot_loss(out / "metrics.jsonl", out / "loss.png", title=f"branch {spec.name}")


if __name__ == "__main__":
    main(sys.argv[1])
