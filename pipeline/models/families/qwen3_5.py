"""Qwen3.5, dense and mixture-of-experts: natively multimodal, Qwen3-VL's vision tower without the
DeepStack mergers, and a language model whose layers alternate linear attention (Gated DeltaNet,
``linear_attn.…``: three of every four layers) with full attention. The MoE model's hub checkpoints
store each layer's experts fused as transformers holds them (``mlp.experts.gate_up_proj`` (experts,
2 × inter, hidden), ``mlp.experts.down_proj``), which ``save_pretrained`` writes one by one
(``mlp.experts.<e>.gate_proj.weight``); a shared expert, and two gates: the router ``mlp.gate.weight``
and the shared expert's ``mlp.shared_expert_gate.weight``. Every official checkpoint also stores a
multi-token-prediction head, ``mtp.*`` (a full-attention decoder layer and the fc joining embedding
and hidden state), which transformers does not load and vLLM reads for speculative decoding.
"""

from __future__ import annotations

from typing import Any

from pipeline.models.families import Experts, Family, register
from pipeline.models.families.qwen3_vl import GROUPS, LM, composite, text_config, tiny_processor, vision_inputs
from pipeline.models.families.qwen3_vl import vision_config as qwen3_vl_vision
from pipeline.models.families.shapes import mrope_sections

ROTARY_SHARE = 0.5  # of each head's dimensions (Qwen3.5: 0.25 of 256; a tiny head of 16 keeps 8)


def dense_text_config(tiny: Any, ids: Any, vocab_size: int) -> dict[str, Any]:
    config = text_config(tiny, ids, vocab_size)
    head_dim = config["head_dim"]
    rotary = int(head_dim * ROTARY_SHARE)
    config["rope_parameters"] = config["rope_parameters"] | {
        "partial_rotary_factor": ROTARY_SHARE,
        "mrope_section": mrope_sections(rotary),
    }
    return config | {
        # Qwen3.5: three linear-attention layers, then one of full attention
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(tiny.num_layers - 1)]
        + ["full_attention"],
        "linear_num_key_heads": tiny.num_kv_heads,
        "linear_num_value_heads": tiny.num_heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
    }


def vision_config(tiny: Any) -> dict[str, Any]:
    config = qwen3_vl_vision(tiny)
    del config["deepstack_visual_indexes"]
    return config


def dense_config(tiny: Any, ids: Any, vocab_size: int) -> Any:
    return composite("Qwen3_5Config", dense_text_config(tiny, ids, vocab_size), vision_config(tiny), ids)


def moe_config(tiny: Any, ids: Any, vocab_size: int) -> Any:
    text = dense_text_config(tiny, ids, vocab_size) | {
        "num_experts": tiny.num_experts,
        "num_experts_per_tok": tiny.experts_per_token,
        "moe_intermediate_size": tiny.moe_intermediate_size,
        "shared_expert_intermediate_size": tiny.moe_intermediate_size,
        "tie_word_embeddings": False,  # as Qwen3.5-35B-A3B and the larger MoE models
    }
    return composite("Qwen3_5MoeConfig", text, vision_config(tiny), ids)


MTP_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


def tiny_mtp(model: Any, seed: int) -> dict[str, Any]:
    """The tiny model's ``mtp.*`` head as the hub's checkpoints store it: one decoder layer shaped as the
    model's last (full-attention) layer, under ``mtp.layers.0.``, its experts fused as the hub fuses
    them, the fc (hidden, 2 × hidden) and three norms; drawn from ``seed``, never trained nor read."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    text = model.config.text_config
    last = f"model.language_model.layers.{text.num_hidden_layers - 1}."
    layer = {name.removeprefix(last): t for name, t in model.state_dict().items() if name.startswith(last)}
    hidden = text.hidden_size
    shapes = {f"mtp.layers.0.{name}": t.shape for name, t in layer.items()} | {"mtp.fc.weight": (hidden, 2 * hidden)}
    mtp = {name: 0.02 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    return mtp | {name: torch.ones(hidden) for name in MTP_NORMS}


VISION = ("model.visual.patch_embed.*", "model.visual.pos_embed.*", "model.visual.blocks.*")
QWEN3_5_GROUPS = GROUPS | {"vision_tower": VISION}
MOE_GROUPS = QWEN3_5_GROUPS | {
    "experts": (f"{LM}.layers.*.mlp.experts.*", f"{LM}.layers.*.mlp.shared_expert.*"),
    "router": (f"{LM}.layers.*.mlp.gate.weight", f"{LM}.layers.*.mlp.shared_expert_gate.weight"),
}
COMMON = {
    "vision": "model.visual",
    "projector": ("model.visual.merger",),
    "language": (LM, "lm_head"),
    "lmms_model": "merit_qwen3_vl",  # lmms-eval's qwen3_vl class reads Qwen3.5 too (see qwen3_vl.py)
    "lmms_adapted": "merit_qwen3_vl",
    "tiny_processor": tiny_processor,
    "chat_template": "qwen_vl_chat_template.jinja",
    "vision_inputs": vision_inputs,
}

MTP = {"unloaded": ("mtp.*",), "tiny_unloaded": tiny_mtp}

QWEN3_5 = register(
    Family(
        model_type="qwen3_5",
        groups=QWEN3_5_GROUPS,
        tiny_config=dense_config,
        rope_index="Qwen3_5Model",
        **MTP,
        **COMMON,
    )
)
QWEN3_5_MOE = register(
    Family(
        model_type="qwen3_5_moe",
        groups=MOE_GROUPS,
        tiny_config=moe_config,
        rope_index="Qwen3_5MoeModel",
        experts=Experts(hub="fused"),
        **MTP,
        **COMMON,
    )
)
