"""LoRA DiLoCo workers (``train.finetuning_type: lora``): each round a fresh adapter on the current
global weights, sent as a PEFT adapter folder (r·(m + n) numbers per adapted m × n tensor instead
of m·n).

A LoRA worker's round:

1. **Base weights from the global.** The frozen weights of the adapted modules
   (``…q_proj.base_layer.weight``; a fused expert tensor adapted through ``target_parameters``) and the
   trained copies of the ``modules_to_save`` tensors (``train.additional_target``; with their fp32
   masters, ``safe_set_full_fp32_param``) are set from the global, read as the model holds them
   (:class:`pipeline.merge.layout.ModelView`). No other tensor ever changes: the global
   differs from θ0 only where an adapter or a saved module trains. With bf16 weights the frozen
   base weights are the global's rounded to bf16 (they have no master copy; the global itself
   stays fp32, and Δ is formed from the adapter, never from the base weights).
2. **A fresh adapter.** Every A is drawn Kaiming-uniform (a = √5) and every B set to 0, as PEFT
   initialises LoRA (so the model starts the round exactly as the global), from a generator
   seeded by (run seed, worker, round): every rank draws the same values, and a worker resumed
   after a kill the same as an undisturbed one. The fp32 masters are set with them.
3. **AdamW moments from zero.** The moments of the factors restart at 0
   (``safe_set_full_optimizer_state``; the optimizer's own state under ZeRO-0): those of the last
   round's adapter belong to directions the new one does not have. Adam's step count is *not*
   reset: under ZeRO-1/2 it is one count per flat parameter group, shared by every tensor of the
   group. Its bias correction 1 − β^t is then ≈ 1, so a fresh adapter's first steps are shorter
   than a fresh optimizer's (one step at large t moves lr·(1 − β1)/√(1 − β2) ≈ 0.45 lr at β (0.9,
   0.95), not lr): the moments grow in over ~1/(1 − β2) = 20 steps, a gentle warm-up each round.
   The ``modules_to_save`` tensors keep their moments, as a dense worker's tensors do, and the lr
   schedule goes on across rounds, as for dense workers.
4. **The payload** after H steps is the adapter, written by PEFT's ``save_pretrained`` (as a LoRA
   branch's ``final/`` is) from the fp32 masters (bf16 with ``diloco.compression: bf16``):
   ``adapter_config.json``, whose ``base_model_name_or_path`` names the global it was trained on,
   and ``adapter_model.safetensors``. The aggregator reads it as Δ_k = θ − θ_k = −(alpha / r)·B_k A_k
   per adapted tensor and θ − θ_k for a tensor saved whole (:mod:`pipeline.diloco.payload`); the
   global and the outer momentum stay dense.

int8 / int4 compression and error feedback are refused for LoRA workers (the config's
validation): a residual of one round's factors means nothing to the next round's fresh adapter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper

from pipeline.merge.adapter import PEFT_PREFIX
from pipeline.merge.layout import ModelView
from pipeline.train.lora import ADAPTER, lora_delta, unwrapped


def round_seed(run_seed: int, worker: int, n: int) -> int:
    """The seed of worker ``worker``'s n-th adapter (its round, or its n-th payload in async)."""
    digest = hashlib.sha256(f"diloco-lora/{run_seed}/{worker}/{n}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class LoraWeights:
    """A LoRA model's tensors as a DiLoCo worker sets and sends them, keyed by the names the model
    holds θ's tensors under (a fused expert tensor whole) or, for what is sent, by PEFT's state-dict
    names."""

    factors: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]  # θ's name -> (A, B)
    whole: dict[str, torch.nn.Parameter]  # θ's name -> the trained copy of a modules_to_save tensor
    base: dict[str, torch.nn.Parameter]  # θ's name -> the adapted parameter (frozen)
    scaling: dict[str, float]  # θ's name -> alpha / r of its module: ΔW = scaling · B A
    trained: dict[str, torch.nn.Parameter]  # PEFT's state-dict name -> parameter, in the model's order

    @classmethod
    def of(cls, model: torch.nn.Module, theta: ModelView) -> LoraWeights:
        """The adapters and saved modules of ``model`` (the model inside a ``PeftModel``, whose
        modules carry the LoRA layers) against θ's tensors."""
        factors, whole, base, scaling = {}, {}, {}, {}
        loaded = theta.loaded()

        def held(tensor: str) -> str:
            name = theta.key(tensor)
            if name not in loaded:
                raise ValueError(f"LoRA worker: the model's {tensor} is not a tensor of the global weights")
            return name

        for path, module in model.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                if ADAPTER in getattr(module, "lora_embedding_A", {}):
                    raise ValueError(f"LoRA worker: {path}: LoRA on embeddings is not supported")
                # A ParamWrapper (target_parameters) adapts one parameter of the module it wraps; nested
                # ones (two parameters of one module) sit at ``….base_layer``.
                parameter = getattr(module, "parameter_name", "weight")
                name = held(f"{unwrapped(path)}.{parameter}")
                factors[name] = (module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight)
                base[name] = getattr(module.get_base_layer(), parameter)
                scaling[name] = float(module.scaling[ADAPTER])
            elif isinstance(module, ModulesToSaveWrapper):
                for tensor, param in module.modules_to_save[ADAPTER].named_parameters():
                    whole[held(f"{path}.{tensor}")] = param
        trained = {PEFT_PREFIX + n: p for n, p in model.named_parameters() if p.requires_grad}
        known = {id(p) for pair in factors.values() for p in pair} | {id(p) for p in whole.values()}
        if unknown := [n for n, p in trained.items() if id(p) not in known]:
            raise ValueError(f"LoRA worker: {unknown[0]} trains, but is neither a LoRA factor nor a saved module")
        return cls(factors, whole, base, scaling, trained)

    def set_base(self, weights: str | Path | Mapping[str, torch.Tensor]) -> None:
        """The base weights and the saved modules (weights and fp32 masters) from a global: a
        checkpoint folder (read as the model holds it), or tensors in memory by the model's names."""
        get = ModelView.open(weights).get_loaded if isinstance(weights, str | Path) else weights.__getitem__
        with torch.no_grad():
            for name, param in self.base.items():
                param.data.copy_(get(name).to(param.device, param.dtype))
            for name, param in self.whole.items():
                set_master(param, get(name).to(param.device, torch.float32))

    def fresh_adapters(self, seed: int, optimizer: Any) -> None:
        """Every adapter re-initialised as PEFT does (A Kaiming-uniform, B = 0) from ``seed``,
        weights and fp32 masters, and its AdamW moments restarted from zero."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name in sorted(self.factors):
                for param, draw in zip(self.factors[name], (True, False)):
                    value = torch.zeros(param.shape, dtype=torch.float32)
                    if draw:
                        torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
                    set_master(param, value.to(param.device))
        restart_moments([p for pair in self.factors.values() for p in pair], optimizer)

    def deltas(self) -> dict[str, torch.Tensor]:
        """Δ = θ − θ_k = −(alpha / r)·B A of every adapted tensor, from the parameters as they are
        (in memory: a worker whose optimizer steps its parameters themselves)."""
        with torch.no_grad():
            return {
                n: lora_delta(a, b, self.base[n].shape).mul_(-self.scaling[n]) for n, (a, b) in self.factors.items()
            }

    def masters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The fp32 master values of what trains, by PEFT's state-dict names. A collective under
        ZeRO-1/2: every rank iterates it whole, in the same order."""
        from pipeline.diloco.weights import master

        for name, param in self.trained.items():
            yield name, master(param)

    def stored_bytes(self) -> int:
        """The fp32 bytes of what trains (the adapter's tensors): what data-parallel LoRA training
        all-reduces every step."""
        return 4 * sum(p.numel() for p in self.trained.values())


