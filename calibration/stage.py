"""The ``calibrate`` stage: gradients at θ0 → conflict matrix → split plan, plots and timings,
all under ``run_dir/calibration/``; optional diagnostics (split stability, accuracy vs n)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from sklearn.metrics import adjusted_rand_score
from tqdm.auto import tqdm

from calibration.errors import CalibrationError
from calibration.gradients import (
    SourceGradients,
    calibration_sample,
    default_devices,
    estimate_source_gradients,
    select_parameters,
)
from calibration.plots import plot_accuracy_curve, plot_axes, plot_conflicts, plot_explained_variance
from calibration.split import SplitPlan, conflict_matrix, plan_split
from pipeline.checkpoint import checkpoint_id, is_complete, write_json_atomic
from pipeline.config import RunConfig
from pipeline.data import Collator, Encoder, Example, active_sources, load_split, read_manifest
from pipeline.layout import init_path, is_tiny
from pipeline.models import load_model, processor_for

OUT_DIR = "calibration"


def theta0(cfg: RunConfig, run_dir: Path) -> str:
    """θ0's path, which must exist when it is made in the run (the tiny model, the warm-up)."""
    path = init_path(cfg, run_dir)
    if (cfg.warmup.steps or is_tiny(cfg)) and not is_complete(path):
        then = ", then `merit train --branch warmup`" if cfg.warmup.steps else ""
        raise CalibrationError(
            f"θ0 {path} is missing: make it first (`merit init`{then}) or run the whole flow (`merit run`)"
        )
    return path


class _Estimator:
    """θ0, its processor and the parameter choice, loaded once for every gradient estimate."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg = cfg
        self.model = load_model(theta0(cfg, run_dir), cfg.model)
        processor = processor_for(cfg, run_dir)
        self.encoder = Encoder(processor, cfg.data.max_length)
        self.collator = Collator(processor.tokenizer.pad_token_id)
        self.params = select_parameters(self.model, cfg.calibration.params, cfg.calibration.matrices_only)
        self.devices = cfg.calibration.devices or default_devices()
        self.model.to(self.devices[0])

    def gradients(self, sample: dict[str, list[Example]], desc: str = "calibrate") -> SourceGradients:
        c = self.cfg.calibration
        with tqdm(total=len(sample), desc=desc, unit="source", leave=False) as bar:
            return estimate_source_gradients(
                self.model,
                sample,
                self.encoder,
                self.collator,
                self.params,
                c.sketch,
                c.dim,
                c.batch_size,
                self.cfg.run.seed,
                self.devices,
                progress=lambda _: bar.update(),
                checkpointing=self.cfg.train.gradient_checkpointing,  # the branches' memory trade
            )

    def split(
        self, grads: SourceGradients, tokens: dict[str, int], samples: dict[str, int] | None
    ) -> tuple[torch.Tensor, SplitPlan]:
        c = self.cfg.calibration
        conflicts = conflict_matrix(grads.matrix, c.centre)
        plan = plan_split(grads.sources, tokens, c.r, c.method, conflicts, self.cfg.run.seed, c.groups, c.pca, samples)
        return conflicts, plan


def refuse_small_sources(examples: dict[str, int], n: int) -> None:
    """``calibration.small_sources: refuse``: every source with fewer training examples than n, named."""
    small = {name: count for name, count in examples.items() if count < n}
    if small:
        listed = ", ".join(f"'{name}' ({count})" for name, count in sorted(small.items()))
        raise CalibrationError(
            f"{len(small)} sources have fewer training examples than calibration.n_per_source = {n}: {listed}. "
            "Lower n_per_source, drop them, or set calibration.small_sources: use_all"
        )


def calibrate(cfg: RunConfig, run_dir: str | Path, diagnostics: bool = False, force: bool = False) -> dict[str, Any]:
    """Write gradients, conflicts, ``split.json`` and plots; reuse them when up to date."""
    run_dir, out = Path(run_dir), Path(run_dir) / OUT_DIR
    digest = cfg.digest("run", "model", "data", "calibration") + "/" + checkpoint_id(init_path(cfg, run_dir))
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if summary.get("config_digest") == digest and not force and (summary.get("diagnostics") or not diagnostics):
        return summary
    start = time.perf_counter()
    manifest = read_manifest(run_dir)
    tokens, samples = split_weights(cfg, manifest)
    if cfg.calibration.small_sources == "refuse" and cfg.calibration.method == "pca":
        examples = {name: info["train_examples"] for name, info in active_sources(manifest).items()}
        refuse_small_sources(examples, cfg.calibration.n_per_source)
    if cfg.calibration.method != "pca" and not diagnostics:
        return _split_without_gradients(cfg, tokens, samples, out, digest, start)
    estimator = _Estimator(cfg, run_dir)
    train = load_split(cfg, run_dir, "train")
    sample, notes = calibration_sample(train, cfg.calibration.n_per_source, cfg.run.seed)
    for note in notes:
        print(f"calibrate: {note}")
    grads = estimator.gradients(sample)
    grads.notes = notes
    grads.save(out)
    conflicts, plan = estimator.split(grads, tokens, samples)
    plan.save(out / "split.json")
    write_json_atomic(out / "conflicts.json", {"sources": grads.sources, "cosine": conflicts.tolist()})
    plots = [
        plot_conflicts(conflicts, grads.sources, plan, out / "conflicts.png"),
        plot_axes(conflicts, grads.sources, plan, out / "axes.png"),
        plot_explained_variance(conflicts, plan, out / "explained_variance.png"),
    ]
    summary = {
        "config_digest": digest,
        "groups": plan.groups,
        "tokens": plan.tokens,
        "explained_variance": plan.explained_variance,
        "gradient_seconds": round(grads.seconds, 3),
        "total_seconds": round(time.perf_counter() - start, 3),
        "parameters": grads.parameters,
        "dim": int(grads.matrix.shape[1]),
        "sketch": grads.sketch,
        "devices": estimator.devices,
        "notes": notes,
        "plots": [str(p.relative_to(run_dir)) for p in plots],
    }
    if diagnostics:
        summary["diagnostics"] = run_diagnostics(cfg, estimator, train, (tokens, samples), plan, out)
    write_json_atomic(summary_path, summary)
    return summary


def split_weights(cfg: RunConfig, manifest: dict[str, Any]) -> tuple[dict[str, int], dict[str, int] | None]:
    """Each fine-tuning source's training tokens, and its training examples when the split
    balances samples (``calibration.balance``)."""
    sources = active_sources(manifest)
    tokens = {name: info["train_tokens"] for name, info in sources.items()}
    samples = {name: info["train_examples"] for name, info in sources.items()}
    return tokens, samples if cfg.calibration.balance == "samples" else None


def _split_without_gradients(
    cfg: RunConfig, tokens: dict[str, int], samples: dict[str, int] | None, out: Path, digest: str, start: float
) -> dict[str, Any]:
    """The random (Random-K control) and given splits need no gradients: at 7B that saves the
    calibration's model load and passes, which a control would only repeat."""
    c = cfg.calibration
    plan = plan_split(list(tokens), tokens, c.r, c.method, None, cfg.run.seed, c.groups, c.pca, samples)
    plan.save(out / "split.json")
    summary = {
        "config_digest": digest,
        "groups": plan.groups,
        "tokens": plan.tokens,
        "explained_variance": plan.explained_variance,
        "total_seconds": round(time.perf_counter() - start, 3),
        "notes": [f"{c.method} split: no gradients estimated"],
        "plots": [],
    }
    write_json_atomic(out / "summary.json", summary)
    return summary


