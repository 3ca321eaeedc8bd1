"""The streaming merge driver: tensor by tensor over all inputs, with bounded memory.

Peak memory is O((K + 2) × largest tensor): the K inputs of one tensor (a general method
stacks them; a linear one holds only a running sum), θ0's tensor and the output. Compute is in
fp32 on ``device``; the output is written in each tensor's input dtype unless ``out_dtype``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

import pipeline.merge.methods  # noqa: F401  (registers the methods)
from pipeline.checkpoint import staged_dir, write_manifest
from pipeline.merge.io import CheckpointReader, MergeInputError, ShardedWriter, TensorInfo, copy_aux_files
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext
from pipeline.merge.rules import Rule, choose
from pipeline.merge.spec import OUT_DTYPES, MergeSpec

Loader = Callable[[], torch.Tensor]
TIED = ("lm_head.weight", "model.embed_tokens.weight")


@dataclass
class MergeReport:
    out_path: str
    tensors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    compute_seconds: float = 0.0
    write_seconds: float = 0.0
    total_seconds: float = 0.0
    methods: dict[str, str] = field(default_factory=dict)  # tensor name -> method used

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for method in self.methods.values():
            counts[method] = counts.get(method, 0) + 1
        return {k: v for k, v in asdict(self).items() if k != "methods"} | {"method_counts": counts}


class _Timer:
    def __init__(self, report: MergeReport):
        self.report = report

    def load(self, loader: Loader) -> torch.Tensor:
        start = time.perf_counter()
        tensor = loader()
        self.report.read_seconds += time.perf_counter() - start
        self.report.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def merge_tensor(
    method: MergeMethod,
    params: MethodParams,
    ctx: TensorContext,
    base: Loader | None,
    inputs: Sequence[Loader],
    labels: Sequence[str],
    weights: torch.Tensor,
    device: str = "cpu",
    load: Callable[[Loader], torch.Tensor] = lambda f: f(),
    base_label: str = "base model",
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Merge one tensor. With ``base`` (θ0's loader) the inputs are models θ_k and the result is
    θ; with ``base=None`` the inputs are already task vectors / pseudo-gradients and so is the
    result. θ0 is read only when the method needs it (never for the weighted average)."""
    if method.is_linear:
        base_coeff, coeffs = method.coefficients(weights, params)
        out = None
        for c, loader in zip(coeffs.tolist(), inputs):
            t = load(loader).to(device)
            # The first input is copied (never scaled in place: it may be the caller's tensor).
            out = t.to(torch.float32, copy=True).mul_(c) if out is None else out.add_(t, alpha=c)
        if base is not None and base_coeff:
            out.add_(load(base).to(device), alpha=base_coeff)
        if not torch.isfinite(out.sum()):  # NaN/Inf in any input reaches a linear combination
            used = [*inputs, base] if base is not None and base_coeff else list(inputs)
            _raise_non_finite(ctx.name, [load(f) for f in used], [*labels, base_label])
        return out
    stack = None
    for k, loader in enumerate(inputs):
        t = load(loader).to(device)  # move in the stored dtype (bf16: half the bytes), convert there
        if stack is None:
            flat = (workspace or Workspace()).get(len(inputs) * t.numel(), device)
            stack = flat.view(len(inputs), *t.shape)
        stack[k].copy_(t)
    if not torch.isfinite(stack.reshape(len(inputs), -1).sum(1)).all():
        _raise_non_finite(ctx.name, stack, labels)
    if base is None:
        return method.merge(stack, weights.to(device), ctx, params)
    theta0 = load(base).to(device, torch.float32)
    if not torch.isfinite(theta0.sum()):
        _raise_non_finite(ctx.name, [theta0], [base_label])
    return method.merge(stack.sub_(theta0), weights.to(device), ctx, params).add_(theta0)


