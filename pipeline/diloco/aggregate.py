"""The outer step in memory: one synchronous round (the workers' pseudo-gradients, compressed as
they would be sent, aggregated by the merge library's per-tensor methods, then the outer step),
or asynchronous arrivals one at a time (``AsyncOuter``: delayed Nesterov).

The same functions as the run-directory rounds (:mod:`pipeline.diloco.rounds`), for benchmarks
and notebooks where the workers live in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
    return aggregate_deltas(theta, deltas, weights, rules, outer, momentum, sent, seed)


def aggregate_deltas(
    theta: dict[str, torch.Tensor],
    deltas: Sequence[dict[str, torch.Tensor]],
    weights: Sequence[float],
    rules: list[Rule],
    outer: OuterSGD,
    momentum: dict[str, torch.Tensor],
    sent: int,
    seed: int = 0,
) -> RoundStats:
    """Step ``theta`` (in place) from the workers' pseudo-gradients Δ_k = θ − θ_k as received
    (``sent``: their bytes), of the tensors they trained (a LoRA worker's: −(alpha / r)·B A of its
    adapted tensors); the others stay as they are."""
    meter = DriftMeter(len(deltas))
    for name in deltas[0]:
        meter.add([d[name] for d in deltas])
    outer.step_all(theta, merge_state_dicts(deltas, weights, rules, seed=seed), momentum)
    return RoundStats(sent, meter.norms(), meter.mean_cosine())


def arrival_weight(tokens: float, count: int, tokens_seen: float, window: int) -> float:
    """An asynchronous payload's weight: its tokens over ``window`` times the mean tokens of the
    ``count`` payloads applied so far (this one included, ``tokens_seen`` in all). A window of
    payloads of equal tokens weighs 1 in all, as a synchronous round's weights do; with dynamic
    local steps a slow worker's shorter payload weighs less, by the tokens it trained on. Every
    payload counted as 1 token (``weighting: equal``), each weighs 1 / ``window``."""
    return tokens * count / (window * tokens_seen)


class AsyncOuter:
    """Asynchronous outer optimisation of ``theta`` (fp32, in place): each worker's Δ_i, taken
    from whatever global it started from, is applied when it arrives (θ ← θ − η w_i Δ_i), and the
    momentum takes the sum of every ``window`` arrivals (delayed Nesterov, ``OuterSGD``'s
    ``momentum_step``). w_i is 1 / ``window`` (``weighting`` equal, Liu et al.'s) or by the
    payload's tokens (``arrival_weight``). With ``window`` = R and the R payloads of a round
    arriving in turn from the same global, R arrivals give one synchronous round of weighted
    averaging, up to rounding (the same sum, added in another order)."""

    def __init__(
        self,
        theta: dict[str, torch.Tensor],
        outer: OuterSGD,
        window: int,
        weighting: Literal["tokens", "equal"] = "equal",
    ):
        self.theta, self.outer, self.window, self.weighting = theta, outer, window, weighting
        self.momentum: dict[str, torch.Tensor] = {}
        self.pending: dict[str, torch.Tensor] = {}  # Σ w_i Δ_i of the open window
        self.count, self.tokens_seen = 0, 0.0

    def apply(self, delta: dict[str, torch.Tensor], tokens: float) -> float:
        """Apply one arrival, of a payload trained on ``tokens``; returns its weight."""
        tokens = tokens if self.weighting == "tokens" else 1.0
        self.count, self.tokens_seen = self.count + 1, self.tokens_seen + tokens
        weight = arrival_weight(tokens, self.count, self.tokens_seen, self.window)
        for name, d in delta.items():
            g = d.float() * weight
            self.theta[name].sub_(g, alpha=self.outer.lr)
            self.pending[name] = self.pending[name].add_(g) if name in self.pending else g
        if self.count % self.window == 0:
            for name, g in self.pending.items():
                buffer = self.outer.momentum_step(self.theta[name], g, self.momentum.get(name))
                if buffer is not None:
                    self.momentum[name] = buffer
            self.pending = {}
        return weight
