"""Resumable training state of a branch: DeepSpeed checkpoints, the pointer to the last whole one,
and the final Hugging Face checkpoint.

Every ``checkpoint_every`` steps all ranks save the engine state (weights, optimizer, scheduler)
with the :class:`TrainState` under ``checkpoints/step<N>``; only then does rank 0 point
``checkpoints/latest.json`` at it (atomic rename), so the checkpoint it names is always whole: a
run killed at any moment restarts from there, and the data order being a function of (seed,
step), the resumed run trains on the same batches.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipeline.checkpoint import save_pretrained_checkpoint, write_json_atomic
from pipeline.train.spec import BranchSpec

LATEST = "latest.json"


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    examples_seen: int = 0
    elapsed_s: float = 0.0  # training seconds, summed over resumed runs
    rounds: int = 0  # DiLoCo: the rounds this worker has trained (a branch: 0)


class Checkpointer:
    def __init__(self, spec: BranchSpec, engine: Any, rank: int):
        self.spec, self.engine, self.rank = spec, engine, rank
        self.folder, self.digest = Path(spec.out_dir) / "checkpoints", spec.digest()

    def latest(self) -> Path | None:
        """The folder of the last whole checkpoint, if any."""
        if not (self.folder / LATEST).is_file():
            return None
        return self.folder / json.loads((self.folder / LATEST).read_text())["tag"]

    def resume(self) -> TrainState:
        """The state of the last whole checkpoint (loaded into the engine), or a fresh one."""
        if (latest := self.latest()) is None:
            return TrainState()
        tag = latest.name
        # DeepSpeed asserts (no message) on a missing tag folder and returns None on an unreadable one.
        exists = (self.folder / tag).is_dir()
        path, client = self.engine.load_checkpoint(str(self.folder), tag=tag) if exists else (None, None)
        if path is None:
            raise RuntimeError(
                f"branch {self.spec.name}: {self.folder / LATEST} names {tag}, which cannot be loaded; "
                "delete it to train the branch from its start"
            )
        if self.rank == 0:
            print(f"branch {self.spec.name}: resumed from {tag} (step {client['step']})", flush=True)
        return TrainState(**{k: client[k] for k in asdict(TrainState()) if k in client})

    def due(self, state: TrainState) -> bool:
        return state.step % self.spec.train.checkpoint_every == 0 and state.step < self.spec.train.steps

    def save(self, state: TrainState, extra: Callable[[Path], None] | None = None) -> None:
        """Save the engine state under ``step<N>``; ``extra`` (rank 0) writes more state into that
        folder before the pointer names it."""
        tag = f"step{state.step}"
        self.engine.save_checkpoint(
            str(self.folder), tag=tag, client_state={**asdict(state), "spec_digest": self.digest}
        )
        if extra is not None and self.rank == 0:
            extra(self.folder / tag)
        dist.barrier()  # every rank's shard is on disk before the pointer moves
        if self.rank == 0:
            latest = self.folder / LATEST
            previous = json.loads(latest.read_text())["tag"] if latest.is_file() else None
            write_json_atomic(latest, {"tag": tag, "step": state.step, "spec_digest": self.digest})
            if previous and previous != tag:
                shutil.rmtree(self.folder / previous, ignore_errors=True)
        dist.barrier()

    def save_final(self, model: Any, processor: Any, state: TrainState) -> None:
        """A full Hugging Face checkpoint written by rank 0, in the engine's dtype (bf16 where the
        branch trains in bf16). Under ZeRO-3 the partitions are gathered one module at a time
        onto rank 0's CPU memory, so no GPU ever holds the whole model."""
        meta = {
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "examples_seen": state.examples_seen,
            "train_seconds": round(state.elapsed_s, 3),
            "spec_digest": self.digest,
            "parent": self.spec.init,
            "branch": self.spec.name,
            "sources": self.spec.sources,
        }
        weights = None
        if self.engine.zero_optimization_stage() == 3:  # every rank takes part in the gathering
            gathered = self.engine._zero3_consolidated_16bit_state_dict()
            weights = gathered and {k.removeprefix("model."): v for k, v in gathered.items()}  # SupervisedLoss.model
        if self.rank == 0:
            save_pretrained_checkpoint(Path(self.spec.out_dir) / "final", model, processor, weights, **meta)
        dist.barrier()
