"""What one branch trains: θ0, its sources, and the run's ``train`` section."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pipeline.checkpoint import checkpoint_id, is_complete
from pipeline.config import RunConfig, TrainSection


class BranchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    run_dir: str  # holds config.yaml and the prepared data
    init: str  # θ0: a checkpoint folder (or a hub id for real models)
    sources: list[str]
    out_dir: str
    config: RunConfig  # resolved; the branch reads its model, data and train sections

    @property
    def train(self) -> TrainSection:
        return self.config.train

    def digest(self) -> str:
        """What the branch's weights depend on: θ0's identity, the sources and every setting that
        changes a number (not the timeout or the checkpoint interval, so those can change on resume)."""
        cfg = self.config
        train = cfg.train.model_dump(mode="json", exclude={"timeout_s", "checkpoint_every"})
        inputs = {
            "init": checkpoint_id(self.init),
            "sources": self.sources,
            "train": train,
            "config": cfg.digest("run", "model", "data"),
        }
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]

    def validate_inputs(self) -> None:
        """Everything that can be checked before launching processes: fail in seconds, not later."""
        from pipeline.data.prepare import active_sources, read_manifest

        known = active_sources(read_manifest(self.run_dir))
        unknown = sorted(set(self.sources) - set(known))
        if unknown or not self.sources:
            raise ValueError(
                f"branch {self.name}: unknown sources {unknown or '(none given)'}; prepared: {sorted(known)}"
            )
        local = Path(self.init)
        if (local.exists() or self.config.model.name_or_path == "tiny") and not is_complete(local):
            raise ValueError(f"branch {self.name}: init checkpoint {self.init} is missing or incomplete")
        if not Path(self.train.deepspeed).is_file():
            raise ValueError(f"branch {self.name}: DeepSpeed config {self.train.deepspeed} not found")

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> BranchSpec:
        return cls.model_validate(json.loads(Path(path).read_text()))
