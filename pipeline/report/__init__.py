"""The run report: report.json, report.md and plots gathered from a run directory."""

from pipeline.report.build import build_report, markdown_table

__all__ = ["build_report", "markdown_table"]
