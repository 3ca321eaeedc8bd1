"""What would fail late, checked before anything trains.

A real run spends hours in its branches before it merges, evaluates and reports; a hub id not in
the cache, a data path with a typo, a DeepSpeed key DeepSpeed refuses, a merge on a GPU the
machine does not have, would each surface only then. :func:`check_run` looks at all of them in
seconds and reports every problem at once; the flows call it first, ``merit check`` on its own.
Record-level problems in the data are the prepare stage's (it reads every record, also before
any training).
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from pipeline.config import ConfigError, RunConfig
from pipeline.devices import usable_gpus
from pipeline.layout import base_path, is_tiny
from pipeline.models.kernels import liger_unavailable


class PreflightError(ConfigError):
    """Everything about a run that would fail later, named, one line each."""


def check_run(cfg: RunConfig, run_dir: str | Path, diloco: bool = False) -> dict[str, str]:
    """Raise :class:`PreflightError` listing every problem; return what was checked (a line each).
    ``diloco``: the run is the DiLoCo flow's (its workers' settings are checked too)."""
    checked, problems = {}, []
    checks = [
        ("θ0", _theta0),
        ("data", _data),
        ("deepspeed", _deepspeed),
        ("merges", _merges),
        ("devices", _devices),
    ]
    checks += [("lora", _lora), ("benchmarks", _benchmarks)]
    for name, check in checks + ([("diloco", _diloco)] if diloco else []):
        try:
            checked[name] = check(cfg, run_dir)
        except (ConfigError, OSError, ValueError) as err:
            problems.append(f"{name}: {err}")
    if problems:
        raise PreflightError(f"run {run_dir} would fail:\n  " + "\n  ".join(problems))
    return checked


def _theta0(cfg: RunConfig, run_dir: str | Path) -> str:
    """θ0's family and the layout of its files (``pipeline.merge.layout``), read from its headers and
    config: a fused expert tensor of a shape its family does not load is named here, not at the merge."""
    from pipeline.merge.layout import ModelView
    from pipeline.models.families import family_of_config, tiny_family

    if is_tiny(cfg):
        return f"the tiny offline {tiny_family(cfg.model.name_or_path).model_type}, built by the init stage"
    folder = Path(base_path(cfg, run_dir))  # a hub id this machine lacks fails here, named
    config = json.loads((folder / "config.json").read_text())
    family = family_of_config(config, str(folder / "config.json"))  # every stage reads the model through it
    return f"{folder} ({family.model_type}: {ModelView.open(folder).layout.summary()})"


def _data(cfg: RunConfig, run_dir: str | Path) -> str:
    """Every source entry's files, and every hub entry's subsets in the cache (else its download)."""
    from pipeline.data.hub import check_hub_source

    problems, subsets = [], 0
    for source in cfg.source_entries:
        if source.format == "hub":
            try:
                subsets += check_hub_source(source)
            except ConfigError as err:
                problems.append(str(err))
            continue
        for what, path in (("path", source.path), ("images_dir", source.images_dir)):
            if path is not None and not Path(path).exists():
                problems.append(f"source '{source.name}' {what} {path} does not exist")
    if problems:
        raise ConfigError("; ".join(problems))
    hub = f", {subsets} hub subsets in the cache" if subsets else ""
    return f"{len(cfg.data.sources)} source entries found{hub}"


def _deepspeed(cfg: RunConfig, run_dir: str | Path) -> str:
    """The DeepSpeed config every branch will get, validated by DeepSpeed itself."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from pipeline.models.loading import checkpoint_dtype
    from pipeline.train.engine import deepspeed_config

    t = cfg.train
    if not t.deepspeed_file.is_file():
        raise ConfigError(f"{t.deepspeed_file} not found")
    raw = json.loads(t.deepspeed_file.read_text())
    owned = sorted({"optimizer", "scheduler"} & set(raw))
    if owned:
        raise ConfigError(
            f"{t.deepspeed_file}: {owned} come from the train section (AdamW, warm-up and cosine); remove them"
        )
    try:
        dtype = torch.float32 if is_tiny(cfg) else checkpoint_dtype(cfg.model, base_path(cfg, run_dir))
    except ConfigError:  # θ0 not found: reported by its own check
        dtype = torch.float32
    config = deepspeed_config(t, 1, dtype)  # DeepSpeed checks the batch sizes against 1 rank outside a group
    try:
        DeepSpeedConfig(config)
    except Exception as err:  # DeepSpeed raises pydantic errors, asserts and ValueErrors alike
        why = " ".join(line.strip() for line in str(err).splitlines() if "errors.pydantic.dev" not in line)
        raise ConfigError(f"{t.deepspeed_file}: DeepSpeed refuses it: {why}") from None
    stage, bf16 = config.get("zero_optimization", {}).get("stage", 0), config.get("bf16", {}).get("enabled", False)
    return f"{t.deepspeed_file}: ZeRO {stage}, bf16 {bf16}"


