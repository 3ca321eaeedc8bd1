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
