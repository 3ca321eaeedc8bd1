"""Diagnostics of a run's weights, in ``run_dir/eval/diagnostics.json``.

Loss barrier (linear mode connectivity): along θ(α) = (1 − α) θ_i + α θ_j between two branches,
the held-out loss of the trained sources at α = 0, ``eval.barrier_points`` evenly spaced interior
points and 1. A pair's barrier is max over α of L(θ(α)) − [(1 − α) L(θ_i) + α L(θ_j)]: 0 when
the straight line between the branches stays in one basin, as merging by averaging presumes.
Every pair of branches up to K = 4, consecutive pairs (k, k + 1) beyond.

Distance from θ0 of every other model of the run: ‖θ − θ0‖₂ over all parameters, and relative
to ‖θ0‖₂.

Memory at 7B (Qwen2.5-VL-7B: 8.3 B parameters, 16.6 GB in bf16). Barrier: θ(α) on the eval
device, walked along the line in place (16.6 GB), θ_j in CPU memory (16.6 GB) with one of its
tensors copied to the device at a time (at most the 1.1 GB embedding), and the activations of
one evaluation batch; no checkpoint is written. Distance: one tensor of each checkpoint at a time,
read from the memory-mapped safetensors, θ0's in fp32 and the fp32 difference: about 5.5 GB for
the largest (the 152,064 × 3,584 embedding), whatever the model's size.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import checkpoint_id, write_json_atomic
from pipeline.config import RunConfig
from pipeline.devices import eval_device
from pipeline.eval.heldout import Heldout, eval_digest, score_model, source_roles, summarise
from pipeline.layout import DIAGNOSTICS, EVAL, run_models
from pipeline.merge.adapter import EMBEDDING, LM_HEAD, AdapterReader, embeddings_tied
from pipeline.merge.inputs import rows_of
from pipeline.merge.io import MergeInputError
from pipeline.merge.layout import ModelView
from pipeline.models import load_model, load_processor
from pipeline.models.adapter import is_adapter

FIGURES = ("sources", "max_examples_per_source", "barrier_points")  # eval settings that change the barrier
ALL_PAIRS_UP_TO = 4  # branches; beyond, consecutive pairs only (K (K − 1) / 2 lines grow too fast)
BRANCH = "branch-"


def diagnose(cfg: RunConfig, run_dir: str | Path, force: bool = False) -> dict[str, Any]:
    """Write ``run_dir/eval/diagnostics.json`` (the loss barrier between the branches and every
    model's distance from θ0) and return it. Under the same config, what the changed or new models
    do not touch is reused: a merge added to a run costs one distance, not the branches' barrier."""
    run_dir = Path(run_dir)
    path = run_dir / EVAL / DIAGNOSTICS
    models, roles = run_models(cfg, run_dir), source_roles(run_dir)
    identity = {
        "checkpoints": {name: checkpoint_id(folder) for name, folder in models.items()},
        "config_digest": eval_digest(cfg, roles, FIGURES),
    }
    cached = json.loads(path.read_text()) if path.is_file() and not force else {}
    before = cached.get("checkpoints", {}) if cached.get("config_digest") == identity["config_digest"] else {}
    if before == identity["checkpoints"]:
        return cached
    kept = {name for name, found in identity["checkpoints"].items() if before.get(name) == found}
    branches = {int(name.removeprefix(BRANCH)): folder for name, folder in models.items() if name.startswith(BRANCH)}
    named = {f"{BRANCH}{k}" for k in branches}
    if before and named <= kept and named == {name for name in before if name.startswith(BRANCH)}:
        barrier = cached["barrier"]
    else:
        barrier = loss_barrier(cfg, lambda: Heldout.load(cfg, run_dir, roles).trained(), branches)
    distances = {
        name: cached["distance_from_theta0"][name] if {name, "theta0"} <= kept else distance(folder, models["theta0"])
        for name, folder in models.items()
        if name != "theta0"
    }
    result = {"barrier": barrier, "distance_from_theta0": distances} | identity
    write_json_atomic(path, result)
    return result


def loss_barrier(
    cfg: RunConfig, heldout: Heldout | Callable[[], Heldout], branches: dict[int, str]
) -> dict[str, Any] | None:
    """The held-out loss along the line between pairs of branches and its barrier (None with fewer
    than two branches or no interior point). ``heldout`` may be a function that loads it: then the
    data is only read when there is a line to walk."""
    points = cfg.eval.barrier_points
    if len(branches) < 2 or points == 0:
        return None
    heldout = heldout() if callable(heldout) else heldout
    alphas = [k / (points + 1) for k in range(points + 2)]  # 0, the interior points, 1
    ks = sorted(branches)
    pairs = itertools.combinations(ks, 2) if len(ks) <= ALL_PAIRS_UP_TO else itertools.pairwise(ks)
    lines = []
    for i, j in pairs:
        losses = line_losses(cfg, heldout, branches[i], branches[j], alphas)
        barrier = max(loss - ((1 - a) * losses[0] + a * losses[-1]) for a, loss in zip(alphas, losses))
        lines.append({"branches": [i, j], "losses": losses, "barrier": barrier})
    return {"alphas": alphas, "pairs": lines, "barrier": sum(p["barrier"] for p in lines) / len(lines)}


def line_losses(cfg: RunConfig, heldout: Heldout, start: str, end: str, alphas: list[float]) -> list[float]:
    """Held-out loss (token-weighted) of θ(α) = (1 − α) θ_start + α θ_end at increasing ``alphas``."""
    model = load_model(start, cfg.model).to(eval_device(cfg)).eval()
    target = load_model(end, cfg.model)  # stays in CPU memory
    processor = load_processor(start, cfg.model)
    losses, at = [], 0.0
    for alpha in alphas:
        if alpha > at:
            _toward(model, target, (alpha - at) / (1 - at))
            at = alpha
        sources = score_model(cfg, model, processor, heldout, f"α={alpha:.2f}", accuracy=False)
        losses.append(summarise(sources)["loss"])
    return losses


@torch.no_grad()
def _toward(model: Any, target: Any, t: float) -> None:
    """θ ← θ + t (θ_end − θ), parameter by parameter. From θ(a) this is θ(a + t (1 − a)): the line
    is walked in place without keeping θ_start. t = 1 gives θ_end exactly (``lerp``'s end point)."""
    for p, q in zip(model.parameters(), target.parameters()):
        p.lerp_(q.to(p.device), t)


def distance(path: str | Path, base: str | Path) -> dict[str, float]:
    """‖θ − θ0‖₂ over every float tensor and its ratio to ‖θ0‖₂, streamed tensor by tensor (a LoRA
    adapter's ΔW formed from its factors). Both sides are read as the model holds them
    (``pipeline.merge.layout``): a θ0 stored as the hub stores it and a merge written otherwise compare
    expert by expert."""
    origin = ModelView.open(base)
    reader = AdapterReader(path, origin) if is_adapter(path) else ModelView.open(path)
    shapes, base_shapes = _weights(reader), _weights(origin)
    if shapes != base_shapes:
        differ = sorted({name for name, _ in set(shapes.items()) ^ set(base_shapes.items())})
        raise MergeInputError(f"{path}: tensors differ from θ0's ({base}) in names or shapes: {differ[:5]}")
    squared, base_squared = 0.0, 0.0
    for name, shape in shapes.items():
        theta0 = origin.get(name).float()
        x = reader.reader(name)(0, rows_of(shape)[0]).float().reshape(shape)
        squared += float(torch.linalg.vector_norm(x if reader.is_delta(name) else x.sub_(theta0))) ** 2
        base_squared += float(torch.linalg.vector_norm(theta0)) ** 2
    return {"l2": squared**0.5, "relative": (squared / base_squared) ** 0.5}


def _weights(reader: ModelView | AdapterReader) -> dict[str, tuple[int, ...]]:
    """The shapes of the float tensors by key; a tied ``lm_head`` (the embedding again) left out."""
    tied = embeddings_tied(reader.config()) and EMBEDDING in reader.info
    return {
        key: info.shape
        for key, info in reader.info.items()
        if info.dtype.is_floating_point and not (tied and key == LM_HEAD)
    }
