"""The report's first stage: the run directory read into typed records, as its stages wrote them.

Reading only: which evaluation is of the weights a model has now, which checkpoint verifies,
which benchmark scores are current; no figure is computed here (see ``derive``). Every part but
``config.yaml`` and ``data/manifest.json`` may be missing: its record is then empty.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.checkpoint import MANIFEST, CheckpointError, bytes_hashed, checkpoint_id, verify_checkpoint
from pipeline.checkpoint import read_manifest as read_checkpoint_manifest
from pipeline.config import RunConfig, load_config
from pipeline.controls import controls_of
from pipeline.data.manifest import read_manifest as read_data_manifest
from pipeline.eval.benchmarks import CONSTANT, constant_answers, read_scores
from pipeline.hub import ModelNotFoundError
from pipeline.layout import (
    BRANCHES,
    CALIBRATION,
    CONFIG,
    DIAGNOSTICS,
    DILOCO,
    DILOCO_PLAN,
    EVAL,
    JOINT,
    MERGED,
    SEARCH_RESULT,
    WARMUP,
    base_path,
    diloco_finals,
    model_paths,
    search_dir,
)
from pipeline.merge.io import MergeInputError
from pipeline.merge.layout import ModelView
from pipeline.merge.spec import ModelEntry

KINDS = ("theta0", "branch", "joint", "merged", "diloco")  # the models' fixed order; a model's kind is its name prefix
MODEL_FIGURES = ("loss", "macro_loss", "token_accuracy", "accuracy", "roles")  # of an evaluation, in the report


@dataclass(frozen=True)
class Evaluation:
    """``eval/<name>.json`` of a model of the run as configured, of the weights it has now."""

    name: str
    kind: str  # one of KINDS, or "other"
    checkpoint: str | None  # the weights evaluated, as the evaluation names them
    figures: dict[str, Any]  # those of MODEL_FIGURES and "seconds" the evaluation has, in that order
    sources: dict[str, dict[str, Any]]  # per source: loss, token accuracy, ...


@dataclass(frozen=True)
class Training:
    """A training folder: the warm-up, a branch of the split or the joint baseline."""

    name: str  # "warmup", "branch-<k>", "joint"
    kind: str  # "warmup", "branch", "joint"
    dir: str  # relative to the run directory
    spec_sources: list[str] | None  # spec.json's sources as written (None without a spec)
    final: dict[str, Any]  # final/manifest.json; {} until the training has finished
    metrics: list[dict[str, Any]]  # metrics.jsonl, one record a step
    adapter_bytes: int | None  # of final/adapter_model*.safetensors, for a LoRA training
    loss_plot: str | None  # its loss.png, relative to the run directory


@dataclass(frozen=True)
class Merge:
    """``merged/<name>/manifest.json`` of a merge the config lists."""

    name: str
    spec: dict[str, Any]  # the merge spec as the merge recorded it (pipeline.merge.spec.MergeSpec)
    report: dict[str, Any]  # the merge's own report (seconds, tensors, ...)
    # The spec's models by the run's name for them ("branch-<k>"; else the path as recorded), each
    # with the tokens or weight it was merged with; empty for a manifest that does not record them.
    models: dict[str, ModelEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class Calibration:
    summary: dict[str, Any]  # calibration/summary.json
    split: dict[str, Any]  # calibration/split.json
    plots: list[str]  # calibration/*.png, relative to the run directory, sorted


@dataclass(frozen=True)
class Control:
    """A control run (``controls/<name>/``): its config, evaluations, diagnostics and scores."""

    name: str
    config: RunConfig
    models: list[Evaluation]
    diagnostics: dict[str, Any]
    benchmarks: dict[str, dict[str, Any]]  # model name -> its current benchmark scores (read_scores)


@dataclass(frozen=True)
class RunRecords:
    """Everything the report shows, as read from the run directory."""

    run_dir: str  # resolved
    config: RunConfig
    data: dict[str, Any]  # data/manifest.json
    problems: list[str]  # checkpoints that exist but do not verify
    models: list[Evaluation]  # in the report's order: θ0, branches, joint, merges, DiLoCo finals
    trainings: list[Training]  # warm-up, branches in order, joint baseline (those with a folder)
    calibration: Calibration
    merges: list[Merge]  # in the config's order, those with a manifest
    hashed: dict[str, int]  # bytes hashed writing and verifying checkpoints
    diagnostics: dict[str, Any]  # eval/diagnostics.json
    benchmarks: dict[str, dict[str, Any]]  # model name -> its current benchmark scores (read_scores)
    controls: list[Control]
    diloco: list[dict[str, Any]]  # diloco_runs
    search: dict[str, Any] = field(default_factory=dict)  # merit tune-merge's search.json ({}: none)
    source: dict[str, Any] = field(default_factory=dict)  # the run's source checkpoint and its layout ({}: not here)


def collect(run_dir: str | Path) -> RunRecords:
    run_dir = Path(run_dir)
    cfg, data = load_config(run_dir / CONFIG), read_data_manifest(run_dir)  # the two parts a run always has
    models = evaluations(cfg, run_dir)
    problems = checkpoint_problems(cfg, run_dir)  # before counting the bytes hashed: verifying hashes
    controls = [control(name, folder) for name, folder in controls_of(cfg, run_dir).items()]
    return RunRecords(
        run_dir=str(run_dir.resolve()),
        config=cfg,
        data=data,
        problems=problems,
        models=models,
        trainings=trainings(cfg, run_dir),
        calibration=Calibration(
            summary=read_json(run_dir / CALIBRATION / "summary.json"),
            split=read_json(run_dir / CALIBRATION / "split.json"),
            plots=sorted(str(p.relative_to(run_dir)) for p in (run_dir / CALIBRATION).glob("*.png")),
        ),
        merges=merges(cfg, run_dir),
        hashed=bytes_hashed(run_dir),
        diagnostics=read_json(run_dir / EVAL / DIAGNOSTICS),
        benchmarks=benchmark_scores(cfg, run_dir, models),
        controls=controls,
        diloco=diloco_runs(run_dir),
        search=read_json(search_dir(run_dir, cfg.merge.search.merge) / SEARCH_RESULT),
        source=source_layout(cfg, run_dir),
    )


def source_layout(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """The model the run started from (every checkpoint it writes keeps its stored layout and its tensors
    transformers does not load): its path, layout and carried tensors; {} on a machine without it."""
    try:
        path = base_path(cfg, run_dir)
        view = ModelView.open(path)
    except (ModelNotFoundError, MergeInputError, OSError):
        return {}
    return {"path": str(path), "layout": view.layout.summary(), "carried": view.layout.carried}


def model_kind(name: str) -> str:
    return next((k for k in KINDS if name == k or name.startswith(f"{k}-")), "other")


def _natural(name: str) -> list[Any]:
    """``branch-10`` after ``branch-9``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _order(name: str) -> tuple[int, list[Any]]:
    kind = model_kind(name)
    return (KINDS.index(kind) if kind in KINDS else len(KINDS), _natural(name))


