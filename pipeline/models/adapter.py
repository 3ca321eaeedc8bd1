"""PEFT adapter folders (a LoRA branch's ``final/``) as models: their θ0, checked, and θ0 with
the adapter merged in (PEFT's own merge), for every stage that reads a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.checkpoint import MANIFEST, checkpoint_id, read_manifest
from pipeline.merge.adapter import ADAPTER_CONFIG, AdapterError, read_adapter_config

# An adapter saved under transformers 4 names Qwen2-VL / Qwen2.5-VL's modules as the checkpoint does
# (``model.layers…``, ``visual.…``); PEFT 0.21 does not map them to transformers 5's modules and merges nothing.
KEY_MAPPING = {r"^model\.(?!language_model\.|visual\.)": "model.language_model.", r"^visual\.": "model.visual."}
LEGACY_LAYOUT = {"qwen2_vl", "qwen2_5_vl"}  # the model types whose adapters may be in that layout


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> str:
    """θ0 of an adapter: its ``base_model_name_or_path``, checked against the base identity our
    manifest recorded (a θ0 rebuilt or replaced since would make another model)."""
    base = read_adapter_config(path).get("base_model_name_or_path")
    if not base:
        raise AdapterError(f"{Path(path) / ADAPTER_CONFIG}: no base_model_name_or_path")
    if (Path(path) / MANIFEST).is_file():
        expected = read_manifest(path).get("base_model")
        if expected and checkpoint_id(base) != expected:
            raise AdapterError(f"{path}: trained on a θ0 with identity {expected}, but {base} is {checkpoint_id(base)}")
    return base


def merge_adapter(model: Any, path: str | Path) -> Any:
    """``model`` (the adapter's base, loaded) with the adapter merged into its weights by PEFT (DoRA
    included: the result is a whole model), keys saved in the transformers-4 layout mapped to its modules."""
    from peft import PeftModel

    read_adapter_config(path)
    mapping = KEY_MAPPING if model.config.model_type in LEGACY_LAYOUT else None
    return PeftModel.from_pretrained(model, str(path), key_mapping=mapping).merge_and_unload()
