"""Evaluation of a run's models (θ0, branches, the joint baseline, merges): held-out loss and
exact-match accuracy by role, diagnostics of their weights (loss barrier, distance from θ0), and
the benchmarks lmms-eval runs. Exports import their submodule on first use: the lmms-eval
process (``pipeline.eval.lmms_run``) needs none of the held-out machinery."""

from pipeline.lazy import lazy_exports

EXPORTS = {"diagnose": "diagnostics", "evaluate_model": "heldout", "score_heldout": "heldout"}
__all__ = sorted(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
