"""The streaming merge driver: tensor by tensor over all inputs, with bounded memory.

Every input is read through its :class:`~pipeline.merge.layout.ModelView`: the model's tensors by key, each
expert's gate, up and down matrix a tensor of its own, whatever layout its files use. The output is written in
θ0's stored layout (the first model's without one), tensor for tensor, with the tensors transformers does not
load (``mtp.*``) copied from θ0 unchanged; it is checked to hold exactly the tensors of θ0's source (the model
θ0 was trained from, as θ0's manifest records it). So a merge as transformers loads it does not depend on how
θ0 and the branches were stored, and a per-matrix method (Iso-C, TSV) or an element-wise one (TIES' top-k,
DARE's rescaling) sees each expert's matrix alone: one spectrum or one threshold over all experts would mix
experts that never see the same tokens.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import pipeline.merge.methods  # noqa: F401  (registers the methods)
from pipeline.checkpoint import source_of, staged_dir, write_manifest
from pipeline.merge.adapter import EMBEDDING, LM_HEAD, AdapterReader, embeddings_tied, untied_config
from pipeline.merge.inputs import Reader, TensorInputs, Workspace, finite, rows_of
from pipeline.merge.io import (
    CheckpointReader,
    MergeInputError,
    TensorInfo,
    check_complete,
    copy_aux_files,
    copy_tokenizer,
    stream_checkpoint,
)
from pipeline.merge.layout import InMemory, ModelView, Piece, assemble
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, get_method
from pipeline.merge.rules import Rule, choose
from pipeline.merge.spec import OUT_DTYPES, MergeSpec


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
    methods: dict[str, str] = field(default_factory=dict)  # tensor name (an expert's matrix: its own) -> method

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
    return method.merge(inputs, weights.to(inputs.device), ctx, params)


def merge_state_dicts(
    models: Sequence[dict[str, torch.Tensor]],
    weights: Sequence[float] | torch.Tensor,
    rules: list[Rule],
    base: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
    device: str = "cpu",
    block_bytes: int = 1 << 30,
    config: dict | None = None,
) -> dict[str, torch.Tensor]:
    """In-memory merge (fp32 results, in the first input's layout). Without ``base`` the inputs are task
    vectors or DiLoCo pseudo-gradients and the result is their merged update: nothing is written to disk.
    With the model's ``config`` (as a dict) the tensors are read as a checkpoint's are: fused experts
    merged matrix by matrix."""
    weights = torch.as_tensor(weights, dtype=torch.float64)
    if len(weights) != len(models):
        raise ValueError(f"{len(models)} inputs but {len(weights)} weights")
    if weights.sum() <= 0 or (weights < 0).any():
        raise ValueError(f"weights must be non-negative and sum to a positive number, got {weights.tolist()}")
    weights = (weights / weights.sum()).float()
    labels = [f"input {k}" for k in range(len(models))]
    views = [ModelView(InMemory(m), config or {}) for m in models]
    theta0 = ModelView(InMemory(base), config or {}) if base is not None else None
    readers = [*views, *([theta0] if theta0 is not None else [])]
    _check_same_tensors(readers, [*labels, *(["base"] if theta0 is not None else [])])
    for rule in rules:  # a merge spec checks this when it is read; in memory (DiLoCo), here
        get_method(rule.method).check_inputs(len(models))
    workspace, out = Workspace(), {}

    def merged(piece: Piece) -> torch.Tensor:
        method, params = choose((piece.name, piece.key), rules)
        if method.needs_fisher:
            raise ValueError("the fisher method needs Fisher files: use merge_checkpoints")
        inputs = TensorInputs(
            piece.name,
            piece.shape,
            [v.reader(piece.key) for v in views],
            labels,
            base=theta0.reader(piece.key) if theta0 is not None else None,
            base_label="base",
            device=device,
            block_bytes=block_bytes,
            workspace=workspace,
        )
        return merge_tensor(method, params, inputs, weights, TensorContext(piece.name, seed))

    first = views[0]
    for name, info in first.files.info.items():
        pieces = first.layout.in_stored(name)
        if not info.dtype.is_floating_point or not pieces:
            out[name] = models[0][name].clone()  # integer buffers and unloaded tensors are copied, not merged
        else:
            out[name] = assemble(pieces, TensorInfo(info.shape, torch.float32), merged)
    return out


def _check_same_tensors(readers: Sequence[Any], labels: Sequence[str]) -> None:
    """The same tensors (keys) and shapes everywhere, whatever each input's layout; float tensors may
    differ in float dtype (merged in fp32), other tensors (integer buffers) must match exactly. Messages
    name a tensor as the input at fault stores it."""
    reference, ref_label = readers[0], labels[0]
    for reader, label in zip(readers[1:], labels[1:]):
        missing = sorted(_as_stored(reference, k) for k in reference.info.keys() - reader.info.keys())
        extra = sorted(_as_stored(reader, k) for k in reader.info.keys() - reference.info.keys())
        if missing or extra:
            raise MergeInputError(
                f"{label}: tensor names differ from {ref_label}: missing {missing[:5]}, extra {extra[:5]}"
            )
        for key, ref in reference.info.items():
            other = reader.info[key]
            floats = ref.dtype.is_floating_point and other.dtype.is_floating_point
            if other.shape != ref.shape or (other.dtype != ref.dtype and not floats):
                raise MergeInputError(
                    f"{label}: tensor {_as_stored(reader, key)} is {other.shape} {other.dtype}, "
                    f"but {ref.shape} {ref.dtype} in {ref_label}"
                )


def _as_stored(reader: Any, key: str) -> str:
    """A piece's name as ``reader``'s files spell it (its key for an adapter or a piece it lacks)."""
    layout = getattr(reader, "layout", None)
    return layout.pieces[key].name if layout is not None and key in layout.pieces else key


@dataclass(frozen=True)
class TensorMerge:
    """How one tensor is merged: the method, its parameters and the weights it sees."""

    method: MergeMethod
    params: MethodParams
    weights: torch.Tensor


TensorSettings = Callable[[Piece], TensorMerge]  # a tensor's merge, where it is not the spec's rules'


def merge_checkpoints(
    spec: MergeSpec,
    progress: bool = True,
    *,
    settings: TensorSettings | None = None,
    tokenizer_from: str | Path | None = None,
    **meta: Any,
) -> MergeReport:
    """Merge checkpoint folders as the spec says; write a loadable checkpoint atomically.
    ``settings`` overrides the spec's rules and weights tensor by tensor (a mergekit config's
    per-layer parameters); the output's tokenizer files come from ``tokenizer_from`` if given, else
    with the other side files from the first model. ``meta`` goes into the output's manifest (e.g.
    the identities of the inputs)."""
    if spec.out_format == "adapter":
        from pipeline.merge.to_adapter import merge_to_adapter

        return merge_to_adapter(spec, progress, **meta)
    start = time.perf_counter()
    run = _CheckpointMerge(spec, settings)
    report = run.report
    report.threads = torch.get_num_threads()
    with staged_dir(spec.out_path) as tmp:
        written = stream_checkpoint(
            tmp,
            run.plan,
            run.stored,
            spec.max_shard_size,
            progress="merge" if progress else None,
        )
        copy_aux_files(run.models[0].aux_files(), tmp)  # the branches' config and processor files
        if tokenizer_from is not None:
            copy_tokenizer(Path(tokenizer_from), tmp)
        if spec.out_dtype:
            name_dtype(tmp, spec.out_dtype)
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
            source=str(run.source),
            layout=run.layout.summary(),
            carried=run.layout.carried,
            **meta,
        )
    report.total_seconds = time.perf_counter() - start
    return report


class _CheckpointMerge:
    """The inputs of one merge, validated up front, and the per-tensor merge over them."""

    def __init__(self, spec: MergeSpec, settings: TensorSettings | None = None):
        self.spec, self.rules, self.weights = spec, spec.effective_rules, spec.normalized_weights()
        self.settings = settings or self._by_rules
        self.base = ModelView.open(spec.base_model) if spec.base_model else None
        like = self.base.config() if self.base is not None else None  # the model of inputs without a config.json
        self.models = [
            AdapterReader(e.adapter, self.base) if e.adapter else ModelView.open(e.path, like) for e in spec.models
        ]
        self.labels = [entry.source for entry in spec.models]
        with_fisher = all(e.fisher for e in spec.models)
        like = like or self.models[0].config()
        self.fishers = [ModelView.open(entry.fisher, like) for entry in spec.models] if with_fisher else None
        self.readers = [r for r in (self.base, *self.models) if r is not None]
        _check_same_tensors(self.readers, [str(r.path) for r in self.readers])
        if self.fishers:
            _check_fishers(self.fishers, self.models[0].info)
        self.out_dtype = OUT_DTYPES.get(spec.out_dtype) if spec.out_dtype else None
        self.theta0 = self.base or self.models[0]  # the output's layout and its carried tensors
        base_tied = self.base is not None and embeddings_tied(self.base.config())
        self.embedding = EMBEDDING if base_tied and EMBEDDING in self.base.info else None
        self.untied = self.embedding is not None and any(_own_lm_head(m) for m in self.models)
        self.info = dict(self.models[0].info)  # the output's tensors, by key
        self.layout = self.theta0.layout
        self.lm_head = None  # the untied lm_head, where θ0's files have none
        if self.untied:
            self.info.setdefault(LM_HEAD, self.info[self.embedding])
            if LM_HEAD not in self.layout.pieces:
                self.lm_head = Piece(LM_HEAD, LM_HEAD, LM_HEAD, self.info[LM_HEAD].shape, LM_HEAD)
        self.plan = {name: self._planned(name, info) for name, info in self.layout.stored.items()}
        if self.lm_head is not None:
            self.plan[LM_HEAD] = TensorInfo(self.lm_head.shape, self._dtype(self.lm_head))
        source = source_of(self.theta0.path)
        reference = dict(CheckpointReader(source).info)
        if self.lm_head is not None:  # PEFT's merged model of an untying adapter stores it
            reference[LM_HEAD] = self.plan[LM_HEAD]
        check_complete(self.plan, reference, f"merge {spec.out_path}", str(source))
        self.source = source
        self.report = MergeReport(out_path=spec.out_path)
        self.workspace = Workspace()

    def _planned(self, name: str, info: TensorInfo) -> TensorInfo:
        """A stored tensor of θ0's layout in the output: in the models' dtype (``out_dtype``), a carried one
        or an integer buffer as θ0 has it."""
        pieces = self.layout.in_stored(name)
        if not pieces or not info.dtype.is_floating_point:
            return info
        return TensorInfo(info.shape, self._dtype(pieces[0]))

    def _dtype(self, piece: Piece) -> torch.dtype:
        """The output dtype of a piece: ``out_dtype``, or the models' (the wider one if they differ)."""
        if self.out_dtype is not None:
            return self.out_dtype
        dtype = self._info(self.models[0], piece.key).dtype
        for reader in self.models[1:]:
            dtype = torch.promote_types(dtype, self._info(reader, piece.key).dtype)
        return dtype

    def piece(self, key: str) -> Piece:
        """The output's piece ``key``."""
        return self.lm_head if self.lm_head is not None and key == LM_HEAD else self.layout.pieces[key]

    def out_info(self, key: str) -> TensorInfo:
        """The output's shape and dtype of piece ``key``."""
        piece = self.piece(key)
        return TensorInfo(piece.shape, self._dtype(piece))

    def pieces(self, name: str) -> list[Piece]:
        """The pieces a stored tensor of the output is made of."""
        return [self.lm_head] if self.lm_head is not None and name == LM_HEAD else self.layout.in_stored(name)

    def stored(self, name: str) -> torch.Tensor:
        """The output's stored tensor ``name``: its pieces merged and assembled in θ0's layout, or θ0's
        own where transformers does not load it (copied unchanged)."""
        pieces = self.pieces(name)
        if not pieces:
            return self.theta0.files.get(name)
        return assemble(pieces, self.plan[name], self.merge)

    def source_key(self, reader: Any, key: str) -> str:
        """The key of ``reader`` that makes the output's ``key``: the embedding for a tied lm_head that θ0
        stores anyway, and in an untied merge for the lm_head of an input still tied (θ0's too)."""
        if key == LM_HEAD and self.embedding is not None and (not self.untied or not _own_lm_head(reader)):
            return self.embedding
        return key

    def _info(self, reader: Any, key: str) -> TensorInfo:
        """Shape and dtype of the output's ``key`` in ``reader`` (an untying adapter's lm_head, which a θ0
        stored tied does not have, is its embedding's)."""
        source = self.source_key(reader, key)
        return reader.info[source if source in reader.info else self.embedding]

    def merge(self, piece: Piece) -> torch.Tensor:
        """θ's piece. Where every input is an adapter that leaves it alone every τ_k is 0, and so is the
        merged τ of every method: θ0's tensor is copied (at 7B most of the bytes)."""
        key = piece.key
        setting = self.settings(piece)
        method = setting.method
        start, read_before = time.perf_counter(), self.report.read_seconds
        first = self.models[0]
        if not self._info(first, key).dtype.is_floating_point:  # an integer buffer: copied
            rows = first.reader(self.source_key(first, key))
            merged, method = self.report.timed(rows)(0, rows_of(piece.shape)[0]).reshape(piece.shape), None
        elif not any(m.touches(self.source_key(m, key)) for m in self.models):
            theta0 = self.base.reader(self.source_key(self.base, key))
            merged, method = self.report.timed(theta0)(0, rows_of(piece.shape)[0]).reshape(piece.shape), None
        else:
            merged = merge_tensor(
                method, setting.params, self.inputs(piece, method), setting.weights, self.context(piece)
            )
        self.report.methods[piece.name] = method.name if method else "θ0's (no input changes it)"
        self.report.compute_seconds += time.perf_counter() - start - (self.report.read_seconds - read_before)
        return merged

    def _by_rules(self, piece: Piece) -> TensorMerge:
        return TensorMerge(*choose((piece.name, piece.key), self.rules), self.weights)

    def inputs(self, piece: Piece, method: MergeMethod) -> TensorInputs:
        timed, key = self.report.timed, piece.key
        fishers = self._fishers_of(key) if method.needs_fisher else None
        return TensorInputs(
            piece.name,
            piece.shape,
            [timed(m.reader(self.source_key(m, key))) for m in self.models],
            self.labels,
            base=timed(self.base.reader(self.source_key(self.base, key))) if self.base else None,
            base_label=str(self.spec.base_model),
            device=self.spec.device,
            block_bytes=self.spec.block_mb << 20,
            workspace=self.workspace,
            fishers=fishers and [timed(f.reader(self.source_key(f, key))) for f in fishers],
            deltas=[m.is_delta(self.source_key(m, key)) for m in self.models],
        )

    def context(self, piece: Piece) -> TensorContext:
        return TensorContext(piece.name, self.spec.seed)

    def _fishers_of(self, key: str) -> list[ModelView] | None:
        """The Fisher files' values of a tensor: all of them, or none (a frozen tensor, averaged)."""
        having = [f for f in self.fishers if self.source_key(f, key) in f.info]
        if having and len(having) < len(self.fishers):
            lacking = next(f for f in self.fishers if f not in having)
            name = self.piece(key).name
            raise MergeInputError(f"{lacking.path}: no Fisher values for tensor {name}, which other Fisher files have")
        return having or None


def _own_lm_head(reader: Any) -> bool:
    """Whether an input's lm_head is a tensor of its own, not its embedding: an adapter that unties it, or a
    checkpoint (or Fisher file) that stores lm_head and does not tie it."""
    if isinstance(reader, AdapterReader):
        return reader.unties
    return LM_HEAD in reader.info and not embeddings_tied(reader.config())


def name_dtype(folder: Path, dtype: str) -> None:
    """The output's config.json naming the dtype its tensors are written in, not the branches': what
    transformers loads the model in with ``dtype="auto"`` (every sub-config's too)."""
    path = folder / "config.json"
    if not path.is_file():
        return

    def named(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        keys = ("dtype", "torch_dtype")
        return {k: dtype if k in keys and isinstance(v, str) else named(v) for k, v in node.items()}

    path.write_text(json.dumps(named(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")


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
