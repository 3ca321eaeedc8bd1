"""The ``merge`` stage of a run: its K branches merged as each entry of the config's ``merge``
section says, into ``merged/<name>``, through the merge library.

MERIT's merge weights each branch by n_k, the tokens of its group's training data (``weighting:
tokens``, as the paper defines it): a property of the split, not of how long the branch trained
or how long its examples happened to be.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pipeline.checkpoint import CheckpointError, checkpoint_id, is_complete, read_manifest, verify_checkpoint
from pipeline.config import MergeEntry, RunConfig
from pipeline.data import Collator, Encoder, active_sources, load_split
from pipeline.data import read_manifest as read_data_manifest
from pipeline.data.store import StoredExamples
from pipeline.fisher import estimate_fisher
from pipeline.layout import branch_dir, init_path, merged_dir, split_groups
from pipeline.merge import MergeSpec, ModelEntry, get_method, merge_checkpoints
from pipeline.merge.adapter import adapted_parameters
from pipeline.merge.mergekit_config import branch_config, run_config
from pipeline.models import load_model, load_processor
from pipeline.models.adapter import is_adapter


def branch_finals(run_dir: str | Path) -> list[Path]:
    """Every branch's ``final/`` checkpoint; missing or corrupt ones are an error naming each."""
    finals = [branch_dir(run_dir, k) / "final" for k in range(len(split_groups(run_dir)))]
    problems = []
    for final in finals:
        try:
            verify_checkpoint(final)
        except CheckpointError as err:
            problems.append(f"branch {final.parent.name}: {err}")
    if problems:
        raise FileNotFoundError(f"{run_dir}: cannot merge: " + "; ".join(problems) + " (train them again first)")
    return finals


def group_tokens(run_dir: str | Path, groups: list[list[str]]) -> list[int]:
    """n_k: the training tokens of each group's sources, as prepared."""
    sources = active_sources(read_data_manifest(run_dir))
    for k, group in enumerate(groups):
        if unknown := sorted(set(group) - set(sources)):
            raise ValueError(f"group {k}: sources {unknown} are not prepared in {run_dir} (dropped or renamed?)")
    return [sum(sources[s]["train_tokens"] for s in group) for group in groups]


def find_entry(cfg: RunConfig, name: str) -> MergeEntry:
    entry = next((m for m in cfg.merge.methods if m.name == name), None)
    if entry is None:
        raise ValueError(
            f"no merge named '{name}' in the config; merge.methods has {[m.name for m in cfg.merge.methods]}"
        )
    return entry


def merge_spec(cfg: RunConfig, run_dir: str | Path, entry: MergeEntry, fishers: list[Path] | None = None) -> MergeSpec:
    finals = branch_finals(run_dir)
    tokens = group_tokens(run_dir, [read_manifest(f)["sources"] for f in finals])
    return entry_spec(cfg, entry, init_path(cfg, run_dir), finals, tokens, merged_dir(run_dir, entry.name), fishers)


def entry_spec(
    cfg: RunConfig,
    entry: MergeEntry,
    base: str | Path,
    finals: list[Path],
    tokens: list[int],
    out: Path,
    fishers: list[Path] | None = None,
) -> MergeSpec:
    """The merge spec of one entry of the ``merge`` section over given branches (validated)."""
    kind = "adapter" if cfg.train.finetuning_type == "lora" else "path"  # LoRA branches: merged on ΔW
    models = [
        ModelEntry(
            **{kind: str(final)},
            tokens=tokens[k] if entry.weighting == "tokens" else None,
            fisher=str(fishers[k]) if fishers else None,
        )
        for k, final in enumerate(finals)
    ]
    return MergeSpec(
        base_model=str(base),
        models=models,
        method=entry.method,
        params=entry.params,
        rules=entry.rules,
        out_path=str(out),
        out_dtype=cfg.merge.out_dtype,
        out_format=entry.out_format,
        adapter_rank=entry.adapter_rank,
        device=cfg.merge.device,
        block_mb=cfg.merge.block_mb,
        seed=cfg.run.seed,
    )