def _merges(cfg: RunConfig, run_dir: str | Path) -> str:
    """Each entry as the merge stage will build it, over K placeholder branches: the merge spec's
    own checks (θ0 for the methods that need it, Fisher inputs, weights) run now."""
    from pipeline.merging import entry_spec, needs_fisher

    k = cfg.branch_count
    branches = [Path(f"branches/{i}/final") for i in range(k)]
    for entry in cfg.merge.methods:
        if entry.merge_method is not None:  # mergekit's terms: checked when the config was read
            if cfg.train.finetuning_type == "lora":
                raise ValueError(f"merge '{entry.name}': mergekit entries merge full checkpoints, not LoRA branches")
            continue
        fishers = [Path(f"branches/{i}/fisher") for i in range(k)] if needs_fisher(entry) else None
        entry_spec(cfg, entry, "θ0", branches, [1] * k, Path(f"merged/{entry.name}"), fishers)
    checked = ", ".join(m.name for m in cfg.merge.methods)
    search = cfg.merge.search
    if not search.enabled:
        return checked
    if search.tasks:
        from pipeline.eval.benchmarks import check_benchmarks, leaves, search_config

        if shared := sorted(leaves(cfg, search.tasks) & leaves(cfg, cfg.eval.benchmarks)):
            raise ValueError(f"merge.search.tasks and eval.benchmarks share the tasks {shared}")
        return f"{checked}; the search of {search.merge} on {check_benchmarks(search_config(cfg))}"
    fractions = [
        cfg.data.heldout_fraction if s.heldout_fraction is None else s.heldout_fraction for s in cfg.data.sources
    ]
    if not any(fractions):
        raise ValueError("merge.search scores its trials on the trained sources' held-out examples, and they have none")
    return f"{checked}; the search of {search.merge} ({search.trials} trials)"


def _devices(cfg: RunConfig, run_dir: str | Path) -> str:
    gpus = torch.cuda.device_count()
    held = cfg.eval.judge.gpus if cfg.eval.judge else []
    if outside := [i for i in held if i >= gpus]:
        raise ConfigError(f"eval.judge.gpus holds {outside}, but this process sees {gpus} GPU(s)")
    wanted = {"merge.device": cfg.merge.device, "eval.device": cfg.eval.device or ""}
    wanted |= {f"calibration.devices[{i}]": d for i, d in enumerate(cfg.calibration.devices or [])}
    for key, device in wanted.items():
        if device.startswith("cuda") and gpus <= (int(device.split(":")[1]) if ":" in device else 0):
            raise ConfigError(f"{key} is {device}, but this machine has {gpus} GPU(s)")
    # Branches on a deployment train on other machines; here they share this one's GPUs.
    here = not cfg.flow.branch_deployment
    usable = len(usable_gpus(cfg))
    if gpus and here and cfg.train.processes > usable:
        raise ConfigError(f"train.processes is {cfg.train.processes}, but this machine has {usable} GPU(s) for it")
    if here and cfg.train.liger_kernel is True and (reason := liger_unavailable()):
        raise ConfigError(f"train.liger_kernel is true, but {reason}")
    attention = cfg.train.packed_attention if cfg.train.packing else None
    if attention == "flash_attention_4" and not find_spec("flash_attn"):
        # transformers would fetch a Hub kernel instead, as the branch starts
        raise ConfigError("train.packed_attention is flash_attention_4, but the flash-attn-4 package is not installed")
    if attention == "flex_attention" and not type(model := _meta_model(cfg, run_dir))._supports_flex_attn:
        raise ConfigError(
            f"train.packed_attention is flex_attention, which transformers does not support for "
            f"{model.config.model_type}: use varlen or sdpa"
        )
    return f"{gpus} GPU(s)" if gpus else "CPU only"


def _meta_model(cfg: RunConfig, run_dir: str | Path) -> Any:
    """θ0's model on the meta device (no weights read), frozen as configured."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from pipeline.models.loading import apply_freeze
    from pipeline.models.tiny import tiny_config

    if is_tiny(cfg):
        config = tiny_config(cfg.model, None)
    else:
        config = AutoConfig.from_pretrained(base_path(cfg, run_dir), trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    apply_freeze(model, cfg.model.freeze)
    return model


def _lora(cfg: RunConfig, run_dir: str | Path) -> str:
    """LoRA's targets against the model's modules (built on the meta device: no weights read)."""
    from pipeline.train.lora import check_additional_targets, lora_parameters, lora_targets

    if "lora" not in {cfg.train.finetuning_type, cfg.warmup.finetuning_type if cfg.warmup.steps else "full"}:
        return "full fine-tuning"
    model = _meta_model(cfg, run_dir)
    targets, experts = lora_targets(model, cfg.train), lora_parameters(model, cfg.train)
    check_additional_targets(model, cfg.train)
    t = cfg.train
    on = f" and {len(experts)} fused expert tensors" if experts else ""
    return f"LoRA rank {t.lora_rank}, alpha {t.lora_scaling * t.lora_rank:g}, on {len(targets)} modules{on}"


def _benchmarks(cfg: RunConfig, run_dir: str | Path) -> str:
    from pipeline.eval.benchmarks import check_benchmarks

    return check_benchmarks(cfg)


def _diloco(cfg: RunConfig, run_dir: str | Path) -> str:
    from pipeline.diloco.plan import check_diloco

    return check_diloco(cfg, len(usable_gpus(cfg)))
