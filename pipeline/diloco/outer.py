"""The outer optimizer of DiLoCo: SGD on the aggregated pseudo-gradient, with optional
(Nesterov) momentum, one tensor at a time.

    b ← μ b + g;   u = g + μ b (Nesterov) or u = b;   θ ← θ − η u

g is the round's aggregate of Δ_k = θ − θ_k (DiLoCo, Douillard et al. 2023). With μ = 0 and η = 1 the step
sets θ to the aggregate of the workers' weights (plain averaging). The momentum buffers are
the optimizer's whole state: fp32, one per trained tensor, saved with every round.

A step is a plain step θ ← θ − η g and then the momentum's share, θ ← θ − η μ b (Nesterov,
with b already updated) or θ ← θ − η μ b_old (heavy ball). Asynchronous training applies the
two apart (delayed Nesterov, Liu et al. 2024, arXiv 2401.09135): each worker's payload g_i is a
plain step as it arrives, and every N arrivals the momentum takes their sum Σ g_i, so that N
arrivals of one window move θ exactly as one synchronous step of their aggregate would, and no
single stale payload is amplified by the momentum.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

DILOCO = {"lr": 0.7, "momentum": 0.9}  # Douillard et al. 2023
ISOLOCO = {"lr": 1.8, "momentum": 0.8}  # Horoi et al. 2026, tuned at R = 8, H = 30


class OuterSGD(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    lr: float = Field(DILOCO["lr"], gt=0)  # η
    momentum: float = Field(DILOCO["momentum"], ge=0, lt=1)  # μ
    nesterov: bool = True

    def step(self, theta: torch.Tensor, g: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor | None:
        """Update ``theta`` (fp32) in place with the aggregate ``g``; returns the new momentum
        buffer (``buffer`` updated in place, a new one on the first step, None without momentum)."""
        theta.sub_(g, alpha=self.lr)
        return self.momentum_step(theta, g, buffer)

    def momentum_step(self, theta: torch.Tensor, g: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor | None:
        """The momentum's share of a step whose plain part θ ← θ − η g was taken already (at once,
        or payload by payload as they arrived: ``g`` is then the window's sum); returns the new
        buffer (``buffer`` updated in place, a new one on the first step, None without momentum)."""
        if not self.momentum:
            return None
        if self.nesterov:
            buffer = g.clone() if buffer is None else buffer.mul_(self.momentum).add_(g)
            theta.sub_(buffer, alpha=self.lr * self.momentum)
            return buffer
        if buffer is None:
            return g.clone()
        theta.sub_(buffer, alpha=self.lr * self.momentum)
        return buffer.mul_(self.momentum).add_(g)

    def step_all(
        self, theta: dict[str, torch.Tensor], g: Mapping[str, torch.Tensor], state: dict[str, torch.Tensor]
    ) -> None:
        """One outer step over every tensor of ``g`` (in memory); ``state`` holds the buffers."""
        for name, update in g.items():
            buffer = self.step(theta[name], update.float(), state.get(name))
            if buffer is not None:
                state[name] = buffer
