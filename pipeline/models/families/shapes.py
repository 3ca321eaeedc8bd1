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
