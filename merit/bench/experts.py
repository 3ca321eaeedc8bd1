"""``merit bench experts --run-dir DIR``: in a run of a mixture-of-experts model, which experts each
branch moved, and how far the branches' expert updates overlap and agree.

Per layer and expert e, a branch's update is Δ_e = θ_e − θ0_e (θ0: the run's start, the warm-up's
result if it has one); the branch *trained* expert e when ‖Δ_e‖ is at least ``--share`` of the
largest ‖Δ_e‖ of that layer in that branch (an expert the router never sends a token to keeps
θ0's weights; one it rarely picks moves little). For each pair of branches: the Jaccard overlap of
their trained experts, and the mean cosine of their Δ_e over experts both trained (below 0: they
pull the same expert different ways; the merge then cancels, as anywhere in the model)."""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch

from pipeline.layout import init_path, run_config
from pipeline.merge.layout import ONE_EXPERT, ModelView
from pipeline.merging import branch_finals


def expert_updates(theta0: ModelView, branch: ModelView) -> dict[tuple[str, int], torch.Tensor]:
    """(layer, expert) → the branch's update of that expert's matrices, flattened (each expert's matrix is
    a piece of its own however the checkpoints store the experts: ``pipeline.merge.layout``)."""
    parts: dict[tuple[str, int], list[torch.Tensor]] = {}
    for key in theta0.info:
        if match := ONE_EXPERT.match(key):
            delta = (branch.get(key).float() - theta0.get(key).float()).flatten()
            parts.setdefault((match["prefix"].removesuffix(".mlp.experts"), int(match["e"])), []).append(delta)
    return {key: torch.cat(rows) for key, rows in parts.items()}


def trained(updates: dict[tuple[str, int], torch.Tensor], share: float) -> set[tuple[str, int]]:
    norms = {key: float(d.norm()) for key, d in updates.items()}
    largest: dict[str, float] = {}
    for (layer, _), norm in norms.items():
        largest[layer] = max(largest.get(layer, 0.0), norm)
    return {key for key, norm in norms.items() if largest[key[0]] > 0 and norm >= share * largest[key[0]]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", required=True, type=Path, help="a run whose branches have trained")
    parser.add_argument("--share", type=float, default=0.1, help="of a layer's largest expert update (default 0.1)")


def main(args: argparse.Namespace) -> None:
    cfg = run_config(None, [], str(args.run_dir))[0]
    start = ModelView.open(init_path(cfg, args.run_dir))
    branches = [expert_updates(start, ModelView.open(p)) for p in branch_finals(args.run_dir)]
    if not branches[0]:
        raise SystemExit(f"{args.run_dir}: θ0 ({start.path}) has no expert tensors: not a mixture of experts")
    sets = [trained(b, args.share) for b in branches]
    total = len(branches[0])
    layers = len({layer for layer, _ in branches[0]})
    print(f"{total} experts in {layers} layers; trained: at least {args.share:g} of the layer's largest update")
    for k, chosen in enumerate(sets):
        print(f"branch {k}: trained {len(chosen)} of {total} ({100 * len(chosen) / total:.0f} %)")
    for a, b in itertools.combinations(range(len(branches)), 2):
        both, either = sets[a] & sets[b], sets[a] | sets[b]
        cosines = [float(torch.nn.functional.cosine_similarity(branches[a][k], branches[b][k], dim=0)) for k in both]
        agree = f"mean cosine of their updates {statistics.mean(cosines):+.3f}" if cosines else "no expert in common"
        print(
            f"branches {a} and {b}: {len(both)} trained by both of {len(either)} by either "
            f"(overlap {len(both) / max(len(either), 1):.2f}); {agree}"
        )