def read_json(path: Path) -> dict[str, Any]:
    """An optional part of the run: empty when missing."""
    return json.loads(path.read_text()) if path.is_file() else {}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def evaluations(cfg: RunConfig, run_dir: Path) -> list[Evaluation]:
    """The evaluations of the run's models as configured now: not those of merges dropped from the
    config or of branches from an earlier split, nor those of weights since replaced."""
    found, finals = [], diloco_finals(run_dir)
    paths = model_paths(cfg, run_dir)
    for name, checkpoint in sorted(paths.items(), key=lambda kv: _order("diloco" if kv[0] in finals else kv[0])):
        path = run_dir / EVAL / f"{name}.json"
        result = json.loads(path.read_text()) if path.is_file() else None
        if result is None or (checkpoint.exists() and result.get("checkpoint_id") != checkpoint_id(checkpoint)):
            continue
        found.append(
            Evaluation(
                name=path.stem,
                kind="diloco" if name in finals else model_kind(name),
                checkpoint=result.get("checkpoint"),
                figures={k: result[k] for k in (*MODEL_FIGURES, "seconds") if k in result},
                sources=result.get("sources", {}),
            )
        )
    return found


def trainings(cfg: RunConfig, run_dir: Path) -> list[Training]:
    """Every training with a folder: warm-up, the split's branches in order, joint baseline."""
    names = [n for n in model_paths(cfg, run_dir) if n.startswith("branch-")]
    branches = [(name, "branch", run_dir / BRANCHES / name.removeprefix("branch-")) for name in names]
    found = [("warmup", "warmup", run_dir / WARMUP), *branches, ("joint", "joint", run_dir / JOINT)]
    return [training(run_dir, name, kind, folder) for name, kind, folder in found if folder.is_dir()]


