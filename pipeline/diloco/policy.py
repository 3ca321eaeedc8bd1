"""What decides a DiLoCo run's globals, whatever carries the payloads: which payloads a round takes
(``sync``: every worker's; ``quorum``: the first Q), when a worker's payload is late (its round went
on without it: the payload is dropped and the worker joins the newest global), the weights of a
round's payloads, and in ``async`` mode each worker's local steps (an arrival's weight is
:func:`pipeline.diloco.aggregate.arrival_weight`).

One rule for the run-directory loop (:mod:`pipeline.diloco.loop`, ``rounds``, ``asynchronous``,
``worker``: the payloads are folders, the clock is real) and for the straggler bench
(``merit bench diloco --slow``: the payloads are messages between processes), so that the bench
measures the library's rounds, not a copy of them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch


def default_weighting(sync: str) -> str:
    """A method's weighting when it names none: by tokens in sync and quorum rounds (MERIT's merge
    weights), every arrival alike in async mode (1 / R each, as Liu et al. 2024)."""
    return "equal" if sync == "async" else "tokens"


@dataclass(frozen=True)
class RoundPolicy:
    size: int  # R
    inner_steps: int  # H
    quorum: int | None = None  # the payloads a round waits for; None: every worker's
    weighting: str | None = "tokens"  # "tokens", or equal weights
    dynamic_steps: bool = True  # async: local steps scaled to each worker's speed

    def round_closes(self, sent: Collection[int], failed: Collection[int]) -> bool:
        """Whether a round may aggregate the payloads of the workers ``sent``: every other worker
        failed for good, or ``quorum`` of them have sent (a round timeout is the caller's clock)."""
        return len({*sent, *failed}) >= self.size or len(sent) >= (self.quorum or self.size)

    def stragglers(self, sent: Collection[int], failed: Collection[int]) -> list[int]:
        """The workers a closed round left out that are still training it: their payloads will be late."""
        return [k for k in range(self.size) if k not in sent and k not in failed]

    @staticmethod
    def closed_to(r: int, k: int, newest: int, members: Collection[int] | None) -> bool:
        """Whether round r has gone on without worker k: the newest global is past it, or its members
        (None while undecided) leave k out. A payload of k's for it is dropped (OpenDiLoCo's rule:
        a late Δ is not applied) and k joins the newest global with its own inner state."""
        return newest > r or (members is not None and k not in members)

    def weights(self, tokens: Sequence[float]) -> torch.Tensor:
        """A round's weights of its payloads, trained on ``tokens`` each: by tokens or equal, summing to 1."""
        raw = [t if self.weighting == "tokens" else 1.0 for t in tokens]
        weights = torch.tensor(raw, dtype=torch.float64)
        return (weights / weights.sum()).float()

    def local_steps(self, speeds: Mapping[int, float], k: int) -> int:
        """Worker k's steps for its next async payload (dynamic local steps, DyLU, Liu et al. 2024):
        H scaled by its speed (steps per second of its latest payload) against the fastest worker's,
        at least 1; H itself before its speed is measured, or with ``dynamic_steps`` off."""
        if not self.dynamic_steps or k not in speeds:
            return self.inner_steps
        return max(1, min(self.inner_steps, round(self.inner_steps * speeds[k] / max(speeds.values()))))
