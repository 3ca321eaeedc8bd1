"""``out_format: adapter``: a merge of LoRA adapters written as a PEFT LoRA adapter over θ0, so the
merged result stays small and is served as an adapter (PEFT, vLLM).

Per adapted module, the merged ΔW as factors B A (scaling 1: ``lora_alpha`` = rank):

- linear methods (weighted average, task arithmetic): exact, the inputs' factors side by side,
  A = [c_1 s_1 A_1; …; c_K s_K A_K], B = [B_1 … B_K] at rank Σ r_k (PEFT's ``cat``);
- any other method: its merged ΔW (computed as for a model) truncated by SVD to
  ``adapter_rank``, B = U_r S_r, A = V_rᵀ, with each tensor's relative truncation error
  ‖ΔW − B A‖_F / ‖ΔW‖_F in the manifest.

A bias that ``lora_bias`` inputs change is written as ``lora_B.bias``, the merged τ (``lora_bias: true``),
when every adapted module of the output has a bias in θ0 (PEFT's merge raises otherwise) and no input stores
it whole; otherwise it is written whole. Tensors written whole (θ0 + the merged τ: ``modules_to_save``,
biases) keep the inputs' names, ``<m>.base_layer.<p>`` where the module ``<m>`` has factors, and PEFT loads
them by name. A merge that unties θ0's lm_head (``pipeline.merge.driver``) writes lm_head whole as a module to
save, as PEFT then unties it. A tensor no adapter touches is not written: its merged τ is 0 under every method.

The config keeps only the first input's identity (``task_type``, ``peft_type``, ``peft_version``); every
other option is the merged adapter's or PEFT's default, so no input's training option (an initialisation,
``layers_to_transform``, a variant) changes how PEFT loads it.

Refused, naming the tensor (``out_format: model`` writes them): LoRA on an embedding or a conv, trainable
tokens, a tensor one input stores whole and another adapts with factors, a module both saved whole and
adapted, and a tied embedding saved whole (``ensure_weight_tying``).
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from pipeline.checkpoint import checkpoint_id, staged_dir, write_manifest
from pipeline.merge.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LM_HEAD,
    PEFT_DEFAULT_RANK,
    PEFT_PREFIX,
    AdapterError,
    AdapterReader,
)
from pipeline.merge.driver import MergeReport, _CheckpointMerge, merged_task_vector
from pipeline.merge.io import ShardedWriter, TensorInfo, aux_files, copy_aux_files
from pipeline.merge.rules import choose
from pipeline.merge.spec import OUT_DTYPES, MergeSpec

KEPT = ("task_type", "peft_type", "peft_version")  # the first input's config fields the output keeps
WRITE_AS_MODEL = "write the merge with out_format: model"


@dataclass
class _Output:
    """One θ0 tensor of the merged adapter and the tensors it is written as."""

    name: str  # θ0's tensor
    kind: str  # "factors" (A, B), "lora_bias" (lora_B.bias = the merged τ) or "whole" (θ0 + the merged τ)
    module: str  # the module's path, as the adapters spell it
    tensors: dict[str, TensorInfo]
    rank: int = 0


def merge_to_adapter(spec: MergeSpec, progress: bool = True, **meta: Any) -> MergeReport:
    start = time.perf_counter()
    run = _CheckpointMerge(spec)
    adapters: list[AdapterReader] = run.models
    outputs = _outputs(run)
    plan = {key: info for out in outputs for key, info in out.tensors.items()}
    errors: dict[str, float] = {}
    total = sum(info.nbytes for info in plan.values())
    stem = ADAPTER_WEIGHTS.removesuffix(".safetensors")
    with staged_dir(spec.out_path) as tmp, ShardedWriter(tmp, plan, total + 1, stem=stem) as writer:
        for out in tqdm(outputs, desc="merge", unit="tensor", disable=not progress, leave=False):
            if out.kind == "whole":
                tensors = [run.merge(run.piece(out.name))]
            elif out.kind == "lora_bias":
                tensors = [_merged_delta(run, out.name)]
            else:
                a, b, errors[out.module] = _factors(run, out.name, out.rank)
                tensors = [a, b]
            for (key, info), tensor in zip(out.tensors.items(), tensors):
                writer.write(key, tensor.to(info.dtype).contiguous())
        writer.close()
        copy_aux_files([p for p in aux_files(adapters[0].path) if p.name != ADAPTER_CONFIG], tmp)
        config = _adapter_config(spec, run, outputs)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
        run.report.tensors, run.report.bytes_written = len(plan), writer.bytes_written
        run.report.total_seconds = time.perf_counter() - start
        write_manifest(
            tmp,
            writer.sha256,
            kind="merge",
            format="adapter",
            base_model=checkpoint_id(spec.base_model),
            spec=spec.model_dump(mode="json"),
            report=run.report.summary(),
            truncation_error=errors,
            parents=[str(r.path) for r in run.readers],
            **meta,
        )
    run.report.total_seconds = time.perf_counter() - start
    return run.report


def _outputs(run: _CheckpointMerge) -> list[_Output]:
    """Per tensor some adapter changes, in θ0's order: how it is written and its planned tensors."""
    _check_saved_bases(run)
    for name in run.info:
        _check_writable(run, name)
    factored = _factored_modules(run)
    lora_biases = _lora_biases(run, factored)
    modules = set(factored.values())
    out_dtype = OUT_DTYPES.get(run.spec.out_dtype) if run.spec.out_dtype else None
    outputs = []
    for name, info in run.info.items():
        if name in factored:
            outputs.append(_factors_output(run, name, factored[name], out_dtype))
        elif name in lora_biases:
            module, dtype = lora_biases[name], out_dtype or _factors_dtype(run, name.removesuffix("bias") + "weight")
            tensors = {f"{PEFT_PREFIX}{module}.lora_B.bias": TensorInfo(info.shape, dtype)}
            outputs.append(_Output(name, "lora_bias", module, tensors))
        elif (run.untied and name == LM_HEAD) or any(a.touches(run.source_key(a, name)) for a in run.models):
            outputs.append(_whole_output(run, name, modules))
    if not outputs:
        raise AdapterError(f"the adapters {[str(a.path) for a in run.models]} change no tensor of θ0")
    # PEFT wraps a module to save whole, and every module whose path contains its name
    if both := sorted(m for m in modules for saved in _saved_modules(run) if f".{saved}." in f".{m}."):
        raise AdapterError(f"out_format adapter: {both} both saved whole and adapted; {WRITE_AS_MODEL}")
    return outputs


