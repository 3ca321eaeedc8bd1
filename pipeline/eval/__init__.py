"""Evaluation of a run's models (θ0, branches, the joint baseline, merges): held-out loss and
exact-match accuracy by role, and diagnostics of their weights (loss barrier, distance from θ0)."""

from pipeline.eval.diagnostics import diagnose
from pipeline.eval.heldout import evaluate_model, score_heldout

__all__ = ["diagnose", "evaluate_model", "score_heldout"]