def training(run_dir: Path, name: str, kind: str, folder: Path) -> Training:
    final = read_checkpoint_manifest(folder / "final") if (folder / "final" / MANIFEST).is_file() else {}
    spec = folder / "spec.json"
    adapters = list((folder / "final").glob("adapter_model*.safetensors"))
    return Training(
        name=name,
        kind=kind,
        dir=str(folder.relative_to(run_dir)),
        # read as JSON: a spec from an older version may not load
        spec_sources=json.loads(spec.read_text())["sources"] if spec.is_file() else None,
        final=final,
        metrics=read_metrics(folder / "metrics.jsonl"),
        adapter_bytes=sum(f.stat().st_size for f in adapters) if final.get("lora") else None,
        loss_plot=str((folder / "loss.png").relative_to(run_dir)) if (folder / "loss.png").is_file() else None,
    )


def checkpoint_problems(cfg: RunConfig, run_dir: Path) -> list[str]:
    """The run's checkpoints that exist but do not verify: reported, never silently left out."""
    problems = []
    for name, path in model_paths(cfg, run_dir).items():
        if (path / MANIFEST).is_file() or (name != "theta0" and path.exists()):
            try:
                verify_checkpoint(path)
            except CheckpointError as err:
                problems.append(f"{name}: {err}")
    return problems


def merges(cfg: RunConfig, run_dir: Path) -> list[Merge]:
    found = []
    for folder in (run_dir / MERGED / m.name for m in cfg.merge.methods):
        if (folder / MANIFEST).is_file():
            manifest = read_checkpoint_manifest(folder)
            spec = manifest.get("spec", {})
            found.append(Merge(folder.name, spec, manifest.get("report", {}), merged_models(spec)))
    return found


def merged_models(spec: dict[str, Any]) -> dict[str, ModelEntry]:
    """The models a merge spec lists, by the run's name for each: ``branch-<k>`` for a branch's
    ``branches/<k>/final`` (wherever the run directory was then), else the path as recorded."""
    try:
        entries = [ModelEntry.model_validate(m) for m in spec.get("models", [])]
    except ValidationError:
        return {}  # written by another version: no weights to show
    return {_merged_name(e.source): e for e in entries}


def _merged_name(source: str) -> str:
    parts = Path(source).parts
    if len(parts) >= 3 and parts[-3] == BRANCHES and parts[-2].isdigit() and parts[-1] == "final":
        return f"branch-{parts[-2]}"
    return source


def benchmark_scores(cfg: RunConfig, run_dir: Path, models: list[Evaluation]) -> dict[str, dict[str, Any]]:
    """Each model's lmms-eval scores, those of the weights it has now, and the constant-answer
    baseline's (the toy tasks' best single answers), when it was scored."""
    found = {}
    for name, checkpoint in [(m.name, m.checkpoint) for m in models] + [(CONSTANT, constant_answers(run_dir))]:
        if scores := read_scores(cfg, run_dir, name, checkpoint):
            found[name] = scores
    return found


def control(name: str, folder: Path) -> Control:
    cfg = load_config(folder / CONFIG)
    models = evaluations(cfg, folder)
    return Control(name, cfg, models, read_json(folder / EVAL / DIAGNOSTICS), benchmark_scores(cfg, folder, models))


def inner_optimizer(train: dict[str, Any]) -> str:
    """A worker's inner optimizer in words, with its lrs (a ``train`` section as saved)."""
    if train.get("optimizer", "adamw") == "muon":
        return f"Muon lr {train['muon_lr']:g}, μ {train['muon_momentum']:g} + AdamW lr {train['lr']:g}"
    return f"AdamW lr {train['lr']:g}"


def diloco_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Every DiLoCo variant (``diloco/<method>-<shards>/``) with at least one round: its plan's
    settings and its rounds' records."""
    runs = []
    for path in sorted((run_dir / DILOCO).glob(f"*/{DILOCO_PLAN}")):
        rounds = path.parent / "rounds.json"
        if not rounds.is_file():
            continue
        plan = json.loads(path.read_text())
        method, train = plan["method"], plan["workers"][0]["config"]["train"]
        runs.append(
            {
                "variant": plan["variant"],
                "method": method.get("method") or "rules",
                "outer": f"η {method['outer_lr']}, μ {method['outer_momentum']}"
                + (" Nesterov" if method["nesterov"] else ""),
                "workers": len(plan["workers"]),
                "inner_steps": plan["inner_steps"],
                "rounds": plan["rounds"],
                "compression": plan["compression"],
                "lora_rank": train["lora_rank"] if train.get("finetuning_type") == "lora" else None,
                "inner": inner_optimizer(train),
                "sync": plan.get("sync", "sync"),
                "records": json.loads(rounds.read_text()),
            }
        )
    return runs
