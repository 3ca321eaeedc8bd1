"""Branch training with DeepSpeed: one subprocess (a torchrun process group) per branch."""

from pipeline.train.launch import BranchFailed, BranchResult, train_branch
from pipeline.train.spec import BranchSpec

__all__ = ["BranchFailed", "BranchResult", "BranchSpec", "train_branch"]
