"""What one branch trains: θ0, its sources, and the run's ``train`` section."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from pipeline.checkpoint import MANIFEST, CheckpointError, checkpoint_id, verify_checkpoint, write_text_atomic
from pipeline.config import RunConfig, TrainSection
from pipeline.data.manifest import active_sources, read_manifest, train_lengths
from pipeline.hub import ModelNotFoundError, check_model_folder
from pipeline.train.packing import PackOrder

# Settings that change no number the branch computes: they may differ on a resumed run. ``epochs``
# is in the digest as the steps it was turned into (a warm-up of fixed steps is the same whatever
# the branches' epochs).
NOT_IN_DIGEST = {"timeout_s", "checkpoint_every", "loader_workers", "gradient_checkpointing", "epochs", "profile_steps"}


class BranchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    run_dir: str  # holds config.yaml and the prepared data
    init: str  # θ0: a checkpoint folder (ours, with a manifest, or a model as downloaded)
    sources: list[str]
    # (i, n): only every n-th of the sources' examples from the i-th (a DiLoCo worker's iid shard)
    shard: tuple[int, int] | None = None
    out_dir: str
    config: RunConfig  # resolved; the branch reads its model, data and train sections

    @model_validator(mode="after")
    def _fix_the_budget(self) -> BranchSpec:
        """Turn ``train.epochs`` into optimizer steps once, from the prepared data: the step count
        is then part of the spec (and its digest), so every rank and every resumed run agree."""
        if self.train.steps is None:
            steps = self.train.steps_for(self.micro_batches() if self.train.packing else self.examples())
            train = self.train.model_copy(update={"steps": steps})
            self.config = self.config.model_copy(update={"train": train})
        return self

    @property
    def train(self) -> TrainSection:
        return self.config.train

    def examples(self) -> int:
        """The branch's training examples, as prepared."""
        known = active_sources(read_manifest(self.run_dir), role=None)  # any role: the warm-up may train on its own
        total = sum(known[s]["train_examples"] for s in self.sources if s in known)
        return len(range(self.shard[0], total, self.shard[1])) if self.shard else total

    def lengths(self) -> np.ndarray:
        """The token counts of the branch's training examples, in the order it trains on them."""
        by_source = train_lengths(self.run_dir, self.sources)
        lengths = np.concatenate([by_source[s] for s in self.sources])
        return lengths[self.shard[0] :: self.shard[1]] if self.shard else lengths

    def micro_batches(self) -> int:
        """Packed micro batches in an epoch of the branch's data."""
        t = self.train
        return PackOrder(self.lengths(), t.max_tokens, t.packing_window, self.config.run.seed).per_epoch()

    def digest(self) -> str:
        """What the branch's weights depend on: θ0's identity, the sources and every setting that
        changes a number (not the timeout, the checkpoint interval or how the work is done)."""
        cfg = self.config
        train = cfg.train.model_dump(mode="json", exclude=NOT_IN_DIGEST | self._unused_settings())
        inputs = {
            "init": checkpoint_id(self.init),
            "sources": self.sources,
            **({"shard": list(self.shard)} if self.shard else {}),
            "train": train,
            "config": cfg.digest("run", "model", "data"),
        }
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]

    def _unused_settings(self) -> set[str]:
        """A full fine-tune's LoRA settings and AdamW's Muon settings change nothing (and digests
        stay as they were before LoRA and Muon existed)."""
        unused = set()
        if self.train.finetuning_type != "lora":
            unused |= {
                "finetuning_type",
                "additional_target",
                *(k for k in TrainSection.model_fields if k.startswith("lora_")),
            }
        if self.train.optimizer != "muon":
            unused |= {"optimizer", *(k for k in TrainSection.model_fields if k.startswith("muon_"))}
        return unused

    def validate_inputs(self) -> None:
        """Everything that can be checked before launching processes: fail in seconds, not later."""
        known = active_sources(read_manifest(self.run_dir), role=None)
        unknown = sorted(set(self.sources) - set(known))
        if self.shard and not 0 <= self.shard[0] < self.shard[1]:
            raise ValueError(f"branch {self.name}: shard {self.shard[0]} of {self.shard[1]} does not exist")
        if unknown or not self.sources:
            given = unknown or "(none given)"
            raise ValueError(f"branch {self.name}: unknown sources {given}; prepared: {sorted(known)}")
        init = Path(self.init)
        try:
            # Ours carry a manifest and are verified (once, then recorded, so the ranks need not
            # hash it again); a model as downloaded needs a config and safetensors weights.
            verify_checkpoint(init) if (init / MANIFEST).is_file() else check_model_folder(init)
        except (CheckpointError, ModelNotFoundError) as err:
            why = f"init checkpoint {self.init} is missing or incomplete: {err}"
            raise ValueError(f"branch {self.name}: {why}") from None
        if not self.train.deepspeed_file.is_file():
            raise ValueError(f"branch {self.name}: DeepSpeed config {self.train.deepspeed_file} not found")
        if self.train.packing:
            self._check_budget()

    def _check_budget(self) -> None:
        """Every training example fits a packed micro batch (``merit prepare`` refuses one that does
        not, naming it; a later, smaller ``train.max_tokens`` is caught here, before launching)."""
        budget = self.train.max_tokens
        for source, lengths in train_lengths(self.run_dir, self.sources).items():
            if len(over := np.flatnonzero(lengths > budget)):
                raise ValueError(
                    f"branch {self.name}: source '{source}' has {len(over)} training example(s) over "
                    f"train.max_tokens = {budget} (the first, training example {int(over[0])}: "
                    f"{int(lengths[over[0]])} tokens); raise train.max_tokens or lower data.max_length"
                )

    def save(self, path: Path) -> Path:
        write_text_atomic(path, self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> BranchSpec:
        return cls.model_validate(json.loads(Path(path).read_text()))
