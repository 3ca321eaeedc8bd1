"""One outer round in memory: the workers' pseudo-gradients, compressed as they would be sent,
aggregated by the merge library's per-tensor methods, then the outer step.

The same functions as the run-directory rounds (:mod:`pipeline.diloco.rounds`), for benchmarks
and notebooks where the workers live in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.diloco.compress import Compression, compress_with_feedback, decompress, payload_bytes
from pipeline.diloco.drift import DriftMeter
from pipeline.diloco.outer import OuterSGD
from pipeline.merge import Rule, merge_state_dicts


@dataclass
class RoundStats:
    bytes_sent: int  # by all workers, as compressed
    norms: list[float]  # ‖Δ_k‖ per worker
    mean_cosine: float | None


def aggregate(
    theta: dict[str, torch.Tensor],
    workers: Sequence[dict[str, torch.Tensor]],
    weights: Sequence[float],
    rules: list[Rule],
    outer: OuterSGD,
    momentum: dict[str, torch.Tensor],
    compression: Compression = "none",
    residuals: list[dict[str, torch.Tensor]] | None = None,
    seed: int = 0,
) -> RoundStats:
    """Step the global ``theta`` (fp32, in place) from the workers' weights θ_k after their inner
    steps. ``momentum`` is the outer state; ``residuals`` (one dict per worker, updated in place)
    turn on error feedback."""
    deltas, sent = [], 0
    for k, weights_k in enumerate(workers):
        delta = {}
        for name, theta_k in weights_k.items():
            residual = residuals[k].setdefault(name, torch.zeros_like(theta[name])) if residuals else None
            payload, residual = compress_with_feedback(name, theta[name] - theta_k.float(), compression, residual)
            if residuals:
                residuals[k][name] = residual
            sent += payload_bytes(payload)
            delta[name] = decompress(payload, name, theta_k.shape)
        deltas.append(delta)
    meter = DriftMeter(len(deltas))
    for name in deltas[0]:
        meter.add([d[name] for d in deltas])
    outer.step_all(theta, merge_state_dicts(deltas, weights, rules, seed=seed), momentum)
    return RoundStats(sent, meter.norms(), meter.mean_cosine())
