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

import deepspeed
import torch.distributed as dist

from pipeline.checkpoint import checkpoint_id, save_pretrained_checkpoint, write_json_atomic
from pipeline.layout import WARMUP
from pipeline.models.saving import save_like
from pipeline.train.engine import Engine
from pipeline.train.lora import lora_summary, merged_state
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
        self.lora = spec.train.finetuning_type == "lora"

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
        # A LoRA branch's checkpoints hold what trains (the adapters), not θ0's frozen weights.
        strict = not self.lora
        path, client = (
            self.engine.load_checkpoint(str(self.folder), tag=tag, load_module_strict=strict)
            if exists
            else (None, None)
        )
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
            str(self.folder),
            tag=tag,
            client_state={**asdict(state), "spec_digest": self.digest},
            exclude_frozen_parameters=self.lora,
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

    def save_final(self, trained: Engine, state: TrainState) -> None:
        """The branch's ``final/``, written by rank 0: a full checkpoint in the engine's dtype (bf16 where
        the branch trains in bf16) in θ0's stored layout, the tensors transformers does not load copied
        from θ0 (``pipeline.models.saving``), or a LoRA branch's PEFT adapter folder (a LoRA warm-up's
        adapter merged into θ0's weights: θ0 is a model). Under ZeRO-3 the partitions are gathered one
        module at a time onto rank 0's CPU memory, so no GPU ever holds the whole model."""
        meta = {
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "examples_seen": state.examples_seen,
            "train_seconds": round(state.elapsed_s, 3),
            "spec_digest": self.digest,
            "parent": self.spec.init,
            "branch": self.spec.name,
            "sources": self.spec.sources,
            "finetuning_type": self.spec.train.finetuning_type,
        }
        adapter = trained.peft is not None and self.spec.name != WARMUP
        if adapter:
            weights = self._gathered({n: p for n, p in trained.engine.module.named_parameters() if p.requires_grad})
            meta |= {"base_model": checkpoint_id(self.spec.init), "lora": lora_summary(trained.peft)}
            weights = weights and {_peft_name(n): t for n, t in weights.items()}
        else:
            weights = self._gathered(None)
            if weights is not None and trained.peft is not None:
                weights = merged_state(weights, trained.model)
        if self.rank == 0:
            final = Path(self.spec.out_dir) / "final"
            if adapter:
                save_pretrained_checkpoint(final, trained.peft, trained.processor, weights, **meta)
            else:
                save_like(final, trained.model, self.spec.init, trained.processor, weights, **meta)
        dist.barrier()

    def _gathered(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """Whole tensors of ``params`` (default: the whole model) without SupervisedLoss's prefix,
        on rank 0; None where the model as it lives already holds them (ZeRO-0/2, no LoRA merge)."""
        zero3 = self.engine.zero_optimization_stage() == 3
        if params is None:
            if zero3:  # every rank takes part in the gathering
                gathered = self.engine._zero3_consolidated_16bit_state_dict()
                return gathered and {k.removeprefix("model."): v for k, v in gathered.items()}
            if self.spec.train.finetuning_type == "full":
                return None
            return {k.removeprefix("model."): v for k, v in self.engine.module.state_dict().items()}
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=zero3):
            if self.rank != 0:
                return None
            return {k.removeprefix("model."): p.detach().cpu().clone() for k, p in params.items()}


def _peft_name(name: str) -> str:
    """An HF model's parameter name as its PeftModel's (``state_dict=`` of PEFT's save_pretrained)."""
    return f"base_model.model.{name}"
