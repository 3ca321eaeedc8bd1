"""``metrics.jsonl``: one line per optimizer step, written by rank 0."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch


class MetricsLog:
    def __init__(self, path: Path, rank: int, resumed_at: int):
        self.path, self.rank = path, rank
        if rank == 0:
            self._truncate(resumed_at)

    def _truncate(self, step: int) -> None:
        """Drop records a killed run wrote after its last checkpoint: the resumed run rewrites them."""
        if self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record | peak_memory()) + "\n")


def peak_memory() -> dict[str, float]:
    """This rank's peak resident memory and, on a GPU, its peak allocated device memory (MB)."""
    peak = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available():
        peak["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return peak
