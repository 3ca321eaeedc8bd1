"""What a run trains, as branch specs: the joint warm-up that makes θ0, MERIT's K groups from
the split, and the joint baseline. Every one trains through ``train_branch``."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import RunConfig
from pipeline.data import active_sources, read_manifest
from pipeline.layout import JOINT, WARMUP, base_path, branch_dir, init_path, split_groups
from pipeline.train.spec import BranchSpec


def _spec(
    cfg: RunConfig, run_dir: str | Path, name: str, init: str, sources: list[str], out: Path, **train: object
) -> BranchSpec:
    config = cfg.model_copy(update={"train": cfg.train.model_copy(update=train)}) if train else cfg
    return BranchSpec(name=name, run_dir=str(run_dir), init=init, sources=sources, out_dir=str(out), config=config)


def all_sources(run_dir: str | Path, role: str = "finetune") -> list[str]:
    """The prepared sources of a role: by default the fine-tuning sources, all the branches see."""
    return list(active_sources(read_manifest(run_dir), role))


def warmup_spec(cfg: RunConfig, run_dir: str | Path) -> BranchSpec:
    """The joint warm-up from the base model on every ``warmup.sources`` source (by default on
    every fine-tuning source); its ``final/`` is θ0."""
    w = cfg.warmup
    return _spec(
        cfg,
        run_dir,
        WARMUP,
        base_path(cfg, run_dir),
        all_sources(run_dir, "warmup" if w.sources else "finetune"),
        Path(run_dir) / WARMUP,
        steps=w.steps,
        lr=w.lr or cfg.train.lr,
        finetuning_type=w.finetuning_type,
    )


def group_specs(cfg: RunConfig, run_dir: str | Path) -> list[BranchSpec]:
    """One branch per group of the split, each from θ0 with the ``train`` section as it is: by
    default one epoch over its own group's data, as MERIT trains them."""
    init = init_path(cfg, run_dir)
    return [
        _spec(cfg, run_dir, str(k), init, group, branch_dir(run_dir, k))
        for k, group in enumerate(split_groups(run_dir))
    ]


def joint_spec(cfg: RunConfig, run_dir: str | Path) -> BranchSpec:
    """The baseline: every source in one branch with the K branches' total budget, so merged and
    joint models have seen the same examples: ``train.epochs`` over all the data (the union of
    the groups), or with ``train.steps`` K × steps at the same batch."""
    k, t = cfg.branch_count, cfg.train
    return _spec(
        cfg,
        run_dir,
        JOINT,
        init_path(cfg, run_dir),
        all_sources(run_dir),
        Path(run_dir) / JOINT,
        steps=t.steps and k * t.steps,
        timeout_s=k * t.timeout_s,
    )


def branch_spec(cfg: RunConfig, run_dir: str | Path, name: str) -> BranchSpec:
    """A run's branch by name: ``warmup``, ``joint`` or a group number."""
    if name == WARMUP:
        return warmup_spec(cfg, run_dir)
    if name == JOINT:
        return joint_spec(cfg, run_dir)
    specs = group_specs(cfg, run_dir)
    if not name.isdigit() or int(name) >= len(specs):
        raise ValueError(f"unknown branch '{name}': the run has warmup, joint and groups 0..{len(specs) - 1}")
    return specs[int(name)]
