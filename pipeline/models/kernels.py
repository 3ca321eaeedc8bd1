"""Liger's fused Triton kernels (``liger-kernel``, a PyPI package: nothing fetched at run time),
patched into a loaded model by Liger's own function for its family: RMSNorm, SwiGLU and (m)RoPE,
whichever of them Liger enables by default there. Its loss kernels stay off: the trainer's chunked
loss over the supervised tokens (``pipeline.models.loss``) builds no full-vocabulary logits either.

``train.liger_kernel: auto`` patches where it can (a GPU, the package installed, a patch for the
family that imports with this transformers) and says in the branch's log why not otherwise;
``true`` refuses to train without it.
"""

from __future__ import annotations

import inspect
from importlib.util import find_spec
from typing import Any

import torch

# Liger's loss kernels replace the model's forward with one that computes a loss from labels;
# the trainer calls the base model and its own head projection instead.
LOSS_KERNELS = {"cross_entropy": False, "fused_linear_cross_entropy": False}


def use_liger(train: Any, model: Any) -> str:
    """Patch Liger's kernels into ``model`` as ``train.liger_kernel`` asks; returns what was done,
    a line for the branch's log."""
    if train.liger_kernel is False:
        return "off (train.liger_kernel: false)"
    model_type = model.config.model_type
    reason = liger_unavailable(model_type)
    if reason is None:
        try:
            patch(model)
            return f"on (Liger's {model_type} kernels)"
        except ImportError as err:  # raised before anything is patched: the model is as loaded
            reason = f"liger-kernel's patch for {model_type} does not import with this transformers ({err})"
    if train.liger_kernel is True:
        raise ValueError(f"train.liger_kernel is true, but {reason}")
    return f"off ({reason})"


def liger_unavailable(model_type: str | None = None) -> str | None:
    """Why Liger's kernels cannot be patched in here (for ``model_type``, where given), or None."""
    if not torch.cuda.is_available():
        return "there is no GPU: Liger's kernels are Triton GPU kernels"
    if find_spec("liger_kernel") is None:
        return "the liger-kernel package is not installed (pip install liger-kernel)"
    if model_type is not None and model_type not in patches():
        return f"liger-kernel has no kernels for {model_type}"
    return None


def patches() -> dict[str, Any]:
    """Liger's patch function per model type."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def patch(model: Any) -> None:
    """Liger's patch for ``model``'s family, on the instance (its modules, and its family's
    functions in transformers' modeling module: a branch process trains one model)."""
    function = patches()[model.config.model_type]
    accepted = inspect.signature(function).parameters
    function(model=model, **{name: value for name, value in LOSS_KERNELS.items() if name in accepted})
