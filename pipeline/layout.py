"""The run directory: where every stage reads and writes. One place, so that the stages, the
flows and the report agree on it (DESIGN.md, "Contracts between stages")."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoint import is_complete
from pipeline.config import RunConfig

CONFIG = "config.yaml"  # the resolved config: any stage can be re-run from the run dir alone
INIT = "init"  # the tiny offline model as built
WARMUP = "warmup"  # the joint warm-up branch; its final/ is θ0 when warmup.steps > 0
CALIBRATION = "calibration"
BRANCHES = "branches"  # branches/<k>/ for the K groups of the split
JOINT = "joint"  # the joint baseline, trained like a branch on every source
MERGED = "merged"  # merged/<name>/ for each merge the config lists
EVAL = "eval"  # eval/<model>.json
REPORT = "report"


def is_tiny(cfg: RunConfig) -> bool:
    return cfg.model.name_or_path == "tiny"


def base_path(cfg: RunConfig, run_dir: str | Path) -> str:
    """The model before any training: the run's ``init/`` for the tiny model, else the
    configured hub id or folder, used in place."""
    return str(Path(run_dir) / INIT) if is_tiny(cfg) else cfg.model.name_or_path


def init_path(cfg: RunConfig, run_dir: str | Path) -> str:
    """θ0, the start every branch trains from: the warm-up's result, or the base model."""
    return str(Path(run_dir) / WARMUP / "final") if cfg.warmup.steps else base_path(cfg, run_dir)


def branch_dir(run_dir: str | Path, k: int) -> Path:
    return Path(run_dir) / BRANCHES / str(k)


def merged_dir(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / MERGED / name


def run_models(cfg: RunConfig, run_dir: str | Path) -> dict[str, str]:
    """Every model of the run that exists, by the name its evaluation and the report use:
    ``theta0``, ``branch-<k>``, ``joint``, ``merged-<name>``."""
    run_dir = Path(run_dir)
    candidates = {"theta0": Path(init_path(cfg, run_dir))}
    candidates |= {f"branch-{k}": branch_dir(run_dir, k) / "final" for k in range(cfg.branch_count)}
    candidates["joint"] = run_dir / JOINT / "final"
    candidates |= {f"merged-{m.name}": merged_dir(run_dir, m.name) for m in cfg.merge.methods}
    models = {name: str(path) for name, path in candidates.items() if is_complete(path)}
    if "theta0" not in models:  # a hub id or a folder without our manifest
        models = {"theta0": init_path(cfg, run_dir), **models}
    return models