def run_diagnostics(
    cfg: RunConfig,
    estimator: _Estimator,
    train: dict[str, list[Example]],
    weights: tuple[dict[str, int], dict[str, int] | None],
    plan: SplitPlan,
    out: Path,
) -> dict[str, Any]:
    """Split stability under bootstrap resampling of the calibration examples (mean adjusted
    Rand index against the main split) and the cosine of the n-sample mean gradient to a
    ``reference_n``-sample one, for n = 8, 16, … up to ``n_per_source``."""
    c, seed = cfg.calibration, cfg.run.seed
    main = plan.group_of()
    aris = []
    for b in range(c.resamples):
        rng = random.Random(f"{seed}/bootstrap/{b}")
        sample = {name: rng.choices(items, k=min(c.n_per_source, len(items))) for name, items in train.items()}
        _, resampled = estimator.split(estimator.gradients(sample, f"stability {b + 1}/{c.resamples}"), *weights)
        other = resampled.group_of()
        aris.append(adjusted_rand_score([main[s] for s in main], [other[s] for s in main]))
    reference, _ = calibration_sample(train, c.reference_n, seed + 1)
    ref = estimator.gradients(reference, "reference").matrix
    grid = sorted({n for n in (8, 16, 32, 64, 128, 256, 512) if n < c.n_per_source} | {c.n_per_source})
    curve = {}
    for n in grid:
        sample, _ = calibration_sample(train, n, seed + 2)
        g = estimator.gradients(sample, f"n={n}").matrix
        curve[n] = float(torch.nn.functional.cosine_similarity(g, ref, dim=1).mean())
    plot_accuracy_curve(curve, c.reference_n, out / "accuracy_vs_n.png")
    return {
        "stability_ari": aris,
        "mean_ari": sum(aris) / len(aris),
        "cosine_vs_n": curve,
        "reference_n": c.reference_n,
    }
