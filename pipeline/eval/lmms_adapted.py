"""lmms-eval's own Qwen2.5-VL model reading a LoRA adapter of this project: ``pretrained`` is θ0,
``adapter`` the adapter folder, merged into the weights lmms-eval loaded (θ0 + ΔW, PEFT's merge).
Everything else (prompts, generation, batching) is lmms-eval's ``qwen2_5_vl``."""

from lmms_eval.models.chat.qwen2_5_vl import Qwen2_5_VL

from pipeline.models.adapter import merge_adapter


class AdaptedQwen2_5_VL(Qwen2_5_VL):
    def __init__(self, adapter: str, **kwargs):
        super().__init__(**kwargs)
        self._model = merge_adapter(self._model, adapter).eval()
