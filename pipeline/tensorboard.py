"""TensorBoard event files, written with the standard writer, so that
``tensorboard --logdir runs/<run>`` compares a run's branches and models at a glance: every
training folder (``warmup/``, ``joint/``, ``branches/<k>/``, a control's) logs its steps under
``<folder>/tensorboard`` (one TensorBoard run per branch, named by its path), and every
evaluated model its held-out figures under ``eval/tensorboard/<model>``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TRAIN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s")  # per step, as train/<name>


def step_writer(folder: Path, resumed_at: int) -> Any:
    """The writer of a training folder's steps. A branch resumed from step S purges what a killed
    run logged after S, as ``metrics.jsonl`` does, so a resumed curve does not double back."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(folder / "tensorboard"), purge_step=resumed_at + 1)


def log_step(writer: Any, record: dict[str, Any]) -> None:
    for name in TRAIN_SCALARS:
        if record.get(name) is not None:
            writer.add_scalar(f"train/{name}", record[name], record["step"])


def log_evaluation(folder: Path, result: dict[str, Any]) -> None:
    """One model's held-out loss and accuracy, overall and per source, at step 0 (a re-evaluation
    replaces them)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(folder), purge_step=0) as writer:
        for figure in ("loss", "accuracy"):
            if figure in result:
                writer.add_scalar(f"heldout/{figure}", result[figure], 0)
        for source, figures in result["sources"].items():
            for figure in ("loss", "accuracy"):
                if figure in figures:
                    writer.add_scalar(f"heldout_{figure}/{source}", figures[figure], 0)


def log_benchmarks(folder: Path, scores: dict[str, float], average: float | None) -> None:
    """A model's lmms-eval scores (0–100) as its jobs end, each task's and, once every task has
    one, their average, at step 0."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(folder)) as writer:
        for task, value in scores.items():
            writer.add_scalar(f"benchmarks/{task}", value, 0)
        if average is not None:
            writer.add_scalar("benchmarks/average", average, 0)
