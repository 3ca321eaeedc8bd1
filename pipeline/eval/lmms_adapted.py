"""lmms-eval's own Qwen models reading this project's checkpoints. Everything else (prompts,
generation, batching) is lmms-eval's.

- ``merit_qwen2_5_vl``: lmms-eval's ``qwen2_5_vl`` over θ0 (``pretrained``) with a LoRA adapter
  (``adapter``) merged in (θ0 + ΔW, PEFT's merge).
- ``merit_qwen3_vl``: lmms-eval's ``qwen3_vl`` (Qwen3-VL and Qwen3.5, dense and MoE), optionally with
  an adapter. lmms-eval picks the MoE class only when the path names a size like ``A3B`` and loads
  in bfloat16 whatever the checkpoint: a run's folders name no size, so a MoE checkpoint would load
  into the dense class with its experts left random. Here the class is the one ``config.json``
  names (``AutoModelForImageTextToText``) and the dtype the run's ``model.dtype``.
"""

from __future__ import annotations

from typing import Any

import lmms_eval.models.simple.qwen3_vl as lmms_qwen3_vl
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

    def from_pretrained(self, path: str, dtype: Any = None, **kwargs: Any) -> Any:
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
