"""The run directory: where every stage reads and writes. One place, so that the stages, the
flows and the report agree on it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from pipeline.checkpoint import is_complete
from pipeline.config import ConfigError, RunConfig, SourceSpec, load_config, save_config
from pipeline.hub import ModelNotFoundError, dataset_snapshot, resolve_model
from pipeline.models.families import is_tiny_name

CONFIG = "config.yaml"  # the resolved config: any stage can be re-run from the run dir alone
INIT = "init"  # the tiny offline model as built
WARMUP = "warmup"  # the joint warm-up branch; its final/ is θ0 when warmup.steps > 0
CALIBRATION = "calibration"
BRANCHES = "branches"  # branches/<k>/ for the K groups of the split
JOINT = "joint"  # the joint baseline, trained like a branch on every source
MERGED = "merged"  # merged/<name>/ for each merge the config lists
SEARCH = "search"  # search/<merge>/: merit tune-merge's study, trials and chosen merge
SEARCH_RESULT, SEARCH_PLOT = "search.json", "search.png"  # in search/<merge>/
DILOCO = "diloco"  # diloco/<method>-<shards>/ for each DiLoCo method the config lists
DILOCO_PLAN = "plan.json"  # a DiLoCo variant's settings, in its folder
EVAL = "eval"  # eval/<model>.json
DIAGNOSTICS = "diagnostics.json"  # eval/diagnostics.json: loss barrier between branches, distances from θ0
REPORT = "report"
BENCH = "bench"  # bench/<name>/: what a `merit bench` command trains or writes inside a run directory


def run_config(config: str | Path | None, overrides: list[str], run_dir: str | Path | None) -> tuple[RunConfig, Path]:
    """CONFIG (or the run directory's saved one, else the built-in defaults) plus overrides, and
    the run directory (default ``runs/<run.name>``); writes nothing. With neither CONFIG nor a run
    directory there is no run to read: an error naming what to pass (the built-in defaults would
    name ``runs/demo`` and read or overwrite whatever run is there)."""
    if config is None and run_dir is None:
        present = sorted(str(p.parent) for p in Path("runs").glob(f"*/{CONFIG}"))
        raise ConfigError(
            "which run? pass CONFIG, or --run-dir DIR of a run"
            + (f" (here: {', '.join(present)})" if present else " (none under runs/ here)")
        )
    if config is None and (Path(run_dir) / CONFIG).is_file():
        config = Path(run_dir) / CONFIG
    cfg = pin_revisions(load_config(config, overrides))
    return cfg, Path(run_dir or Path("runs") / cfg.run.name)


def start_run(config: str | Path | None, overrides: list[str], run_dir: str | Path | None) -> tuple[RunConfig, Path]:
    """``run_config``, saved as the run's ``config.yaml`` that every stage reads: written when it
    is new or CONFIG or the overrides change it, never rewritten as it was."""
    cfg, run_dir = run_config(config, overrides, run_dir)
    path = run_dir / CONFIG
    if not path.is_file() or load_config(path) != cfg:
        save_config(cfg, path)
    return cfg, run_dir


def pin_revisions(cfg: RunConfig) -> RunConfig:
    """θ0 and the hub data sets named by an id without a revision: pin the commit each snapshot has
    now, so that every stage and machine of the run reads the same weights and records even if the
    hub's main branch moves on (left as they are when a snapshot cannot be found: preflight says so)."""
    m = cfg.model
    if not (is_tiny(cfg) or m.revision is not None or Path(m.name_or_path).expanduser().is_dir()):
        with contextlib.suppress(ModelNotFoundError):
            commit = resolve_model(m.name_or_path).name  # the snapshot folder is named by its commit
            cfg = cfg.model_copy(update={"model": m.model_copy(update={"revision": commit})})
    lists = {
        ("data", "sources"): cfg.data.sources,
        ("warmup", "sources"): cfg.warmup.sources or [],
        ("eval", "sources"): cfg.eval.sources,
    }
    for (section, key), specs in lists.items():
        pinned = [_pinned_source(spec) for spec in specs]
        if pinned != specs:
            part = getattr(cfg, section)
            cfg = cfg.model_copy(update={section: part.model_copy(update={key: pinned})})
    return cfg


def _pinned_source(spec: SourceSpec) -> SourceSpec:
    if spec.format != "hub" or spec.revision is not None or Path(spec.path).expanduser().is_dir():
        return spec
    folder = dataset_snapshot(spec.path)
    return spec if folder is None else spec.model_copy(update={"revision": folder.name})


def is_tiny(cfg: RunConfig) -> bool:
    return is_tiny_name(cfg.model.name_or_path)


def base_path(cfg: RunConfig, run_dir: str | Path) -> str:
    """The model before any training: the run's ``init/`` for the tiny model, else the configured
    folder or the local snapshot of the configured hub id, used in place (an error naming the id
    when this machine has no snapshot of it)."""
    if is_tiny(cfg):
        return str(Path(run_dir) / INIT)
    return str(resolve_model(cfg.model.name_or_path, cfg.model.revision))


def init_path(cfg: RunConfig, run_dir: str | Path) -> str:
    """θ0, the start every branch trains from: the warm-up's result, or the base model."""
    return str(Path(run_dir) / WARMUP / "final") if cfg.warmup.steps else base_path(cfg, run_dir)


def branch_dir(run_dir: str | Path, k: int) -> Path:
    return Path(run_dir) / BRANCHES / str(k)


def diloco_dir(run_dir: str | Path, variant: str) -> Path:
    return Path(run_dir) / DILOCO / variant


def training_dir(run_dir: str | Path, name: str) -> Path:
    """The folder of a run's training by name: ``warmup``, ``joint``, a group number or a DiLoCo
    worker ``<variant>/<k>``."""
    if "/" in name:
        variant, k = name.split("/")
        return diloco_dir(run_dir, variant) / "workers" / k
    return Path(run_dir) / name if name in (WARMUP, JOINT) else branch_dir(run_dir, int(name))


def bench_dir(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / BENCH / name


def merged_dir(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / MERGED / name


def search_dir(run_dir: str | Path, merge: str) -> Path:
    return Path(run_dir) / SEARCH / merge


def tuned_dir(run_dir: str | Path, merge: str) -> Path:
    """The merge ``merit tune-merge`` chose for ``merge``."""
    return search_dir(run_dir, merge) / "best"


def tuned_name(cfg: RunConfig) -> str:
    """The chosen merge's model name: ``merged-<merge>-tuned``."""
    return f"merged-{cfg.merge.search.merge}-tuned"


def split_groups(run_dir: str | Path) -> list[list[str]]:
    """The groups of the split (``calibration/split.json``): one branch each."""
    path = Path(run_dir) / CALIBRATION / "split.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the calibrate stage first")
    return json.loads(path.read_text())["groups"]


def model_paths(cfg: RunConfig, run_dir: str | Path) -> dict[str, Path]:
    """Where each model of the run as configured lives, by the name its evaluation and the report
    use: ``theta0``, ``branch-<k>`` (one per group of the split), ``joint``, ``merged-<name>`` (and
    ``merged-<name>-tuned``, the weights ``merge.search`` chose)."""
    run_dir = Path(run_dir)
    groups = split_groups(run_dir) if (run_dir / CALIBRATION / "split.json").is_file() else []
    try:
        theta0 = Path(init_path(cfg, run_dir))
    except ModelNotFoundError:  # a machine without θ0's snapshot (the report's): its name will do
        theta0 = Path(cfg.model.name_or_path)
    return {
        "theta0": theta0,
        **{f"branch-{k}": branch_dir(run_dir, k) / "final" for k in range(len(groups))},
        "joint": run_dir / JOINT / "final",
        **{f"merged-{m.name}": merged_dir(run_dir, m.name) for m in cfg.merge.methods},
        **({tuned_name(cfg): tuned_dir(run_dir, cfg.merge.search.merge)} if cfg.merge.search.enabled else {}),
        **diloco_finals(run_dir),
    }


def diloco_finals(run_dir: str | Path) -> dict[str, Path]:
    """The last global weights of every DiLoCo variant the run directory holds, by variant name
    (``<method>-<shards>``): the folder its plan says the run ends in (T rounds; async: R·T
    arrivals, or the newest global when a worker failed for good before sending its last)."""
    finals = {}
    for path in sorted((Path(run_dir) / DILOCO).glob(f"*/{DILOCO_PLAN}")):
        plan, folder = json.loads(path.read_text()), path.parent / "global"
        last = plan["rounds"]
        if plan.get("sync") == "async":
            written = [int(p.name) for p in folder.glob("*") if p.name.isdigit() and (p / "manifest.json").is_file()]
            last = min(last * len(plan["workers"]), max(written, default=last * len(plan["workers"])))
        finals[path.parent.name] = folder / str(last)
    return finals


def run_models(cfg: RunConfig, run_dir: str | Path) -> dict[str, str]:
    """The run's models that exist; θ0 always (a hub id or a folder without our manifest)."""
    paths = model_paths(cfg, run_dir)
    return {name: str(path) for name, path in paths.items() if name == "theta0" or is_complete(path)}
