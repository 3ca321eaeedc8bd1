"""The streaming merge driver: tensor by tensor over all inputs, with bounded memory.

Per tensor a merge holds its output, θ0's tensor and one input tensor at a time (the averages,
Iso-C's mean, TSV's and Iso-CTS's per-task SVDs); element-wise methods (TIES, DARE, Fisher)
hold K rows of a block whose fp32 size stays under ``block_bytes`` (``pipeline.merge.inputs``).
Peak memory therefore does not grow with K beyond what the inputs' readers keep. Compute is in
fp32 on ``device``; models may be stored in different float dtypes (bf16 branches over an fp32
θ0): the output takes the models' dtype (the wider one if they differ) unless ``out_dtype``.

Tied embeddings: a θ0 whose lm_head is its embedding stays tied in the merge (lm_head written once, as the
embedding) unless an input has an lm_head of its own: an adapter that unties it (``modules_to_save`` without
``ensure_weight_tying``, which PEFT's merge_and_unload unties) or a checkpoint saved untied. Then the output is
untied, as PEFT's merged model of that input is: its lm_head is the merge of the inputs' lm_heads, where an input
still tied (θ0 too) contributes its embedding, changes included, which is exactly its lm_head; its config says
``tie_word_embeddings: false``. Keeping it tied instead would drop that input's lm_head, or merge it into the
embedding it was not trained as.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import pipeline.merge.methods  # noqa: F401  (registers the methods)
from pipeline.checkpoint import staged_dir, write_manifest
from pipeline.merge.adapter import EMBEDDING, LM_HEAD, AdapterReader, checkpoint_name, embeddings_tied, untied_config
from pipeline.merge.inputs import Reader, TensorInputs, Workspace, finite, rows_of, tensor_reader
from pipeline.merge.io import (
    CheckpointReader,
    MergeInputError,
    TensorInfo,
    check_complete,
    copy_aux_files,
    stream_checkpoint,
)
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, get_method
from pipeline.merge.rules import Rule, choose
from pipeline.merge.spec import OUT_DTYPES, MergeSpec
from pipeline.models.families import stacked_experts


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
    threads: int = 0  # torch threads of the merge (pipeline.threads)
    methods: dict[str, str] = field(default_factory=dict)  # tensor name -> method used

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for method in self.methods.values():
            counts[method] = counts.get(method, 0) + 1
        return {k: v for k, v in asdict(self).items() if k != "methods"} | {"method_counts": counts}

    def timed(self, reader: Reader) -> Reader:
        """``reader``, counting the seconds and bytes it reads."""

        def read(start: int, stop: int) -> torch.Tensor:
            began = time.perf_counter()
            tensor = reader(start, stop)
            self.read_seconds += time.perf_counter() - began
            self.bytes_read += tensor.numel() * tensor.element_size()
            return tensor

        return read


def merge_tensor(
    method: MergeMethod, params: MethodParams, inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext
) -> torch.Tensor:
    """Merge one tensor (fp32, on the inputs' device). With a base the inputs are models θ_k and the
    result is θ; without, they are task vectors or pseudo-gradients and so is the result. θ0 is
    read only when the method needs it (never for the weighted average)."""
    if method.is_linear:
        base_coefficient, coefficients = method.coefficients(weights, params)
        return inputs.combine(coefficients.tolist(), base_coefficient)
    merged = merged_task_vector(method, params, inputs, weights, ctx)
    if inputs.base is not None:
        merged.add_(inputs.base_tensor())
    if not finite(merged):
        raise MergeInputError(f"tensor {ctx.name}: the merged values overflow float32")
    return merged


def merged_task_vector(
    method: MergeMethod, params: MethodParams, inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext
) -> torch.Tensor:
    """The merged τ of one tensor (θ − θ0). A linear method's combination is affine (its
    coefficients of θ0 and the θ_k sum to 1), so its τ is Σ_k c_k τ_k."""
    if method.is_linear:
        base_coefficient, coefficients = method.coefficients(weights, params)
        return inputs.combine(coefficients.tolist(), base_coefficient - 1.0)
    if ctx.experts:
        # A fused expert tensor is E matrices: a per-matrix method (Iso-C, TSV) spreads one spectrum
        # over all experts' directions otherwise, and TIES's top-k and DARE's rescaling would compare
        # experts that never see the same tokens. Each expert is merged alone, with its own seed.
        weights = weights.to(inputs.device)
        experts = [replace(ctx, name=f"{ctx.name}[{e}]", experts=False) for e in range(inputs.shape[0])]
        return torch.stack([method.merge(inputs.expert(e), weights, c, params) for e, c in enumerate(experts)])
    return method.merge(inputs, weights.to(inputs.device), ctx, params)


def merge_state_dicts(
    models: Sequence[dict[str, torch.Tensor]],
    weights: Sequence[float] | torch.Tensor,
    rules: list[Rule],
    base: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
    device: str = "cpu",
    block_bytes: int = 1 << 30,
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
    with_base = base is not None
    dicts, dict_labels = [*models, *([base] if with_base else [])], [*labels, *(["base"] if with_base else [])]
    _check_same_tensors([{n: TensorInfo(tuple(t.shape), t.dtype) for n, t in d.items()} for d in dicts], dict_labels)
    for rule in rules:  # a merge spec checks this when it is read; in memory (DiLoCo), here
        get_method(rule.method).check_inputs(len(models))
    workspace, out = Workspace(), {}
    for name, first in models[0].items():
        method, params = choose(name, rules)
        if not first.dtype.is_floating_point:
            out[name] = first.clone()  # integer buffers are copied, not merged
            continue
        if method.needs_fisher:
            raise ValueError("the fisher method needs Fisher files: use merge_checkpoints")
        inputs = TensorInputs(
            name,
            first.shape,
            [tensor_reader(m[name]) for m in models],
            labels,
            base=tensor_reader(base[name]) if base is not None else None,
            base_label="base",
            device=device,
            block_bytes=block_bytes,
            workspace=workspace,
        )
        out[name] = merge_tensor(method, params, inputs, weights, TensorContext(name, seed))
    return out


def _check_same_tensors(infos: Sequence[dict[str, TensorInfo]], labels: Sequence[str]) -> None:
    """The same tensor names and shapes everywhere; float tensors may differ in float dtype
    (merged in fp32), other tensors (integer buffers) must match exactly."""
    reference, ref_label = infos[0], labels[0]
    for info, label in zip(infos[1:], labels[1:]):
        missing, extra = sorted(set(reference) - set(info)), sorted(set(info) - set(reference))
        if missing or extra:
            raise MergeInputError(
                f"{label}: tensor names differ from {ref_label}: missing {missing[:5]}, extra {extra[:5]}"
            )
        for name, ref in reference.items():
            other = info[name]
            floats = ref.dtype.is_floating_point and other.dtype.is_floating_point
            if other.shape != ref.shape or (other.dtype != ref.dtype and not floats):
                raise MergeInputError(
                    f"{label}: tensor {name} is {other.shape} {other.dtype}, but {ref.shape} {ref.dtype} in {ref_label}"
                )


def merge_checkpoints(spec: MergeSpec, progress: bool = True, **meta: Any) -> MergeReport:
    """Merge checkpoint folders as the spec says; write a loadable checkpoint atomically.
    ``meta`` goes into the output's manifest (e.g. the identities of the inputs)."""
    if spec.out_format == "adapter":
        from pipeline.merge.to_adapter import merge_to_adapter

        return merge_to_adapter(spec, progress, **meta)
    start = time.perf_counter()
    run = _CheckpointMerge(spec)
    report = run.report
    report.threads = torch.get_num_threads()
    with staged_dir(spec.out_path) as tmp:
        written = stream_checkpoint(
            tmp,
            run.plan,
            lambda name: run.merge(name).to(run.plan[name].dtype),
            spec.max_shard_size,
            progress="merge" if progress else None,
        )
        copy_aux_files(run.models[0].aux_files(), tmp)  # the branches' config: their dtype
        if run.untied:
            _untie(tmp)
        report.tensors, report.bytes_written = len(run.plan), written.bytes_written
        report.write_seconds = written.wait_seconds
        report.total_seconds = time.perf_counter() - start
        write_manifest(
            tmp,
            written.sha256,
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
        self.models = [
            AdapterReader(e.adapter, self.base) if e.adapter else CheckpointReader(e.path) for e in spec.models
        ]
        self.labels = [entry.source for entry in spec.models]
        self.stacked = stacked_experts(spec.base_model or spec.models[0].path)
        if self.base is not None:
            self.base.transpose_experts(_other_layout(self.base.info, self.models[0].info, self.stacked))
        with_fisher = all(e.fisher for e in spec.models)
        self.fishers = [CheckpointReader(entry.fisher) for entry in spec.models] if with_fisher else None
        self.readers = [r for r in (self.base, *self.models) if r is not None]
        _check_same_tensors([r.info for r in self.readers], [str(r.path) for r in self.readers])
        if self.fishers:
            _check_fishers(self.fishers, self.models[0].info)
        out_dtype = OUT_DTYPES.get(spec.out_dtype) if spec.out_dtype else None
        base_tied = self.base is not None and embeddings_tied(self.base.config())
        self.embedding = checkpoint_name(EMBEDDING, self.base.info) if base_tied else None
        self.untied = self.embedding is not None and any(_own_lm_head(m) for m in self.models)
        self.info = dict(self.models[0].info)  # the output's tensors
        if self.untied:
            self.info.setdefault(LM_HEAD, self.info[self.embedding])
        tied = set() if self.untied else _tied(self.models[0])
        self.plan = {
            name: TensorInfo(
                info.shape, (out_dtype or self._models_dtype(name)) if info.dtype.is_floating_point else info.dtype
            )
            for name, info in self.info.items()
            if name not in tied
        }
        theta0 = self.base or self.models[0]
        reference = {n: i for n, i in theta0.info.items() if n not in _tied(theta0)}
        if self.untied:
            reference[LM_HEAD] = self.info[LM_HEAD]  # PEFT's merged model of an untying adapter stores it
        check_complete(self.plan, reference, f"merge {spec.out_path}", str(theta0.path))
        self.report = MergeReport(out_path=spec.out_path)
        self.workspace = Workspace()

    def _models_dtype(self, name: str) -> torch.dtype:
        dtype = self._info(self.models[0], name).dtype
        for reader in self.models[1:]:
            dtype = torch.promote_types(dtype, self._info(reader, name).dtype)
        return dtype

    def source(self, reader: Any, name: str) -> str:
        """The tensor of ``reader`` that makes the output's ``name``: in an untied merge, the lm_head of an
        input still tied (θ0's too) is its embedding."""
        if self.untied and name == LM_HEAD and not _own_lm_head(reader):
            return self.embedding
        return name

    def _info(self, reader: Any, name: str) -> TensorInfo:
        """Shape and dtype of the output's ``name`` in ``reader`` (an untying adapter's lm_head, which a θ0
        stored tied does not have, is its embedding's)."""
        source = self.source(reader, name)
        return reader.info[source if source in reader.info else self.embedding]

    def merge(self, name: str) -> torch.Tensor:
        """θ's tensor ``name``. Where every input is an adapter that leaves it alone every τ_k is 0,
        and so is the merged τ of every method: θ0's tensor is copied (at 7B most of the bytes)."""
        method, params = choose(name, self.rules)
        start, read_before = time.perf_counter(), self.report.read_seconds
        shape = self.info[name].shape
        if not self.info[name].dtype.is_floating_point:
            merged = self.report.timed(self.models[0].reader(name))(0, rows_of(shape)[0]).reshape(shape)  # copied
        elif not any(m.touches(self.source(m, name)) for m in self.models):
            theta0 = self.base.reader(self.source(self.base, name))
            merged, method = self.report.timed(theta0)(0, rows_of(shape)[0]).reshape(shape), None
        else:
            merged = merge_tensor(method, params, self.inputs(name, method), self.weights, self.context(name))
        self.report.methods[name] = method.name if method else "base (no adapter changes it)"
        self.report.compute_seconds += time.perf_counter() - start - (self.report.read_seconds - read_before)
        return merged

    def inputs(self, name: str, method: MergeMethod) -> TensorInputs:
        timed = self.report.timed
        fishers = self._fishers_of(name) if method.needs_fisher else None
        return TensorInputs(
            name,
            self.info[name].shape,
            [timed(m.reader(self.source(m, name))) for m in self.models],
            self.labels,
            base=timed(self.base.reader(self.source(self.base, name))) if self.base else None,
            base_label=str(self.spec.base_model),
            device=self.spec.device,
            block_bytes=self.spec.block_mb << 20,
            workspace=self.workspace,
            fishers=fishers and [timed(f.reader(self.source(f, name))) for f in fishers],
            deltas=[m.is_delta(self.source(m, name)) for m in self.models],
        )

    def context(self, name: str) -> TensorContext:
        return TensorContext(name, self.spec.seed, self.stacked(name))

    def _fishers_of(self, name: str) -> list[CheckpointReader] | None:
        """The Fisher files' values of a tensor: all of them, or none (a frozen tensor, averaged)."""
        having = [f for f in self.fishers if self.source(f, name) in f.info]
        if having and len(having) < len(self.fishers):
            lacking = next(f for f in self.fishers if f not in having)
            raise MergeInputError(f"{lacking.path}: no Fisher values for tensor {name}, which other Fisher files have")
        return having or None


def _other_layout(
    base: dict[str, TensorInfo], model: dict[str, TensorInfo], stacked: Callable[[str], bool]
) -> list[str]:
    """θ0's fused expert tensors stored (experts, b, a) where the model stores (experts, a, b)."""
    return [
        name
        for name, info in base.items()
        if stacked(name)
        and name in model
        and len(info.shape) == 3
        and info.shape != model[name].shape
        and (info.shape[0], info.shape[2], info.shape[1]) == model[name].shape
    ]


def _tied(reader: CheckpointReader) -> set[str]:
    """Names not to write: a tied ``lm_head.weight`` is the embedding matrix, merged once."""
    stored = LM_HEAD in reader.info and checkpoint_name(EMBEDDING, reader.info) is not None
    return {LM_HEAD} if embeddings_tied(reader.config()) and stored else set()


def _own_lm_head(reader: Any) -> bool:
    """Whether an input's lm_head is a tensor of its own, not its embedding: an adapter that unties it, or a
    checkpoint (or Fisher file) that stores lm_head and does not tie it."""
    if isinstance(reader, AdapterReader):
        return reader.unties
    return LM_HEAD in reader.info and not embeddings_tied(reader.config())


def _untie(folder: Path) -> None:
    """The output's config.json with lm_head untied, as PEFT's merge_and_unload leaves a model it untied."""
    path = folder / "config.json"
    if path.is_file():
        path.write_text(json.dumps(untied_config(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")


def _check_fishers(fishers: list[CheckpointReader], info: dict[str, TensorInfo]) -> None:
    """Fisher files hold some of the models' float tensors (those that trained), in their shapes."""
    for reader in fishers:
        unknown = sorted(set(reader.info) - set(info))
        if not reader.info:
            raise MergeInputError(f"{reader.path}: holds no tensors, so no Fisher values")
        if unknown:
            raise MergeInputError(f"{reader.path}: not Fisher values of these models (tensors {unknown[:5]} unknown)")
        for name, fisher in reader.info.items():
            if fisher.shape != info[name].shape or not fisher.dtype.is_floating_point:
                raise MergeInputError(
                    f"{reader.path}: Fisher values of tensor {name} are {fisher.shape} {fisher.dtype}, "
                    f"the models' are {info[name].shape}"
                )
