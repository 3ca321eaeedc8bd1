"""Qwen3-VL, dense and mixture-of-experts: stored as the modules are named (``model.language_model.…``,
``model.visual.…``). The vision tower feeds the language model twice: through ``visual.merger`` (the
projector) and through the DeepStack mergers (``visual.deepstack_merger_list``), which add features of
intermediate vision blocks to the first decoder layers; LLaMA-Factory counts the DeepStack mergers as
vision tower, so ``model.freeze`` does too. The MoE model's hub checkpoints store each layer's experts
fused with every expert (in, out): ``mlp.experts.gate_up_proj`` (experts, hidden, 2 × inter) and
``mlp.experts.down_proj`` (experts, inter, hidden), which transformers transposes as it loads them (and
``save_pretrained`` writes as loaded, (out, in)); its router is ``mlp.gate.weight`` (experts, hidden).
The dense 2B and 4B tie the head to the embeddings; the 8B, 32B and the MoE models do not.
"""

from __future__ import annotations

from typing import Any

from pipeline.models.families import Experts, Family, register
from pipeline.models.families.shapes import grid_positions, mrope_sections, pixel_bounds, text_widths, vision_seqlens

PATCH = 16  # pixels per vision patch side (Qwen2.5-VL: 14); 2 × 2 patches make one token


def text_config(tiny: Any, ids: Any, vocab_size: int) -> dict[str, Any]:
    head_dim = tiny.hidden_size // tiny.num_heads
    return text_widths(tiny, vocab_size) | {
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": mrope_sections(head_dim),
            "mrope_interleaved": True,
        },
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
        "tie_word_embeddings": True,  # as Qwen3-VL-2B and 4B (8B and the MoE models are untied)
    }


def moe_text_config(tiny: Any, ids: Any, vocab_size: int) -> dict[str, Any]:
    return text_config(tiny, ids, vocab_size) | {
        "num_experts": tiny.num_experts,
        "num_experts_per_tok": tiny.experts_per_token,
        "moe_intermediate_size": tiny.moe_intermediate_size,
        "decoder_sparse_step": 1,  # every layer a mixture of experts
        "tie_word_embeddings": False,  # as Qwen3-VL-30B-A3B and 235B-A22B
    }


def vision_config(tiny: Any) -> dict[str, Any]:
    return {
        "depth": tiny.vision_depth,
        "hidden_size": tiny.vision_hidden_size,
        "intermediate_size": tiny.vision_intermediate_size,
        "num_heads": tiny.vision_heads,
        "out_hidden_size": tiny.hidden_size,
        "patch_size": PATCH,
        "num_position_embeddings": 64,  # an 8 × 8 grid, interpolated to each image's (Qwen3-VL: 48 × 48)
        # Qwen3-VL-8B takes blocks 8, 16, 24 of 27: here the first and every 8th after it.
        "deepstack_visual_indexes": list(range(0, tiny.vision_depth, 8)),
    }


def special_tokens(ids: Any) -> dict[str, int]:
    names = ("image_token", "video_token", "vision_start_token", "vision_end_token")
    tokens = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    return {f"{name}_id": ids(token) for name, token in zip(names, tokens)}


def composite(config_class: str, text: dict[str, Any], vision: dict[str, Any], ids: Any) -> Any:
    """transformers' ``config_class`` of a Qwen model: its text and vision parts, the head tied as the
    text part says, the vision tokens' ids."""
    import transformers

    config = getattr(transformers, config_class)
    tied = text["tie_word_embeddings"]
    return config(text_config=text, vision_config=vision, tie_word_embeddings=tied, **special_tokens(ids))


def dense_config(tiny: Any, ids: Any, vocab_size: int) -> Any:
    return composite("Qwen3VLConfig", text_config(tiny, ids, vocab_size), vision_config(tiny), ids)


def moe_config(tiny: Any, ids: Any, vocab_size: int) -> Any:
    return composite("Qwen3VLMoeConfig", moe_text_config(tiny, ids, vocab_size), vision_config(tiny), ids)


def tiny_processor(model_cfg: Any, tokenizer: Any, chat_template: str) -> Any:
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # Qwen3-VL's preprocessor_config.json: 16-pixel patches, 2 × 2 merged, mean and std 0.5.
    images = {"patch_size": PATCH, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=pixel_bounds(model_cfg), **images),
        video_processor=Qwen3VLVideoProcessor(size=pixel_bounds(model_cfg), patch_size=PATCH),
        tokenizer=tokenizer,
        chat_template=chat_template,
    )


def vision_inputs(vision: Any, grid: Any) -> dict[str, Any]:
    """Each image's sequence and patch positions (its position-embedding interpolation is
    vectorised in transformers, and left to the step)."""
    return vision_seqlens(grid) | grid_positions(vision, grid)


LM = "model.language_model"
GROUPS = {
    "embeddings": (f"{LM}.embed_tokens.*",),
    "lm_head": ("lm_head.*",),
    "vision_tower": (
        "model.visual.patch_embed.*",
        "model.visual.pos_embed.*",
        "model.visual.blocks.*",
        "model.visual.deepstack_merger_list.*",
    ),
    "merger": ("model.visual.merger.*",),
    "language_blocks": (f"{LM}.layers.*", f"{LM}.norm.*"),
}
MOE_GROUPS = GROUPS | {
    "experts": (f"{LM}.layers.*.mlp.experts.*",),
    "router": (f"{LM}.layers.*.mlp.gate.weight",),
}
COMMON = {
    "vision": "model.visual",
    "projector": ("model.visual.merger",),
    "language": (LM, "lm_head"),
    # lmms-eval's qwen3_vl picks the MoE class only when the path names a size like "A3B": a run's
    # checkpoint folder does not, so this project's class (pipeline.eval.lmms_adapted) reads config.json.
    "lmms_model": "merit_qwen3_vl",
    "lmms_adapted": "merit_qwen3_vl",
    "tiny_processor": tiny_processor,
    # Qwen2.5-VL's template: it opens with "You are a helpful assistant." when a conversation has no
    # system turn, as lmms-eval's qwen3_vl prompts every question (Qwen3-VL's own template adds none):
    # the tiny model's training and benchmark prompts then agree.
    "chat_template": "qwen_vl_chat_template.jinja",
    "vision_inputs": vision_inputs,
}

QWEN3_VL = register(
    Family(model_type="qwen3_vl", groups=GROUPS, tiny_config=dense_config, rope_index="Qwen3VLModel", **COMMON)
)
QWEN3_VL_MOE = register(
    Family(
        model_type="qwen3_vl_moe",
        groups=MOE_GROUPS,
        tiny_config=moe_config,
        rope_index="Qwen3VLMoeModel",
        experts=Experts(hub="fused_in_out", transposed=True, one_by_one=False),
        **COMMON,
    )
)
