"""Qwen2.5-VL (the paper's model): stored as transformers 4 wrote it (``model.layers…``, ``visual.…``).

Family modules are declarations: transformers is imported only to build a tiny model."""

from __future__ import annotations

from typing import Any

from pipeline.models.families import Family, register
from pipeline.models.families.shapes import grid_positions, mrope_sections, pixel_bounds, text_widths, vision_seqlens


def tiny_config(tiny: Any, ids: Any, vocab_size: int) -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=text_widths(tiny, vocab_size)
        | {
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": mrope_sections(tiny.hidden_size // tiny.num_heads),
            },
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": tiny.vision_depth,
            "hidden_size": tiny.vision_hidden_size,
            "intermediate_size": tiny.vision_intermediate_size,
            "num_heads": tiny.vision_heads,
            "out_hidden_size": tiny.hidden_size,
            "window_size": tiny.vision_window,
            # Qwen2.5-VL: every 8th block attends to the whole image, the others to windows.
            "fullatt_block_indexes": list(range(7, tiny.vision_depth, 8)) or [tiny.vision_depth - 1],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def tiny_processor(model_cfg: Any, tokenizer: Any, chat_template: str) -> Any:
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=pixel_bounds(model_cfg)),
        video_processor=Qwen2VLVideoProcessor(size=pixel_bounds(model_cfg)),
        tokenizer=tokenizer,
        chat_template=chat_template,
    )


def vision_inputs(vision: Any, grid: Any) -> dict[str, Any]:
    """The windows of the vision tower's windowed blocks (a Python loop over images and windows in
    transformers) beside each image's sequence and patch positions."""
    from transformers.vision_utils import get_vision_window_index

    window_index, cu_window = get_vision_window_index(
        grid, spatial_merge_size=vision.spatial_merge_size, window_size=vision.window_size, patch_size=vision.patch_size
    )
    windows = {
        "window_index": window_index,
        "cu_window_seqlens": cu_window,
        "max_window_seqlen": int((cu_window[1:] - cu_window[:-1]).max()),
    }
    return vision_seqlens(grid) | grid_positions(vision, grid) | windows


QWEN2_5_VL = register(
    Family(
        model_type="qwen2_5_vl",
        vision="model.visual",
        projector=("model.visual.merger",),
        language=("model.language_model", "lm_head"),
        groups={
            "embeddings": ("model.embed_tokens.*",),
            "lm_head": ("lm_head.*",),
            "vision_tower": ("visual.patch_embed.*", "visual.blocks.*"),
            "merger": ("visual.merger.*",),
            "language_blocks": ("model.layers.*", "model.norm.*"),
        },
        stored_as=(("model.language_model.", "model."), ("model.visual.", "visual.")),
        lmms_model="qwen2_5_vl",
        lmms_adapted="merit_qwen2_5_vl",
        tiny_config=tiny_config,
        tiny_processor=tiny_processor,
        chat_template="qwen_vl_chat_template.jinja",
        rope_index="Qwen2_5_VLModel",
        vision_inputs=vision_inputs,
    )
)