def _check_saved_bases(run: _CheckpointMerge) -> None:
    """An adapted module's saved base (``base_layer.weight``, which PEFT saves with a LoRA on lm_head or an
    embedding) must be θ0's tensor: the merged adapter holds the factors only."""
    for a in run.models:
        for name in a.whole.keys() & a.factors.keys() - {LM_HEAD}:  # an untying adapter's lm_head is written whole
            if not torch.equal(a.factor(a.whole[name]), run.base.get(name).float()):
                raise AdapterError(
                    f"out_format adapter: {a.path} saves a base of {name} that is not θ0's; {WRITE_AS_MODEL}"
                )


def _saved_whole(a: AdapterReader, name: str) -> bool:
    """Whether an input stores θ0's tensor whole, not as the saved base of its factors (θ0's tensor, checked)."""
    return name in a.whole and name not in a.factors


def _check_writable(run: _CheckpointMerge, name: str) -> None:
    """Refuse, naming the tensor, what a LoRA adapter over θ0 cannot hold as PEFT loads it."""
    if run.untied and name == LM_HEAD:
        return  # written whole, whatever the inputs did to it
    sources = [(a, run.source_key(a, name)) for a in run.models]
    for a, source in sources:
        factors = a.factors.get(source)
        if source in a.tokens:
            why = f"replaces rows of {name} (trainable_token_indices)"
        elif factors and factors.expert is not None:
            why = f"adapts the fused experts of {factors.module} (target_parameters)"
        elif factors and (factors.embedding or len(run.info[name].shape) != 2):
            why = f"adapts {factors.module}, {'an embedding' if factors.embedding else 'a conv'}"
        elif source == a.embedding and _saved_whole(a, source) and not a.unties:
            why = f"saves the tied embedding {name} whole (ensure_weight_tying)"
        else:
            continue
        raise AdapterError(f"out_format adapter: {a.path} {why}; {WRITE_AS_MODEL}")
    factored = [a for a, source in sources if source in a.factors]
    whole = [a for a, source in sources if _saved_whole(a, source)]
    if factored and whole:
        raise AdapterError(f"{whole[0].path} saves {name} whole, {factored[0].path} adapts it with LoRA: cannot merge")


def _factored_modules(run: _CheckpointMerge) -> dict[str, str]:
    """θ0's tensors written as factors -> their module's path."""
    return {
        name: next(a.factors[name].module for a in run.models if name in a.factors)
        for name in run.info
        if not (run.untied and name == LM_HEAD) and any(name in a.factors for a in run.models)
    }


def _lora_biases(run: _CheckpointMerge, factored: dict[str, str]) -> dict[str, str]:
    """θ0's biases written as ``lora_B.bias`` -> their module: those of every adapted module when some input
    has lora_bias, every adapted module has a bias in θ0 and no input stores one of them whole; else none."""
    biases = {module: run.models[0].key(f"{module}.bias") for module in factored.values()}
    if not any(a.bias for a in run.models) or None in biases.values():
        return {}
    if any(_saved_whole(a, bias) for a in run.models for bias in biases.values()):
        return {}
    return {bias: module for module, bias in biases.items()}


