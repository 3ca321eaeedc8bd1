"""LoRA branches through PEFT: the modules a branch adapts, the PEFT model over them, and the
weights it saves.

``train.lora_target: all`` resolves as LLaMA-Factory resolves it for Qwen2.5-VL
(``find_all_linear_modules``, then ``patch_target_modules``): every linear layer of the parts that
train (``model.freeze``: the vision blocks only when the vision tower trains), never ``lm_head``,
never the projector (``visual.merger``), whatever its freeze says, and never a mixture of experts'
routing gates. Fused expert tensors (Qwen3-VL-MoE's ``mlp.experts.gate_up_proj``) are parameters,
not linear layers: ``all`` leaves them to full fine-tuning. Names adapt the trainable
linear layers whose path ends with one of them (PEFT's rule; LLaMA-Factory's substring match picks
the same modules for whole names such as ``q_proj`` or ``mlp.0``), ``lm_head`` included when named.
The adapter's base is θ0, never changed: ΔW = (alpha / rank) · B A per adapted module, which is
what the merge library combines.
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from pipeline.config import TrainSection
from pipeline.models.families import get_family
from pipeline.models.loading import parameter_groups


def _matches(module: str, name: str) -> bool:
    """PEFT's rule for a target name: the module's path, or the path's last dotted parts."""
    return module == name or module.endswith("." + name)


def _projector(model: torch.nn.Module, linears: dict[str, torch.nn.Linear]) -> set[str]:
    """The projector's linear layers: the parameters ``model.freeze`` calls the projector."""
    projector = {id(p) for p in parameter_groups(model)["multi_modal_projector"]}
    return {name for name, m in linears.items() if id(m.weight) in projector}


def _routers(model: torch.nn.Module, linears: dict[str, torch.nn.Linear]) -> set[str]:
    """A mixture of experts' routing gates that are linear layers (Qwen3.5-MoE's shared-expert gate,
    one row): a low-rank update of a gate is the gate's own size, and its scores are what the experts
    are trained to compete on."""
    family = get_family(model.config.model_type)
    return {name for name in linears if family.is_router(f"{name}.weight")}


def _check_head_not_tied(model: torch.nn.Module, chosen: list[str]) -> None:
    # A head tied to the embeddings is one matrix: merging the head's ΔW (PEFT's merge_and_unload)
    # would change the input embeddings too, which the adapter never trained as.
    if "lm_head" in chosen and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        raise ValueError(
            "train.lora_target lm_head: this model's head is its input embedding matrix (tie_word_embeddings); "
            "leave lm_head out"
        )


def lora_targets(model: torch.nn.Module, t: TrainSection) -> list[str]:
    """The paths of the linear modules LoRA adapts (an error names targets that match nothing)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    trainable = {name for name, m in linears.items() if m.weight.requires_grad}
    if t.lora_target == "all":
        chosen = sorted(trainable - {"lm_head"} - _projector(model, linears) - _routers(model, linears))
    else:
        unknown = [x for x in t.lora_target if not any(_matches(n, x) for n in linears)]
        if unknown:
            names = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ValueError(f"train.lora_target {unknown} match no linear module; the model's linear modules: {names}")
        chosen = sorted(n for n in trainable if any(_matches(n, x) for x in t.lora_target))
        _check_head_not_tied(model, chosen)
    if not chosen:
        raise ValueError(
            f"train.finetuning_type lora: nothing to adapt, lora_target {t.lora_target!r} matches no linear layer "
            "that trains (model.freeze; `all` never takes lm_head or the projector)"
        )
    return chosen


def check_additional_targets(model: torch.nn.Module, t: TrainSection) -> None:
    modules = [name for name, _ in model.named_modules()]
    unknown = [x for x in t.additional_target if not any(_matches(n, x) for n in modules)]
    if unknown:
        raise ValueError(f"train.additional_target {unknown} match no module of the model")


def apply_lora(model: torch.nn.Module, t: TrainSection, base: str) -> PeftModel:
    """The model with LoRA on its targets (PEFT freezes everything else); ``base`` (θ0's path) is
    the adapter's ``base_model_name_or_path``. The HF model inside, ``.base_model.model``, carries
    the LoRA layers in place: that is the module the trainer's loss runs."""
    check_additional_targets(model, t)
    config = LoraConfig(
        r=t.lora_rank,
        lora_alpha=t.lora_scaling * t.lora_rank,
        lora_dropout=t.lora_dropout,
        target_modules=lora_targets(model, t),
        modules_to_save=t.additional_target or None,
        base_model_name_or_path=base,
    )
    peft = get_peft_model(model, config)
    if t.gradient_checkpointing:
        # Frozen embeddings give checkpointed blocks inputs without grad, and no grad would reach
        # the adapters inside them (PEFT's own advice).
        model.enable_input_require_grads()
    return peft


def lora_summary(peft: PeftModel) -> dict[str, Any]:
    """What a LoRA branch trains, for its log and manifest."""
    config = peft.peft_config["default"]
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in peft.parameters() if p.requires_grad)
    # The modules as adapted (PEFT may store a long target list as the shortest suffixes that match it).
    modules = [n.removeprefix("base_model.model.") for n, m in peft.named_modules() if isinstance(m, LoraLayer)]
    return {
        "rank": config.r,
        "alpha": config.lora_alpha,
        "modules": sorted(modules),
        "modules_to_save": sorted(config.modules_to_save or []),
        "trainable_parameters": trainable,
    }


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT model's full state dict (``…q_proj.base_layer.weight``, ``…lora_A.default.weight``)
    as the plain model's, each adapted weight W + scaling · B A: a LoRA warm-up's θ0."""
    out = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            module = name.removesuffix(".base_layer.weight")
            a, b = state[f"{module}.lora_A.default.weight"], state[f"{module}.lora_B.default.weight"]
            delta = (b.float() @ a.float()).mul_(scaling)
            out[f"{module}.weight"] = (tensor.float() + delta).to(tensor.dtype)
        elif ".modules_to_save." in name:
            out[name.replace(".modules_to_save.default.", ".")] = tensor
        elif ".original_module." not in name:
            out[name.replace(".base_layer.", ".")] = tensor
    return out
