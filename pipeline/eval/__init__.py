"""Held-out evaluation of a run's models (θ0, branches, the joint baseline, merges)."""

from pipeline.eval.heldout import evaluate_model, score_heldout

__all__ = ["evaluate_model", "score_heldout"]
