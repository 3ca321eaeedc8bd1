"""``out_format: adapter``: a merge of LoRA adapters written as a PEFT LoRA adapter over θ0, so the
merged result stays small and is served as an adapter (PEFT, vLLM).

Per adapted module, the merged ΔW as factors B A (scaling 1: ``lora_alpha`` = rank):

- linear methods (weighted average, task arithmetic): exact, the inputs' factors side by side,
  A = [c_1 s_1 A_1; …; c_K s_K A_K], B = [B_1 … B_K] at rank Σ r_k (PEFT's ``cat``);
- any other method: its merged ΔW (computed as for a model) truncated by SVD to
  ``adapter_rank``, B = U_r S_r, A = V_rᵀ, with each tensor's relative truncation error
  ‖ΔW − B A‖_F / ‖ΔW‖_F in the manifest.

``modules_to_save`` tensors are written whole (θ0 + the merged τ). A tensor no adapter touches
is not written: its merged τ is 0 under every method.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from pipeline.checkpoint import checkpoint_id, staged_dir, write_manifest
from pipeline.merge.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, AdapterError, AdapterReader
from pipeline.merge.driver import MergeReport, _CheckpointMerge, merged_task_vector
from pipeline.merge.io import ShardedWriter, TensorInfo, aux_files, copy_aux_files
from pipeline.merge.rules import choose
from pipeline.merge.spec import OUT_DTYPES, MergeSpec


def merge_to_adapter(spec: MergeSpec, progress: bool = True, **meta: Any) -> MergeReport:
    start = time.perf_counter()
    run = _CheckpointMerge(spec)
    adapters: list[AdapterReader] = run.models
    outputs = _outputs(adapters, run)
    plan = {key: info for out in outputs.values() for key, info in out["tensors"].items()}
    errors: dict[str, float] = {}
    total = sum(info.nbytes for info in plan.values())
    stem = ADAPTER_WEIGHTS.removesuffix(".safetensors")
    with staged_dir(spec.out_path) as tmp, ShardedWriter(tmp, plan, total + 1, stem=stem) as writer:
        for name, out in tqdm(outputs.items(), desc="merge", unit="tensor", disable=not progress, leave=False):
            dtype = next(iter(out["tensors"].values())).dtype
            if out["kind"] == "whole":
                tensors = [run.merge(name)]
            else:
                a, b, errors[out["module"]] = _factors(run, name, out["rank"])
                tensors = [a, b]
            for key, tensor in zip(out["tensors"], tensors):
                writer.write(key, tensor.to(dtype).contiguous())
        writer.close()
        copy_aux_files([p for p in aux_files(adapters[0].path) if p.name != ADAPTER_CONFIG], tmp)
        config = _adapter_config(spec, [a.adapter_config for a in adapters], outputs)
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


def _outputs(adapters: list[AdapterReader], run: _CheckpointMerge) -> dict[str, dict[str, Any]]:
    """Per θ0 tensor some adapter changes: how it is written (factors at a rank, or whole) and
    the planned output tensors, in θ0's order."""
    spec, outputs = run.spec, {}
    out_dtype = OUT_DTYPES.get(spec.out_dtype) if spec.out_dtype else None
    for name, info in run.base.info.items():
        factored = [a for a in adapters if name in a.factors]
        whole = [a for a in adapters if name in a.whole]
        if factored and whole:
            raise AdapterError(
                f"{whole[0].path} saves {name} whole, {factored[0].path} adapts it with LoRA: cannot merge"
            )
        if whole:
            key = whole[0].whole[name]
            outputs[name] = {"kind": "whole", "module": _module_tensor(key).rsplit(".", 1)[0]}
            outputs[name]["tensors"] = {
                PEFT_PREFIX + _module_tensor(key): TensorInfo(info.shape, out_dtype or info.dtype)
            }
        elif factored:
            module = factored[0].module[name]
            method, _ = choose(name, run.rules)
            if method.is_linear:
                rank = sum(a.factor_shape(name)[0] for a in factored)
            else:
                rank = min(spec.adapter_rank, *info.shape)
            dtype = out_dtype or _promoted(a.factor_dtype(name) for a in factored)
            outputs[name] = {"kind": "factors", "module": module, "rank": rank}
            outputs[name]["tensors"] = {
                f"{PEFT_PREFIX}{module}.lora_A.weight": TensorInfo((rank, info.shape[1]), dtype),
                f"{PEFT_PREFIX}{module}.lora_B.weight": TensorInfo((info.shape[0], rank), dtype),
            }
    if not outputs:
        raise AdapterError(f"the adapters {[str(a.path) for a in adapters]} change no tensor of θ0")
    return outputs


def _module_tensor(key: str) -> str:
    return key.removeprefix(PEFT_PREFIX).replace(".modules_to_save.", ".")


def _promoted(dtypes) -> torch.dtype:
    out = None
    for dtype in dtypes:
        out = dtype if out is None else torch.promote_types(out, dtype)
    return out


def _factors(run: _CheckpointMerge, name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A (rank × in), B (out × rank) of the merged ΔW of tensor ``name``, and the relative error of
    writing it at that rank (0 for the linear methods, exact)."""
    method, params = choose(name, run.rules)
    run.report.methods[name] = method.name
    if method.is_linear:
        _, coefficients = method.coefficients(run.weights, params)
        pairs = [
            (a.factor(a.factors[name][0]).mul_(float(c) * a.scaling[name]), a.factor(a.factors[name][1]))
            for a, c in zip(run.models, coefficients.tolist())
            if name in a.factors
        ]
        return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs], dim=1), 0.0
    delta = merged_task_vector(method, params, run.inputs(name, method), run.weights, run.context(name))
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    energy = s.square()
    error = math.sqrt(energy[rank:].sum().item() / energy.sum().item()) if energy.sum() > 0 else 0.0
    return vh[:rank], u[:, :rank] * s[:rank], error


def _adapter_config(
    spec: MergeSpec, configs: list[dict[str, Any]], outputs: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The first input's config with the merged adapter's modules and ranks (alpha = rank
    everywhere, scaling 1: the factors carry the scale) and every input's whole modules."""
    first = configs[0]
    ranks = {out["module"]: out["rank"] for out in outputs.values() if out["kind"] == "factors"}
    r = max(ranks.values(), default=first.get("r", 1))
    pattern = {module: rank for module, rank in ranks.items() if rank != r}
    return first | {
        "r": r,
        "lora_alpha": r,
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "use_rslora": False,
        "target_modules": sorted(ranks),
        "modules_to_save": sorted({m for config in configs for m in config.get("modules_to_save") or []}) or None,
        "base_model_name_or_path": spec.base_model,
        "inference_mode": True,
    }
