"""The outer optimizer of DiLoCo: SGD on the aggregated pseudo-gradient, with optional
(Nesterov) momentum, one tensor at a time.

    b ← μ b + g;   u = g + μ b (Nesterov) or u = b;   θ ← θ − η u

g is the round's aggregate of Δ_k = θ − θ_k (DiLoCo, Douillard et al. 2023). With μ = 0 and η = 1 the step
sets θ to the aggregate of the workers' weights (plain averaging). The momentum buffers are
the optimizer's whole state: fp32, one per trained tensor, saved with every round.
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
        if not self.momentum:
            theta.sub_(g, alpha=self.lr)
            return None
        buffer = g.clone() if buffer is None else buffer.mul_(self.momentum).add_(g)
        update = g.add(buffer, alpha=self.momentum) if self.nesterov else buffer
        theta.sub_(update, alpha=self.lr)
        return buffer

    def step_all(
        self, theta: dict[str, torch.Tensor], g: Mapping[str, torch.Tensor], state: dict[str, torch.Tensor]
    ) -> None:
        """One outer step over every tensor of ``g`` (in memory); ``state`` holds the buffers."""
        for name, update in g.items():
            buffer = self.step(theta[name], update.float(), state.get(name))
            if buffer is not None:
                state[name] = buffer
