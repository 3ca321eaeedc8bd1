"""Random Qwen2.5-VL models at real widths, for the benchmarks: θ0 of a run built at the widths of
``model.tiny`` (the tiny model's tokenizer and processor), saved as the run's ``init/``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText

from pipeline.checkpoint import save_pretrained_checkpoint
from pipeline.config import RunConfig
from pipeline.layout import INIT
from pipeline.models import build_tiny_processor, count_parameters
from pipeline.models.loading import DTYPES
from pipeline.models.tiny import tiny_config

# model.tiny settings: Qwen2.5-VL-3B's widths, a medium width a CPU trains in seconds per step, a small one.
SIZES: dict[str, dict[str, int]] = {
    "3b": {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_layers": 36,
        "num_heads": 16,
        "num_kv_heads": 2,
        "vision_depth": 32,
        "vision_hidden_size": 1280,
        "vision_intermediate_size": 3420,
        "vision_heads": 16,
        "vision_window": 112,
        "embedding_rows": 151936,
    },
    "medium": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 2,
        "vision_depth": 8,
        "vision_hidden_size": 256,
        "vision_intermediate_size": 512,
        "vision_heads": 4,
        "vision_window": 112,
        "embedding_rows": 151936,
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vision_depth": 8,
        "vision_hidden_size": 64,
        "vision_intermediate_size": 128,
        "vision_heads": 2,
        "vision_window": 112,
    },
}


def width_overrides(size: str) -> list[str]:
    return [f"model.tiny.{k}={v}" for k, v in SIZES[size].items()]


def build_theta0(cfg: RunConfig, run_dir: str | Path, device: str = "cpu") -> dict[str, Any]:
    """A random model at ``cfg.model.tiny``'s widths in ``cfg.model.dtype``, saved as ``run_dir/init``;
    returns its parameter counts and the seconds it took."""
    processor = build_tiny_processor(cfg.model, cfg.run.seed)
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(tiny_config(cfg.model, processor.tokenizer))
    model.to(DTYPES[cfg.model.dtype])
    counts = count_parameters(model)
    save_pretrained_checkpoint(
        Path(run_dir) / INIT,
        model,
        processor,
        step=0,
        tokens_seen=0,
        parent=None,
        config_digest=cfg.digest("model", "run"),
        parameters=counts,
    )
    vision = sum(p.numel() for p in model.model.visual.parameters())
    return {"total": counts["total"], "vision": vision, "seconds": time.perf_counter() - start}