def set_master(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """A trained parameter and its fp32 master copy (DeepSpeed's, under ZeRO-1/2) set to ``value``."""
    if hasattr(param, "_hp_mapping") or hasattr(param, "ds_id"):
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(param, value)
    param.data.copy_(value)


def restart_moments(params: list[torch.nn.Parameter], optimizer: Any) -> None:
    """Set the AdamW moments of ``params`` to zero, leaving the step count: through DeepSpeed's
    fp32 optimizer-state fragments under ZeRO-1/2 (each rank its slice), in the plain optimizer's
    per-parameter state otherwise. Before the optimizer's first step there are no moments yet."""
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO's wrapper holds the torch optimizer
    zero = any(hasattr(p, "_hp_mapping") for p in params)
    if zero and inner.state:
        # DeepSpeed links each parameter's fragment of the moments after its first step, and again
        # after a checkpoint is loaded only at the next step: link them now (a no-op once linked).
        optimizer._lazy_init_hp_params_optimizer_state()
    for param in params:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None and inner.state:
            if not mapping.optim_fragment:
                raise RuntimeError("LoRA worker: DeepSpeed's optimizer state has no moments for an adapter")
            from deepspeed.utils import safe_set_full_optimizer_state

            value = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            for key in mapping.get_optim_state_keys():
                safe_set_full_optimizer_state(param, value, key)
        elif not zero:
            for value in inner.state.get(param, {}).values():
                if torch.is_tensor(value) and value.shape == param.shape:
                    value.zero_()


def save_adapter(peft: Any, state: dict[str, torch.Tensor], out: Path, base: str) -> None:
    """``state`` (PEFT state-dict names) as an adapter folder written by PEFT's ``save_pretrained``,
    naming ``base`` (the global it was trained on) as its base model; without PEFT's model card."""
    config = peft.peft_config[ADAPTER]
    kept, config.base_model_name_or_path = config.base_model_name_or_path, base
    try:
        peft.save_pretrained(out, state_dict=state, save_embedding_layers=False)
    finally:
        config.base_model_name_or_path = kept
    (out / "README.md").unlink(missing_ok=True)
