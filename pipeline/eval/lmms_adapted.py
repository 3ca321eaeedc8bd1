"""lmms-eval's own Qwen models reading this project's checkpoints. Everything else (prompts,
generation, batching) is lmms-eval's.

- ``merit_qwen2_5_vl``: lmms-eval's ``qwen2_5_vl`` over θ0 (``pretrained``) with a LoRA adapter
  (``adapter``) merged in (θ0 + ΔW, PEFT's merge).
- ``merit_qwen3_vl``: lmms-eval's ``qwen3_vl`` (Qwen3-VL and Qwen3.5, dense and MoE), optionally with
  an adapter. lmms-eval picks the MoE class only when the path names a size like ``A3B`` and loads
  in bfloat16 whatever the checkpoint: a run's folders name no size, so a MoE checkpoint would load
  into the dense class with its experts left random. Here the class is the one ``config.json``
  names (``AutoModelForImageTextToText``) and the dtype the run's ``model.dtype``.
- ``merit_internvl``: lmms-eval's ``internvl_hf`` (InternVL3.5 in transformers' format), optionally
  with an adapter, in ``model.dtype``, tiling images as the checkpoint's own processor does (lmms-eval
  asks for 1 to 12 tiles whatever the checkpoint says), and failing where ``internvl_hf`` would turn
  a failed generation into an empty answer that is then scored as a wrong one.
"""

from __future__ import annotations

from typing import Any

import lmms_eval.models.chat.internvl_hf as lmms_internvl
import lmms_eval.models.simple.qwen3_vl as lmms_qwen3_vl
from lmms_eval.models.chat.internvl_hf import InternVLHf
from lmms_eval.models.chat.qwen2_5_vl import Qwen2_5_VL
from lmms_eval.models.chat.qwen3_vl import Qwen3_VL
from transformers import AutoModelForImageTextToText

from pipeline.models.adapter import merge_adapter
from pipeline.models.loading import DTYPES


class AdaptedQwen2_5_VL(Qwen2_5_VL):
    def __init__(self, adapter: str, **kwargs):
        super().__init__(**kwargs)
        self._model = merge_adapter(self._model, adapter).eval()


class _FromConfig:
    """What lmms-eval's ``qwen3_vl`` calls as the model class: the class config.json names, in ``dtype``."""

    def __init__(self, dtype: Any):
        self.dtype = dtype

    def from_pretrained(self, path: str, dtype: Any = None, torch_dtype: Any = None, **kwargs: Any) -> Any:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=self.dtype, **kwargs)


class MeritQwen3_VL(Qwen3_VL):
    def __init__(self, adapter: str | None = None, dtype: str = "auto", **kwargs: Any):
        resolve = lmms_qwen3_vl._resolve_model_class
        lmms_qwen3_vl._resolve_model_class = lambda pretrained, is_moe: (_FromConfig(DTYPES[dtype]), "dtype")
        try:
            super().__init__(**kwargs)
        finally:
            lmms_qwen3_vl._resolve_model_class = resolve
        if adapter:
            self._model = merge_adapter(self._model, adapter).eval()


class GenerationFailed(BaseException):
    """A generation that raised. A BaseException, so that ``internvl_hf``'s ``except Exception``,
    which would answer "" and let the benchmark score it, lets it through: the job fails instead."""


def failing_loudly(generate: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return generate(*args, **kwargs)
        except Exception as err:
            raise GenerationFailed(f"generation failed: {err!r}") from err

    return run


class MeritInternVL(InternVLHf):
    def __init__(
        self,
        adapter: str | None = None,
        dtype: str = "auto",
        min_patches: int | None = None,
        max_patches: int | None = None,
        **kwargs: Any,
    ):
        kwargs.setdefault("device", kwargs.get("device_map") or "cpu")
        model_class = lmms_internvl.InternVLForConditionalGeneration
        lmms_internvl.InternVLForConditionalGeneration = _FromConfig(DTYPES[dtype])
        try:  # None: the tiles the checkpoint's processor asks for
            super().__init__(min_patches=min_patches, max_patches=max_patches, **kwargs)
        finally:
            lmms_internvl.InternVLForConditionalGeneration = model_class
        if adapter:
            self._model = merge_adapter(self._model, adapter).eval()
        self._model.generate = failing_loudly(self._model.generate)
