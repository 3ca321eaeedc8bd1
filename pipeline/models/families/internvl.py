"""InternVL3.5 in transformers' own format (the ``-HF`` checkpoints, ``InternVLForConditionalGeneration``):
an InternViT vision tower (``model.vision_tower``), a pixel-shuffle MLP projector
(``model.multi_modal_projector``) and a Qwen3 language model (``model.language_model``), stored as the
hub's checkpoints and transformers 5 save them: ``vision_tower.…``, ``multi_modal_projector.…``,
``language_model.model.…`` and ``language_model.lm_head.weight``. An image is
cut into fixed-size tiles (448 px; a thumbnail too when there are several), each tile ``image_seq_length``
tokens of ``<IMG_CONTEXT>`` between ``<img>`` and ``</img>``.

Why this family beyond Qwen: its HF checkpoints load with transformers' own class (no remote code),
lmms-eval runs them (``internvl_hf``), LLaMA-Factory fine-tunes them, and their vision side (tiles, a
pixel-shuffle projector, no 3-D rope) differs from Qwen's in every place a Qwen-only pipeline would
assume otherwise, while the language model is one users already fine-tune.
"""

from __future__ import annotations

from typing import Any

from pipeline.models.families import Experts, Family, register
from pipeline.models.families.shapes import text_widths

PATCH = 14  # pixels per vision patch side
TILE = 4 * PATCH  # a tiny tile: 4 × 4 patches, 2 × 2 tokens after the pixel shuffle (InternVL3.5: 448 px)
DOWNSAMPLE = 0.5  # the pixel shuffle's ratio per side
TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def image_seq_length() -> int:
    return int((TILE // PATCH) ** 2 * DOWNSAMPLE**2)


def tiny_config(tiny: Any, ids: Any, vocab_size: int) -> Any:
    from transformers import InternVLConfig

    text = text_widths(tiny, vocab_size) | {
        "model_type": "qwen3",  # InternVL3.5-1B … 38B (the 30B-A3B: qwen3_moe)
        "head_dim": tiny.hidden_size // tiny.num_heads,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
        "tie_word_embeddings": True,  # as InternVL3.5-1B and 2B
    }
    vision = {
        "hidden_size": tiny.vision_hidden_size,
        "num_hidden_layers": tiny.vision_depth,
        "num_attention_heads": tiny.vision_heads,
        "intermediate_size": tiny.vision_intermediate_size,
        "image_size": [TILE, TILE],
        "patch_size": [PATCH, PATCH],
    }
    return InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids(TOKENS["context_image_token"]),
        image_seq_length=image_seq_length(),
        downsample_ratio=DOWNSAMPLE,
        tie_word_embeddings=True,
    )


def tiny_processor(model_cfg: Any, tokenizer: Any, chat_template: str) -> Any:
    from transformers import InternVLProcessor
    from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    # InternVL3.5's preprocessor_config.json: tiles, ImageNet's mean and std; at most as many tiles
    # as model.max_pixels holds (a thumbnail is added when an image takes several).
    images = {
        "size": {"height": TILE, "width": TILE},
        "crop_to_patches": True,
        "max_patches": max(1, model_cfg.max_pixels // TILE**2),
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
    }
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(**images),
        video_processor=InternVLVideoProcessor(size={"height": TILE, "width": TILE}),
        tokenizer=tokenizer,
        image_seq_length=image_seq_length(),
        chat_template=chat_template,
    )


LM = "language_model.model"  # on disk
INTERNVL = register(
    Family(
        model_type="internvl",
        vision="model.vision_tower",
        projector=("model.multi_modal_projector",),
        language=("model.language_model", "lm_head"),
        groups={
            "embeddings": (f"{LM}.embed_tokens.*",),
            "lm_head": ("language_model.lm_head.*", "lm_head.*"),
            "vision_tower": ("vision_tower.*",),
            "merger": ("multi_modal_projector.*",),
            "language_blocks": (f"{LM}.layers.*", f"{LM}.norm.*"),
            # InternVL3.5-30B-A3B and 241B-A28B: a Qwen3-MoE language model, its experts stored one by one
            "experts": (f"{LM}.layers.*.mlp.experts.*",),
            "router": (f"{LM}.layers.*.mlp.gate.weight",),
        },
        stored_as=(
            ("model.language_model.", "language_model.model."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("lm_head.", "language_model.lm_head."),
        ),
        experts=Experts(hub="per_expert"),
        lmms_model="merit_internvl",
        lmms_adapted="merit_internvl",
        tiny_config=tiny_config,
        tiny_processor=tiny_processor,
        chat_template="internvl_chat_template.jinja",
        special_tokens=TOKENS,
        pixel_bounds=False,
    )
)
