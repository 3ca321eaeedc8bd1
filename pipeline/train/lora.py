"""LoRA branches through PEFT: the modules a branch adapts, the PEFT model over them, and the
weights it saves.

``train.lora_target: all`` resolves as LLaMA-Factory resolves it for Qwen2.5-VL
(``find_all_linear_modules``, then ``patch_target_modules``): every linear layer of the parts that
train (``model.freeze``: the vision blocks only when the vision tower trains), never ``lm_head``,
never the projector (``visual.merger``), whatever its freeze says, and never a mixture of experts'
routing gates. Fused expert tensors (``mlp.experts.gate_up_proj``, ``down_proj``) are parameters, not
linear layers: ``all`` leaves them frozen, as LLaMA-Factory does; ``train.lora_target_parameters``
adapts them (PEFT's ``target_parameters``: rank r per expert, A (r·E × in), B (out × r·E)). Names adapt the trainable
linear layers whose path ends with one of them (PEFT's rule; LLaMA-Factory's substring match picks
the same modules for whole names such as ``q_proj`` or ``mlp.0``), ``lm_head`` included when named.
The adapter's base is θ0, never changed: ΔW = (alpha / rank) · B A per adapted module, which is
what the merge library combines.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from pipeline.config import TrainSection
from pipeline.merge.layout import FUSED
from pipeline.models.families import get_family
from pipeline.models.loading import parameter_groups

ADAPTER = "default"  # the adapter name PEFT gives the one adapter of a branch


def lora_delta(a: torch.Tensor, b: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """B A in fp32, of a weight of ``shape``: a fused expert tensor (experts, out, in) takes expert e's
    A rows [e·r, (e+1)·r) and B columns e, e + E, … (PEFT's ``ParamWrapper``)."""
    if len(shape) != 3:
        return b.float() @ a.float()
    experts = shape[0]
    a3 = a.float().reshape(experts, -1, a.shape[-1])  # (experts, rank, in)
    b3 = b.float().reshape(b.shape[0], -1, experts)  # (out, rank, experts)
    return torch.einsum("ore,eri->eoi", b3, a3)


def unwrapped(path: str) -> str:
    """A module's path without the ``.base_layer`` steps PEFT's nested wrappers add (``target_parameters``
    on two parameters of one module: a ``ParamWrapper`` in a ``ParamWrapper``)."""
    while path.endswith(".base_layer"):
        path = path.removesuffix(".base_layer")
    return path


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


def lora_parameters(model: torch.nn.Module, t: TrainSection) -> list[str]:
    """The paths of the fused expert tensors LoRA adapts (``train.lora_target_parameters``), trainable ones
    only (an error names targets that match none)."""
    if not t.lora_target_parameters:
        return []
    params = {name: p for name, p in model.named_parameters() if p.dim() == 3 and FUSED.match(name)}
    if t.lora_target_parameters == "experts":
        if not params:
            raise ValueError("train.lora_target_parameters experts: the model has no fused expert tensors")
        chosen = sorted(name for name, p in params.items() if p.requires_grad)
    else:
        unknown = [x for x in t.lora_target_parameters if not any(_matches(n, x) for n in params)]
        if unknown:
            raise ValueError(
                f"train.lora_target_parameters {unknown} match no fused expert tensor; the model's: "
                f"{sorted({n.rsplit('.', 1)[-1] for n in params})}"
            )
        chosen = sorted(
            n for n, p in params.items() if p.requires_grad and any(_matches(n, x) for x in t.lora_target_parameters)
        )
    if not chosen:
        raise ValueError("train.lora_target_parameters: the expert tensors it names do not train (model.freeze)")
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
        target_parameters=lora_parameters(model, t) or None,
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
    # The modules as adapted (PEFT may store a long target list as the shortest suffixes that match it); a
    # fused expert tensor by its parameter's path.
    modules = [
        unwrapped(n.removeprefix("base_model.model."))
        + (f".{m.parameter_name}" if hasattr(m, "parameter_name") else "")
        for n, m in peft.named_modules()
        if isinstance(m, LoraLayer)
    ]
    return {
        "rank": config.r,
        "alpha": config.lora_alpha,
        "modules": sorted(modules),
        "modules_to_save": sorted(config.modules_to_save or []),
        "trainable_parameters": trainable,
    }


def _adapted(path: str, layer: LoraLayer) -> str:
    """What a LoRA layer adapts: its module, or the parameter a ``ParamWrapper`` wraps."""
    parameter = getattr(layer, "parameter_name", None)
    return f"{unwrapped(path)}.{parameter}" if parameter else path


def merged_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A PEFT model's full state dict (``…q_proj.base_layer.weight``, ``…lora_A.default.weight``; a
    fused expert tensor under its wrappers, ``…experts.base_layer.base_layer.gate_up_proj``) as the plain
    model's, each adapted weight W + scaling · B A (per expert for a fused one): a LoRA warm-up's θ0.
    ``model`` is the model carrying the LoRA layers, whose module paths the state's names follow."""
    adapted = {}  # the state's name of an adapted weight -> its LoRA layer's path and the layer
    for path, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            inner, depth = module.base_layer, 1
            while isinstance(inner, LoraLayer):  # nested ParamWrappers: several parameters of one module
                inner, depth = inner.base_layer, depth + 1
            adapted[f"{path}{'.base_layer' * depth}.{getattr(module, 'parameter_name', 'weight')}"] = (path, module)
    out = {}
    for name, tensor in state.items():
        if ".lora_" in name or ".original_module." in name:
            continue
        if name in adapted:
            path, module = adapted[name]
            a, b = state[f"{path}.lora_A.{ADAPTER}.weight"], state[f"{path}.lora_B.{ADAPTER}.weight"]
            delta = lora_delta(a, b, tensor.shape).mul_(float(module.scaling[ADAPTER]))
            tensor = (tensor.float() + delta).to(tensor.dtype)
        out[re.sub(r"(\.base_layer)+\.", ".", name.replace(f".modules_to_save.{ADAPTER}.", "."))] = tensor
    return out
