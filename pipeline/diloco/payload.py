"""A worker's payload as the aggregator reads it: rows of Δ_k = θ − θ_k for each piece of the model the
round trains (``pipeline.merge.layout``: a tensor as transformers holds it, an expert's matrix), and the
bytes it holds.

- A dense payload (``model.safetensors``: full fine-tuning workers) holds Δ_k of every trained
  tensor as the worker holds it (fused experts (experts, out, in)), compressed as the plan says (int8
  and int4 dequantised row block by row block).
- An adapter payload (a PEFT adapter folder, ``adapter_config.json``: LoRA workers,
  :mod:`pipeline.diloco.lora`) is read through :class:`~pipeline.merge.adapter.AdapterReader`
  over θ (the same keys and τ = (alpha / r)·B A rows as an adapter merge input): Δ_k
  rows are −τ rows for an adapted tensor, θ's rows minus the stored rows for a tensor saved
  whole (``modules_to_save``).

The round's ``trained`` tensors are θ's stored tensors holding a piece the payload changes, in θ's order
(written assembled in θ's layout); a stored tensor it does not touch is θ's, bit for bit.

So every aggregating method works on Δ rows, dense whatever was sent: on ΔW, never on A and B
apart. Bytes: ``sent`` is what the payload stores (the adapter's factors: r·(m + n) numbers a
tensor), ``read`` what one pass over some tensors reads from it (and θ's rows of the tensors saved
whole), ``gradient`` the fp32 bytes of what the worker trains (all of θ's trained tensors, or the
adapter's), which data-parallel training would all-reduce every step.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pipeline.diloco.compress import SCALE_SUFFIX, dequantise_int4, row_shape
from pipeline.merge.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterReader
from pipeline.merge.inputs import Reader, rows_of
from pipeline.merge.io import CheckpointReader, MergeInputError, TensorInfo
from pipeline.merge.layout import ModelView, Piece, assemble


def delta_reader(reader: CheckpointReader, name: str, shape: tuple[int, ...]) -> Reader:
    """Rows of a worker's Δ (a tensor of ``shape``) in fp32: int8 and int4 payloads are
    dequantised row block by row block with their scales."""
    rows, dtype = reader.reader(name), reader.info[name].dtype
    if dtype not in (torch.int8, torch.uint8):
        return rows
    scales, matrix = reader.reader(name + SCALE_SUFFIX), len(shape) >= 2
    cols = row_shape(shape)[1]

    def read(start: int, stop: int) -> torch.Tensor:
        if dtype == torch.uint8:  # int4: packed rows; a vector is one packed row
            if not matrix:
                return dequantise_int4(rows(0, 1), scales(0, 1), cols)[0, start:stop]
            return dequantise_int4(rows(start, stop), scales(start, stop), cols).reshape(stop - start, *shape[1:])
        q = rows(start, stop).float()
        if not matrix:  # a vector is one row: one scale
            return q * scales(0, 1)[0]
        return q * scales(start, stop).float().reshape(-1, *[1] * (q.dim() - 1))

    return read


class _Dequantised:
    """A dense payload's tensors as stored tensors of θ's model (names and shapes as the worker holds
    them), read in fp32: int8 and int4 rows dequantised."""

    def __init__(self, reader: CheckpointReader, shapes: dict[str, tuple[int, ...]]):
        self.path, self._reader = reader.path, reader
        self.info = {name: TensorInfo(shape, torch.float32) for name, shape in shapes.items()}

    def reader(self, name: str) -> Reader:
        return delta_reader(self._reader, name, self.info[name].shape)


def trained_stored(theta: ModelView, keys: set[str], path: Path) -> list[str]:
    """θ's stored tensors that hold a piece of ``keys``, in θ's order; refused where a payload changes part
    of a stored tensor's pieces and not the rest (no worker trains part of one tensor)."""
    trained = []
    for name in theta.layout.stored:
        pieces = {p.key for p in theta.layout.in_stored(name)}
        if pieces & keys and not pieces <= keys:
            raise MergeInputError(f"{path}: changes {len(pieces & keys)} of the {len(pieces)} pieces of {name}")
        if pieces & keys:
            trained.append(name)
    return trained


