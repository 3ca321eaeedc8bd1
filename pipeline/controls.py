"""Controls: the run's K branches and merges again on another split, from the same θ0.

A control is a run directory of its own, ``<run>/controls/<name>/``, whose config differs from
the run's only in the split: so every stage (calibrate, train, merge, evaluate) runs on it
unchanged, and its figures compare with the run's at the same K, budget and merge methods. It
shares the run's prepared data and θ0 through relative links rather than copies: at 7B, θ0 is
15 GB and the prepared token ids are read-only for every stage.

``random`` is the Random-K control: the same recursive token-balanced median split on random
scores instead of the conflict axes, so the groups differ only in which sources go together.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.config import RunConfig, save_config
from pipeline.data.manifest import MANIFEST_PATH
from pipeline.layout import CONFIG, INIT, WARMUP, is_tiny

CONTROLS = "controls"
SPLIT_OF = {"random": "random"}  # control -> calibration.method of its split


def control_dir(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / CONTROLS / name


def control_of(run_dir: str | Path) -> str | None:
    """The control's name when ``run_dir`` is a control's run directory (``<run>/controls/<name>``)."""
    path = Path(run_dir)
    return path.name if path.parent.name == CONTROLS else None


def control_config(cfg: RunConfig, name: str) -> RunConfig:
    """The run's config with the control's split; no joint baseline (the run has it), no controls."""
    calibration = cfg.calibration.model_copy(update={"method": SPLIT_OF[name]})
    flow = cfg.flow.model_copy(update={"controls": [], "joint_baseline": False})
    return cfg.model_copy(update={"calibration": calibration, "flow": flow})


def make_control(cfg: RunConfig, run_dir: str | Path, name: str) -> Path:
    """Write the control's run directory; idempotent."""
    return linked_run(control_config(cfg, name), run_dir, control_dir(run_dir, name))


def linked_run(cfg: RunConfig, run_dir: str | Path, folder: str | Path) -> Path:
    """A run directory with its own config that reads ``run_dir``'s prepared data and θ0 (both
    must be the same under ``cfg``: the data, model and warm-up sections unchanged)."""
    run_dir, folder = Path(run_dir), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_config(cfg, folder / CONFIG)
    shared = [MANIFEST_PATH.parts[0]] + ([INIT] if is_tiny(cfg) else []) + ([WARMUP] if cfg.warmup.steps else [])
    for part in shared:
        _link(folder / part, os.path.relpath(run_dir / part, folder))
    return folder


def _link(path: Path, target: str) -> None:
    if path.is_symlink() and os.readlink(path) == target:
        return
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        raise FileExistsError(f"{path} exists and is not the link to the run's {target}: remove it")
    path.symlink_to(target, target_is_directory=True)


def controls_of(cfg: RunConfig, run_dir: str | Path) -> dict[str, Path]:
    """The run's configured controls that have a run directory, by name."""
    folders = {name: control_dir(run_dir, name) for name in cfg.flow.controls}
    return {name: folder for name, folder in folders.items() if (folder / CONFIG).is_file()}
