"""``metrics.jsonl``: one line per optimizer step, written by rank 0, with rank 0's peak memory;
the same steps as TensorBoard scalars (``pipeline.tensorboard``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipeline.memory import AnonymousPeak, max_rss
from pipeline.tensorboard import log_step, step_writer


class MetricsLog:
    def __init__(self, path: Path, rank: int, resumed_at: int):
        self.path, self.rank = path, rank
        self.memory = AnonymousPeak(interval=0.05)
        self.board = None
        if rank == 0:
            self._truncate(resumed_at)
            self.memory.start()  # a daemon thread: it samples until the rank exits
            self.board = step_writer(path.parent, resumed_at)

    def _truncate(self, step: int) -> None:
        """Drop records a killed run wrote after its last checkpoint: the resumed run rewrites them."""
        if self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record | self.peaks()) + "\n")
            log_step(self.board, record)

    def flush(self) -> None:
        """Event files up to date (at each checkpoint: what a kill loses is re-logged on resume)."""
        if self.board is not None:
            self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

    def peaks(self) -> dict[str, float]:
        """Peak anonymous and total resident memory of this rank so far, and on a GPU its peak
        allocated device memory (MB)."""
        peaks = {"peak_anon_mb": round(self.memory.peak / 2**20, 1), "peak_rss_mb": round(max_rss() / 2**20, 1)}
        if torch.cuda.is_available():
            peaks["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return peaks