class DensePayload:
    """Δ_k of every trained tensor, as the worker computed and compressed it."""

    lora = False

    def __init__(self, folder: str | Path, theta: ModelView):
        self.path, self.theta, self.reader = Path(folder), theta, CheckpointReader(folder)
        loaded = theta.loaded()
        names = [n for n in self.reader.info if not n.endswith(SCALE_SUFFIX)]
        for name in names:
            if name not in loaded:
                raise MergeInputError(f"{self.path}: tensor {name} is not in {theta.path}")
        self.view = ModelView(_Dequantised(self.reader, {n: loaded[n].shape for n in names}), theta.config(), folder)
        self.trained = trained_stored(theta, set(self.view.info), self.path)
        self.whole: list[str] = []

    def delta(self, key: str) -> Reader:
        return self.view.reader(key)

    @property
    def sent(self) -> int:
        return sum(i.nbytes for i in self.reader.info.values())

    def read(self, names: set[str]) -> int:
        """Bytes one pass over θ's stored tensors ``names`` reads of this payload."""
        loaded = {p.loaded for n in names for p in self.theta.layout.in_stored(n)}
        return sum(i.nbytes for n, i in self.reader.info.items() if n.split(SCALE_SUFFIX)[0] in loaded)

    @property
    def gradient(self) -> int:
        return sum(4 * math.prod(i.shape) for i in self.view.files.info.values())


class AdapterPayload:
    """A LoRA worker's adapter over θ (the global it was trained on): Δ_k = −(alpha / r)·B A per
    adapted tensor, θ − θ_k per tensor saved whole."""

    lora = True

    def __init__(self, folder: str | Path, theta: ModelView):
        self.path, self.theta = Path(folder), theta
        self.adapter = AdapterReader(folder, base=theta)
        if self.adapter.unties:  # its lm_head would be a tensor the global does not have
            raise MergeInputError(f"{self.path}: saves lm_head or the embedding whole, untying θ's tied lm_head")
        self.stored = CheckpointReader(self.path / ADAPTER_WEIGHTS).info
        self.trained = trained_stored(theta, {k for k in theta.info if self.adapter.touches(k)}, self.path)
        self.whole = [k for k in theta.info if self.adapter.touches(k) and not self.adapter.is_delta(k)]

    def delta(self, key: str) -> Reader:
        rows = self.adapter.reader(key)
        if self.adapter.is_delta(key):
            return lambda start, stop: rows(start, stop).neg_()
        theta = self.theta.reader(key)
        # Out of place: safetensors' rows share the file's memory map with every later read.
        return lambda start, stop: theta(start, stop).float() - rows(start, stop).float()

    @property
    def sent(self) -> int:
        return sum(i.nbytes for i in self.stored.values())

    def read(self, names: set[str]) -> int:
        """Bytes one pass over θ's stored tensors ``names`` reads of this adapter (and of θ, for the
        tensors it saves whole)."""
        keys = {p.key for n in names for p in self.theta.layout.in_stored(n)}
        stored = sum(self.stored[k].nbytes for k in {k for key in keys for k in self.adapter.keys(key)})
        return stored + sum(self.theta.info[k].nbytes for k in self.whole if k in keys)

    @property
    def gradient(self) -> int:
        return sum(4 * math.prod(i.shape) for i in self.stored.values())


Payload = DensePayload | AdapterPayload


def stored_delta(payload: Payload, name: str, device: str = "cpu") -> torch.Tensor:
    """A payload's Δ of θ's stored tensor ``name``, whole, in fp32 on ``device``, in θ's layout."""
    info = TensorInfo(payload.theta.layout.stored[name].shape, torch.float32)

    def piece(p: Piece) -> torch.Tensor:
        return payload.delta(p.key)(0, rows_of(p.shape)[0]).to(device, torch.float32).reshape(p.shape)

    return assemble(payload.theta.layout.in_stored(name), info, piece, device)


def open_payload(folder: str | Path, theta: ModelView) -> Payload:
    """A published payload over θ, the global its worker trained from: an adapter folder or a
    dense Δ."""
    kind = AdapterPayload if (Path(folder) / ADAPTER_CONFIG).is_file() else DensePayload
    return kind(folder, theta)
