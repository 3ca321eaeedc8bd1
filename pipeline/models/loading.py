"""Load a checkpoint of any supported family (hub id or local folder) the same way, and freeze parts of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from pipeline.checkpoint import MANIFEST, verify_checkpoint
from pipeline.config import FreezeSection, ModelSection
from pipeline.models.adapter import adapter_base, is_adapter, merge_adapter
from pipeline.models.families import get_family
from pipeline.models.families.shapes import pixel_bounds
from pipeline.threads import fit_threads_to_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def model_config(name_or_path: str | Path, model_cfg: ModelSection) -> Any:
    """The checkpoint's transformers config (an adapter's: its θ0's)."""
    model = adapter_base(name_or_path) if is_adapter(name_or_path) else name_or_path
    return AutoConfig.from_pretrained(str(model), trust_remote_code=model_cfg.trust_remote_code)


def load_processor(name_or_path: str | Path, model_cfg: ModelSection) -> Any:
    """The checkpoint's processor; a Qwen family's images sized within ``model.min_pixels`` and
    ``max_pixels``, a tiling family's (InternVL) as its own processor config says."""
    model_type = model_config(name_or_path, model_cfg).model_type
    size = {"size": pixel_bounds(model_cfg)} if get_family(model_type, str(name_or_path)).pixel_bounds else {}
    return AutoProcessor.from_pretrained(str(name_or_path), trust_remote_code=model_cfg.trust_remote_code, **size)


def checkpoint_dtype(model_cfg: ModelSection, path: str | Path) -> torch.dtype:
    """The dtype a model is loaded in: ``model.dtype``, or for ``auto`` the one its config names."""
    if model_cfg.dtype != "auto":
        return DTYPES[model_cfg.dtype]
    if is_adapter(path):
        return checkpoint_dtype(model_cfg, adapter_base(path))
    config = json.loads((Path(path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return DTYPES.get(name or "float32", torch.float32)


def load_model(name_or_path: str | Path, model_cfg: ModelSection, attn_implementation: str | None = None) -> Any:
    """``AutoModelForImageTextToText`` with the config's dtype and attention implementation (or
    ``attn_implementation``: a branch's packed attention); a small model runs this thread
    single-threaded (``pipeline.threads.fit_threads_to_model``).

    A local folder written by this project carries a manifest: it is verified first, so a
    corrupt or half-copied checkpoint fails here with the file named, not deep in a forward. A
    LoRA branch's adapter folder loads as its θ0 with the adapter merged in (θ0 + ΔW).
    """
    if (Path(name_or_path) / MANIFEST).is_file():
        verify_checkpoint(name_or_path)
    adapter = name_or_path if is_adapter(name_or_path) else None
    model = AutoModelForImageTextToText.from_pretrained(
        adapter_base(adapter) if adapter else str(name_or_path),
        dtype=DTYPES[model_cfg.dtype],
        attn_implementation=attn_implementation or model_cfg.attn_implementation,
        trust_remote_code=model_cfg.trust_remote_code,
        use_kernels=model_cfg.use_kernels,
    )
    if adapter:
        model = merge_adapter(model, adapter)
    apply_freeze(model, model_cfg.freeze)
    fit_threads_to_model(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))  # ZeRO-3: partitioned
    return model


def parameter_groups(model: Any) -> dict[str, list[torch.nn.Parameter]]:
    """The model's parts under the names users know, as its family declares them
    (``pipeline.models.families``): vision tower (without the projector), multi-modal projector,
    language model (blocks, embeddings, head; experts and routers included)."""
    family = get_family(model.config.model_type, type(model).__name__)
    params = dict(model.named_parameters(remove_duplicate=False))

    def under(*prefixes: str) -> list[torch.nn.Parameter]:
        chosen = {id(p): p for name, p in params.items() if any(name.startswith(f + ".") for f in prefixes)}
        return list(chosen.values())

    projector = under(*family.projector)
    in_projector = {id(p) for p in projector}
    return {
        "vision_tower": [p for p in under(family.vision) if id(p) not in in_projector],
        "multi_modal_projector": projector,
        "language_model": under(*family.language),
    }


def apply_freeze(model: Any, freeze: FreezeSection) -> None:
    groups = parameter_groups(model)
    for group, frozen in (
        ("vision_tower", freeze.freeze_vision_tower),
        ("multi_modal_projector", freeze.freeze_multi_modal_projector),
        ("language_model", freeze.freeze_language_model),
    ):
        for param in groups[group]:
            param.requires_grad_(not frozen)


def count_parameters(model: Any) -> dict[str, int]:
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights counted once
    return {
        "total": sum(p.numel() for p in unique),
        "trainable": sum(p.numel() for p in unique if p.requires_grad),
    }
