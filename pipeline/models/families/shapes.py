"""Small pieces every family's tiny model and processor share."""

from __future__ import annotations

from typing import Any


def pixel_bounds(model_cfg: Any) -> dict[str, int]:
    """Image size bounds in the form transformers 5 processors take (area in pixels)."""
    return {"shortest_edge": model_cfg.min_pixels, "longest_edge": model_cfg.max_pixels}


def mrope_sections(rotary_dim: int) -> list[int]:
    """Qwen's 3-D rope splits each head's rotary half into (time, height, width) sections."""
    half = rotary_dim // 2
    sections = [half // 4, (half - half // 4) // 2]
    return [*sections, half - sum(sections)]


def text_widths(tiny: Any, vocab_size: int) -> dict[str, int]:
    """A tiny language model's widths (``model.tiny``), as every Qwen text config names them."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": tiny.hidden_size,
        "intermediate_size": tiny.intermediate_size,
        "num_hidden_layers": tiny.num_layers,
        "num_attention_heads": tiny.num_heads,
        "num_key_value_heads": tiny.num_kv_heads,
    }


def vision_seqlens(grid: Any) -> dict[str, Any]:
    """Each image's patches as one attention sequence (cu_seqlens and the longest), as a Qwen vision
    tower computes them from ``grid_thw``."""
    from transformers.vision_utils import get_vision_cu_seqlens

    cu_seqlens = get_vision_cu_seqlens(grid)
    return {"cu_seqlens": cu_seqlens, "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max())}


def grid_positions(vision: Any, grid: Any) -> dict[str, Any]:
    """The (h, w) positions of every patch, for a Qwen vision tower's rotary embedding."""
    from transformers.vision_utils import get_vision_position_ids

    return {"position_ids": get_vision_position_ids(grid, vision.spatial_merge_size)}