class Workspace:
    """Scratch space reused from tensor to tensor within one merge: allocating (K, n) fresh for
    every tensor costs a page fault per 4 KiB, as much as the merge arithmetic itself on CPU.
    Owned by one merge call (freed with it, never shared between threads)."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def get(self, numel: int, device: str) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < numel or str(self.buffer.device) != str(torch.device(device)):
            self.buffer = None
            self.buffer = torch.empty(numel, dtype=torch.float32, device=device)
        return self.buffer[:numel]


def _raise_non_finite(name: str, tensors, labels: Sequence[str]) -> None:
    for tensor, label in zip(tensors, labels):
        if not torch.isfinite(tensor).all():
            raise MergeInputError(f"{label}: tensor {name} contains NaN or Inf")
    raise MergeInputError(f"tensor {name}: the merged values overflow float32")


def merge_state_dicts(
    models: Sequence[dict[str, torch.Tensor]],
    weights: Sequence[float] | torch.Tensor,
    rules: list[Rule],
    base: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """In-memory merge (fp32 results). Without ``base`` the inputs are task vectors or DiLoCo
    pseudo-gradients and the result is their merged update: nothing is written to disk."""
    weights = torch.as_tensor(weights, dtype=torch.float64)
    if len(weights) != len(models):
        raise ValueError(f"{len(models)} inputs but {len(weights)} weights")
    if weights.sum() <= 0 or (weights < 0).any():
        raise ValueError(f"weights must be non-negative and sum to a positive number, got {weights.tolist()}")
    weights = (weights / weights.sum()).float()
    labels = [f"input {k}" for k in range(len(models))]
    dicts, dict_labels = (
        [*models, *([base] if base is not None else [])],
        [*labels, *(["base"] if base is not None else [])],
    )
    _check_same_tensors([{n: TensorInfo(tuple(t.shape), t.dtype) for n, t in d.items()} for d in dicts], dict_labels)
    workspace, out = Workspace(), {}
    for name, first in models[0].items():
        method, params = choose(name, rules)
        if not first.dtype.is_floating_point:
            out[name] = first.clone()  # integer buffers are copied, not merged
            continue
        if method.needs_fisher:
            raise ValueError("the fisher method needs Fisher files: use merge_checkpoints")
        out[name] = merge_tensor(
            method,
            params,
            TensorContext(name, seed),
            None if base is None else (lambda name=name: base[name]),
            [lambda m=m, name=name: m[name] for m in models],
            labels,
            weights,
            device,
            base_label="base",
            workspace=workspace,
        )
    return out


def _check_same_tensors(infos: Sequence[dict[str, TensorInfo]], labels: Sequence[str]) -> None:
    reference, ref_label = infos[0], labels[0]
    for info, label in zip(infos[1:], labels[1:]):
        missing, extra = sorted(set(reference) - set(info)), sorted(set(info) - set(reference))
        if missing or extra:
            raise MergeInputError(
                f"{label}: tensor names differ from {ref_label}: missing {missing[:5]}, extra {extra[:5]}"
            )
        for name, ref in reference.items():
            if info[name] != ref:
                raise MergeInputError(
                    f"{label}: tensor {name} is {info[name].shape} {info[name].dtype}, "
                    f"but {ref.shape} {ref.dtype} in {ref_label}"
                )


def merge_checkpoints(spec: MergeSpec, progress: bool = True, **meta: Any) -> MergeReport:
    """Merge checkpoint folders as the spec says; write a loadable checkpoint atomically.
    ``meta`` goes into the output's manifest (e.g. the identities of the inputs)."""
    start = time.perf_counter()
    run = _CheckpointMerge(spec)
    report = run.report
    with staged_dir(spec.out_path) as tmp, ShardedWriter(tmp, run.plan, spec.max_shard_size) as writer:
        for name in tqdm(writer.order, desc="merge", unit="tensor", disable=not progress, leave=False):
            merged = run.merge(name)
            write_start = time.perf_counter()  # time spent waiting for the writer thread
            writer.write(name, merged.to(run.plan[name].dtype))
            report.write_seconds += time.perf_counter() - write_start
        writer.close()
        copy_aux_files(run.reference.aux_files(), tmp)
        report.tensors, report.bytes_written = len(run.plan), writer.bytes_written
        report.total_seconds = time.perf_counter() - start
        write_manifest(
            tmp,
            writer.sha256,
            kind="merge",
            spec=spec.model_dump(mode="json"),
            report=report.summary(),
            parents=[str(r.path) for r in run.readers],
            **meta,
        )
    report.total_seconds = time.perf_counter() - start
    return report