def _factors_output(run: _CheckpointMerge, name: str, module: str, out_dtype: torch.dtype | None) -> _Output:
    info = run.info[name]
    method, _ = choose(name, run.rules)
    factored = [a for a in run.models if name in a.factors]
    if method.is_linear:
        rank = sum(a.factor_shape(name)[0] for a in factored)
    else:
        rank = min(run.spec.adapter_rank, *info.shape)
    dtype = out_dtype or _factors_dtype(run, name)
    tensors = {
        f"{PEFT_PREFIX}{module}.lora_A.weight": TensorInfo((rank, info.shape[1]), dtype),
        f"{PEFT_PREFIX}{module}.lora_B.weight": TensorInfo((info.shape[0], rank), dtype),
    }
    return _Output(name, "factors", module, tensors, rank)


def _whole_output(run: _CheckpointMerge, name: str, adapted: set[str]) -> _Output:
    """θ0 + the merged τ, under the inputs' name of it: ``<m>.base_layer.<p>`` where ``<m>`` has factors."""
    spelled = LM_HEAD if name == LM_HEAD else next(a.module_tensor[name] for a in run.models if name in a.module_tensor)
    module, param = spelled.rsplit(".", 1)
    key = f"{PEFT_PREFIX}{module}.base_layer.{param}" if module in adapted else PEFT_PREFIX + spelled
    return _Output(name, "whole", module, {key: run.out_info(name)})


def _saved_modules(run: _CheckpointMerge) -> list[str]:
    """The output's modules_to_save: every input's, and lm_head where the merge unties it."""
    saved = {m for a in run.models for m in a.adapter_config.get("modules_to_save") or []}
    return sorted(saved | ({"lm_head"} if run.untied else set()))


def _factors_dtype(run: _CheckpointMerge, name: str) -> torch.dtype:
    """The widest dtype of the inputs' factors of θ0's tensor ``name``."""
    return functools.reduce(torch.promote_types, [a.factor_dtype(name) for a in run.models if name in a.factors])


def _merged_delta(run: _CheckpointMerge, name: str) -> torch.Tensor:
    """The merged τ of θ0's tensor ``name`` (0 where no adapter changes it)."""
    if not any(a.touches(name) for a in run.models):
        return torch.zeros(run.info[name].shape)
    method, params = choose(name, run.rules)
    run.report.methods[name] = method.name
    piece = run.piece(name)
    return merged_task_vector(method, params, run.inputs(piece, method), run.weights, run.context(piece))


def _factors(run: _CheckpointMerge, name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A (rank × in), B (out × rank) of the merged ΔW of tensor ``name``, and the relative error of
    writing it at that rank (0 for the linear methods, exact)."""
    method, params = choose(name, run.rules)
    run.report.methods[name] = method.name
    if method.is_linear:
        _, coefficients = method.coefficients(run.weights, params)
        pairs = [
            (a.factor(a.factors[name].a).mul_(float(c) * a.factors[name].scaling), a.factor(a.factors[name].b))
            for a, c in zip(run.models, coefficients.tolist())
            if name in a.factors
        ]
        return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs], dim=1), 0.0
    piece = run.piece(name)
    delta = merged_task_vector(method, params, run.inputs(piece, method), run.weights, run.context(piece))
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    energy = s.square()
    error = math.sqrt(energy[rank:].sum().item() / energy.sum().item()) if energy.sum() > 0 else 0.0
    return vh[:rank], u[:, :rank] * s[:rank], error


def _adapter_config(spec: MergeSpec, run: _CheckpointMerge, outputs: list[_Output]) -> dict[str, Any]:
    """The merged adapter's config: its modules and ranks (alpha = rank everywhere, scaling 1: the factors
    carry the scale), the modules saved whole, and the first input's identity; every other option PEFT's
    default. ``bias`` stays "none": PEFT loads the biases written whole by name whatever it says."""
    first = run.models[0].adapter_config
    ranks = {out.module: out.rank for out in outputs if out.kind == "factors"}
    r = max(ranks.values(), default=first.get("r", PEFT_DEFAULT_RANK))
    pattern = {module: rank for module, rank in ranks.items() if rank != r}
    return {field: first[field] for field in KEPT if field in first} | {
        "r": r,
        "lora_alpha": r,
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "use_rslora": False,
        "init_lora_weights": True,
        "lora_bias": any(out.kind == "lora_bias" for out in outputs),
        "target_modules": sorted(ranks),
        "modules_to_save": _saved_modules(run) or None,
        "base_model_name_or_path": spec.base_model,
        "inference_mode": True,
    }
