"""Training progress of a run's branches, read from their ``metrics.jsonl`` (one line per
optimizer step, written by rank 0), shown as a Prefect progress artifact and log lines."""

from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from pipeline.train import BranchSpec


def steps_done(out_dir: str) -> int:
    """Steps recorded so far; a resumed run rewrites its lines, so the count never overshoots."""
    path = Path(out_dir) / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line) if path.is_file() else 0


class BranchProgress:
    """Progress of several trainings, each shown under its label (``joint``, ``0``, ``random/0``)."""

    def __init__(self, specs: dict[str, BranchSpec], key: str):
        self.specs = specs
        self.total = sum(s.train.steps for s in specs.values())
        self.shown = -1.0
        self.artifact = create_progress_artifact(0.0, key=key, description=f"training {len(specs)} branches")

    def update(self) -> None:
        done = {label: min(steps_done(s.out_dir), s.train.steps) for label, s in self.specs.items()}
        percent = 100.0 * sum(done.values()) / self.total
        if percent != self.shown:
            self.shown = percent
            update_progress_artifact(self.artifact, percent)
            detail = ", ".join(f"{label} {done[label]}/{s.train.steps}" for label, s in self.specs.items())
            get_run_logger().info(f"training {percent:5.1f} %: {detail}")