class _CheckpointMerge:
    """The inputs of one merge, validated up front, and the per-tensor merge over them."""

    def __init__(self, spec: MergeSpec):
        self.spec, self.rules, self.weights = spec, spec.effective_rules, spec.normalized_weights()
        self.base = CheckpointReader(spec.base_model) if spec.base_model else None
        self.models = [CheckpointReader(entry.path) for entry in spec.models]
        self.labels = [entry.path for entry in spec.models]
        with_fisher = all(e.fisher for e in spec.models)
        self.fishers = [CheckpointReader(entry.fisher) for entry in spec.models] if with_fisher else None
        self.readers = [r for r in (self.base, *self.models) if r is not None]
        _check_same_tensors([r.info for r in self.readers], [str(r.path) for r in self.readers])
        if self.fishers:
            _check_fishers(self.fishers, self.models[0].info)
        self.reference = self.readers[0]
        out_dtype = OUT_DTYPES.get(spec.out_dtype) if spec.out_dtype else None
        tied = _tied(self.reference)
        self.plan = {
            name: TensorInfo(info.shape, out_dtype if out_dtype and info.dtype.is_floating_point else info.dtype)
            for name, info in self.reference.info.items()
            if name not in tied
        }
        self.report = MergeReport(out_path=spec.out_path)
        self.timer = _Timer(self.report)
        self.workspace = Workspace()

    def merge(self, name: str) -> torch.Tensor:
        method, params = choose(name, self.rules)
        self.report.methods[name] = method.name
        start, read_before = time.perf_counter(), self.report.read_seconds
        if not self.reference.info[name].dtype.is_floating_point:
            merged = self.timer.load(lambda: self.reference.get(name))  # integer buffers are copied
        else:
            fishers = _stack_fishers(self.fishers, name, self.timer) if method.needs_fisher else None
            merged = merge_tensor(
                method,
                params,
                TensorContext(name, self.spec.seed, fishers),
                (lambda: self.base.get(name)) if self.base else None,
                [lambda r=r: r.get(name) for r in self.models],
                self.labels,
                self.weights,
                self.spec.device,
                self.timer.load,
                str(self.spec.base_model),
                self.workspace,
            )
        self.report.compute_seconds += time.perf_counter() - start - (self.report.read_seconds - read_before)
        return merged


def _tied(reader: CheckpointReader) -> set[str]:
    """Names not to write: a tied ``lm_head.weight`` is the embedding matrix, merged once."""
    config = reader.config()
    tied = config.get("tie_word_embeddings") or (config.get("text_config") or {}).get("tie_word_embeddings")
    return {TIED[0]} if tied and all(name in reader.info for name in TIED) else set()


def _check_fishers(fishers: list[CheckpointReader], info: dict[str, TensorInfo]) -> None:
    for reader in fishers:
        for name, ref in info.items():
            if ref.dtype.is_floating_point and (name not in reader.info or reader.info[name].shape != ref.shape):
                raise MergeInputError(f"{reader.path}: no Fisher values of shape {ref.shape} for tensor {name}")


def _stack_fishers(fishers: list[CheckpointReader] | None, name: str, timer: _Timer) -> torch.Tensor:
    return torch.stack([timer.load(lambda r=r: r.get(name)).float() for r in fishers])