def needs_fisher(entry: MergeEntry) -> bool:
    return any(get_method(rule.method).needs_fisher for rule in entry.effective_rules)


def branch_fisher(cfg: RunConfig, run_dir: str | Path, k: int) -> Path:
    """Diagonal Fisher of branch k at its final weights, from ``merge.fisher_examples`` of its own
    training examples (one per batch: the per-example empirical Fisher), on ``merge.device``;
    kept in ``fisher/``. A LoRA branch's is that of the tensors its merge combines: the dense
    weights of the adapted modules at θ0 + ΔW_k."""
    final, out = branch_dir(run_dir, k) / "final", branch_dir(run_dir, k) / "fisher"
    source = {"final": checkpoint_id(final), "examples": cfg.merge.fisher_examples, "seed": cfg.run.seed}
    if is_complete(out) and read_manifest(out).get("source") == source:
        return out
    model, processor = load_model(final, cfg.model), load_processor(final, cfg.model)
    if is_adapter(final):
        adapted = adapted_parameters(final)
        for name, param in model.named_parameters():
            param.requires_grad_(name in adapted)
    examples = StoredExamples.joined(list(load_split(cfg, run_dir, "train", read_manifest(final)["sources"]).values()))
    sample = random.Random(f"{cfg.run.seed}/fisher/{k}").sample(examples, min(cfg.merge.fisher_examples, len(examples)))
    encoder, collator = Encoder(processor, cfg.data.max_length), Collator(processor.tokenizer.pad_token_id)
    batches = (collator([encoder(ex)]) for ex in sample)
    return estimate_fisher(model, batches, out, device=cfg.merge.device, source=source)


def merge_run(cfg: RunConfig, run_dir: str | Path, name: str) -> dict[str, Any]:
    """Write ``merged/<name>`` unless it exists from the same spec and the same input weights;
    returns the merge report."""
    entry = find_entry(cfg, name)
    if entry.merge_method is not None:
        return merge_mergekit_entry(cfg, run_dir, entry)
    fishers = (
        [branch_fisher(cfg, run_dir, k) for k in range(len(branch_finals(run_dir)))] if needs_fisher(entry) else None
    )
    spec = merge_spec(cfg, run_dir, entry, fishers)
    paths = [spec.base_model, *(m.source for m in spec.models), *(m.fisher for m in spec.models if m.fisher)]
    inputs = {path: checkpoint_id(path) for path in paths}
    out = Path(spec.out_path)
    if is_complete(out):
        manifest = read_manifest(out)
        if manifest.get("spec") == spec.model_dump(mode="json") and manifest.get("inputs") == inputs:
            return manifest["report"]
    return merge_checkpoints(spec, progress=False, inputs=inputs).summary()


def merge_mergekit_entry(cfg: RunConfig, run_dir: str | Path, entry: MergeEntry) -> dict[str, Any]:
    """A mergekit entry over the branches (full checkpoints), redone only when it or its inputs change."""
    if cfg.train.finetuning_type == "lora":
        raise ValueError(f"merge '{entry.name}': mergekit entries merge full checkpoints; LoRA branches need 'method'")
    finals = branch_finals(run_dir)
    tokens = group_tokens(run_dir, [read_manifest(f)["sources"] for f in finals])
    weights = tokens if entry.weighting == "tokens" else [1] * len(finals)
    shares = [w / sum(weights) for w in weights]
    base, out = init_path(cfg, run_dir), merged_dir(run_dir, entry.name)
    config = branch_config(entry.merge_method, entry.parameters, base, finals, shares, out)
    config = config.model_copy(update={"out_dtype": cfg.merge.out_dtype})
    inputs = {str(path): checkpoint_id(path) for path in [base, *finals]}
    if is_complete(out):
        manifest = read_manifest(out)
        if (
            manifest.get("mergekit") == config.model_dump(mode="json", exclude_none=True)
            and manifest.get("inputs") == inputs
        ):
            return manifest["report"]
    overrides = {"block_mb": cfg.merge.block_mb, "seed": cfg.run.seed}
    return run_config(config, device=cfg.merge.device, progress=False, overrides=overrides, inputs=inputs).summary()
