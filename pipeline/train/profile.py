"""Where a branch's step time goes: ``train.profile_steps`` steps recorded by ``torch.profiler`` on
rank 0, after the first ``AFTER`` (allocation and start-up), summarised into ``profile.md`` and
``profile.json`` beside ``metrics.jsonl``: the kernels (CUDA) or operators (CPU) that took the most
device time, and the share of matrix multiplications in it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

AFTER = 3  # steps before the recording starts
TOP = 20  # kernels listed
# Kernel and operator names of matrix multiplications: cuBLAS / CUTLASS GEMMs on a GPU, aten's on the CPU.
MATMUL = ("gemm", "matmul", "cutlass", "xmma", "wgmma", "aten::mm", "aten::addmm", "aten::bmm", "_grouped_mm")


class StepProfiler:
    """Records steps ``AFTER`` … ``AFTER + steps - 1`` (0-based) of a run started at ``first``."""

    def __init__(self, out_dir: str | Path, steps: int, first: int):
        self.out, self.start, self.stop = Path(out_dir), AFTER, AFTER + steps
        self.cuda = torch.cuda.is_available()
        self.active: Any = None
        if first > AFTER:  # a resumed run: profile its first steps after the warm-up instead
            self.start, self.stop = first + AFTER, first + AFTER + steps

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run ``step`` inside: the first recorded step starts the profiler, the last writes it."""
        if step == self.start < self.stop:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.active = profile(activities=activities)
            self.active.__enter__()
        yield
        if self.active is not None:
            self.active.step()
            if step + 1 == self.stop:
                self._finish()

    def _finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.active.__exit__(None, None, None)
        summary = summarise(self.active.key_averages(), self.cuda, self.stop - self.start)
        self.active = None
        (self.out / "profile.json").write_text(json.dumps(summary, indent=1) + "\n")
        (self.out / "profile.md").write_text(as_markdown(summary))


def summarise(averages: Any, cuda: bool, steps: int) -> dict[str, Any]:
    """The top kernels by self device time (CPU: self CPU time of operators), and the matmul share."""

    def self_us(event: Any) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    events = [e for e in averages if self_us(e) > 0 and (not cuda or e.device_type.name == "CUDA")]
    total = sum(self_us(e) for e in events)
    matmul = sum(self_us(e) for e in events if any(m in e.key.lower() for m in MATMUL))
    top = sorted(events, key=self_us, reverse=True)[:TOP]
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "steps": steps,
        "device_ms_per_step": round(total / 1e3 / steps, 2),
        "matmul_share": round(matmul / total, 4) if total else None,
        "top": [
            {
                "name": e.key,
                "calls": e.count,
                "ms_per_step": round(self_us(e) / 1e3 / steps, 3),
                "share": self_us(e) / total,
            }
            for e in top
        ],
    }


def as_markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# Profile: {summary['steps']} steps on {summary['device']}",
        "",
        f"{summary['device_ms_per_step']} ms of {'operator' if summary['device'] == 'cpu' else 'kernel'} time a step, "
        "matrix multiplications "
        f"{100 * (summary['matmul_share'] or 0):.1f} % of it.",
        "",
        "| kernel | calls | ms a step | share |",
        "| --- | --- | --- | --- |",
    ]
    for k in summary["top"]:
        name = k["name"].replace("|", "\\|")[:120]
        lines.append(f"| `{name}` | {k['calls']} | {k['ms_per_step']:.3f} | {100 * k['share']:.1f} % |")
    return "\n".join(lines) + "\n"
