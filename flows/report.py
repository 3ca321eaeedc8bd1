"""The report task: the library writes ``report/`` (markdown, JSON, PNGs); this publishes it as
Prefect artifacts: the markdown, one table per report table, and links to every plot."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from pipeline.layout import REPORT


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


@task(name="report")
def report(run_dir: str, run_name: str) -> dict[str, Any]:
    from pipeline.report import build_report

    built = build_report(run_dir)
    run = Path(os.path.abspath(run_dir))  # not resolved: a warm-up linked from another run stays under this one
    folder = run / REPORT
    create_markdown_artifact(
        (folder / "report.md").read_text(),
        key=artifact_key(run_name, "report"),
        description=f"MERIT report of {run_dir}",
    )
    for name, table in built["tables"].items():
        rows = [dict(zip(table["headers"], row)) for row in table["rows"]]
        create_table_artifact(rows, key=artifact_key(run_name, name), description=f"{name} of {run_dir}")
    for plot in built["plots"]:  # "heldout_loss.png", "../branches/0/loss.png", ...
        path = Path(os.path.normpath(folder / plot))
        name = str(path.relative_to(run).with_suffix(""))
        create_link_artifact(path.as_uri(), link_text=name, key=artifact_key(run_name, "plot", name))
    return {"report": str(folder / "report.md"), "headline": built.get("headline", {})}
