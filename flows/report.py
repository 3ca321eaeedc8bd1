"""The report task: the library writes ``report/`` (markdown, JSON, PNGs); this publishes it as
Prefect artifacts: the markdown with its plots inline, one table per report table, and one
markdown artifact per plot (``data:`` URIs: the UI is a web page that cannot open the run's files)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from pipeline.layout import REPORT


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


@task(name="report")
def report(run_dir: str, run_name: str) -> dict[str, Any]:
    from pipeline.report import build_report
    from pipeline.report.embed import embed_plots, png_data_uri

    built = build_report(run_dir)
    encoded = functools.cache(png_data_uri)  # each plot encoded once, for the report and its own artifact

    def uri(path: Path) -> str:
        return encoded(Path(os.path.normpath(path)))

    run = Path(os.path.abspath(run_dir))  # not resolved: a warm-up linked from another run stays under this one
    folder = run / REPORT
    create_markdown_artifact(
        embed_plots((folder / "report.md").read_text(), folder, uri),
        key=artifact_key(run_name, "report"),
        description=f"MERIT report of {run_dir}",
    )
    for name, table in built["tables"].items():
        rows = [dict(zip(table["headers"], row)) for row in table["rows"]]
        create_table_artifact(rows, key=artifact_key(run_name, name), description=f"{name} of {run_dir}")
    for plot in built["plots"]:  # "heldout_loss.png", "../branches/0/loss.png", ...
        path = Path(os.path.normpath(folder / plot))
        name = str(path.relative_to(run).with_suffix(""))
        image = uri(path)
        create_markdown_artifact(
            f"![{name}]({image})",
            key=artifact_key(run_name, "plot", name),
            description=f"{name} of {run_dir} ({len(image):,} bytes inline)",
        )
    return {"report": str(folder / "report.md"), "headline": built.get("headline", {})}
