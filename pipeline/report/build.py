"""The run report: every stage's outputs in a run directory gathered into ``report/report.json``
(machine form, with ready-made tables for the flow's artifacts), ``report/report.md`` and plots.

Three stages, each testable alone: ``collect`` reads the run directory into typed records,
``derive`` computes the report's figures from them (pure functions), ``render`` writes the
PNGs, the markdown and the JSON. It reads only the run directory, so it can be rebuilt after any
stage. Every part but ``config.yaml`` and ``data/manifest.json`` may be missing (no joint
baseline, no merges yet, ...): the report then leaves that section out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.layout import REPORT
from pipeline.report.branches import train_seconds
from pipeline.report.collect import collect, model_kind
from pipeline.report.derive import derive
from pipeline.report.render import PLOT_FILES, markdown_table, render

__all__ = ["PLOT_FILES", "build_report", "markdown_table", "model_kind", "train_seconds"]


def build_report(run_dir: str | Path) -> dict[str, Any]:
    """Gather the run's outputs, write ``report/`` (PNGs, report.md, then report.json) and return the report."""
    return render(derive(collect(run_dir)), Path(run_dir) / REPORT)
