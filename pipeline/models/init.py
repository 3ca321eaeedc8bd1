"""The ``init`` stage: θ0, the shared start every branch trains from.

``model.name_or_path: tiny`` builds the offline model into ``run_dir/init`` (a checkpoint with
a manifest), stored as the hub's checkpoints of its family are (Qwen3-VL-MoE's experts (in, out),
Qwen3.5's ``mtp.*`` head beside the model): the run's source, whose layout every checkpoint the run
writes keeps. Any other value names a Hugging Face id (resolved to its local snapshot) or a local
folder, used in place: nothing is copied. θ0 is this base model, or the result of the joint
warm-up (``pipeline.train.plan``) when ``warmup.steps`` > 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from pipeline.checkpoint import is_complete, read_manifest
from pipeline.config import RunConfig
from pipeline.layout import base_path, is_tiny
from pipeline.models.families import tiny_family
from pipeline.models.loading import count_parameters, load_processor
from pipeline.models.saving import save_as_hub
from pipeline.models.tiny import build_tiny_model, build_tiny_processor


def processor_for(cfg: RunConfig, run_dir: str | Path | None = None) -> Any:
    """The processor of θ0, without building or loading any weights."""
    if not is_tiny(cfg):
        return load_processor(base_path(cfg, run_dir or "."), cfg.model)
    init = Path(base_path(cfg, run_dir)) if run_dir else None
    if init is not None and is_complete(init):
        return load_processor(init, cfg.model)
    return build_tiny_processor(cfg.model, cfg.run.seed)


def init_model(cfg: RunConfig, run_dir: str | Path, force: bool = False) -> dict[str, Any]:
    """Make the base model available (θ0 unless a warm-up follows); returns a small summary
    (path, parameter counts)."""
    path = base_path(cfg, run_dir)
    if is_tiny(cfg):
        digest = cfg.digest("model", "run")
        if force or not (is_complete(path) and read_manifest(path).get("config_digest") == digest):
            model, processor = build_tiny_model(cfg.model, cfg.run.seed)
            params = count_parameters(model)
            unloaded = tiny_family(cfg.model.name_or_path).tiny_unloaded
            carried = unloaded(model, cfg.run.seed) if unloaded else {}
            save_as_hub(
                path,
                model,
                carried,
                processor,
                step=0,
                tokens_seen=0,
                parent=None,
                config_digest=digest,
                parameters=params,
            )
        params = read_manifest(path)["parameters"]
    else:
        # Parameter counts from the config alone: a meta-device model allocates no memory.
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
        params = count_parameters(model)
    return {"path": path, "parameters": params}
