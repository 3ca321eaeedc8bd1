"""A worker's payload as the aggregator reads it: rows of Δ_k = θ − θ_k for each tensor the
round trains, and the bytes it holds.

- A dense payload (``model.safetensors``: full fine-tuning workers) holds Δ_k of every trained
  tensor, compressed as the plan says (int8 and int4 dequantised row block by row block).
- An adapter payload (a PEFT adapter folder, ``adapter_config.json``: LoRA workers,
  :mod:`pipeline.diloco.lora`) is read through :class:`~pipeline.merge.adapter.AdapterReader`
  over θ (the same name mapping and τ = (alpha / r)·B A rows as an adapter merge input): Δ_k
  rows are −τ rows for an adapted tensor, θ's rows minus the stored rows for a tensor saved
  whole (``modules_to_save``). The round's trained tensors are those the adapter touches, in θ's
  order; a tensor it does not touch is θ's, bit for bit.

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
from pipeline.merge.inputs import Reader
from pipeline.merge.io import CheckpointReader, MergeInputError


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


class DensePayload:
    """Δ_k of every trained tensor, as the worker computed and compressed it."""

    lora = False

    def __init__(self, folder: str | Path, theta: CheckpointReader):
        self.path, self.theta, self.reader = Path(folder), theta, CheckpointReader(folder)
        self.trained = [n for n in self.reader.info if not n.endswith(SCALE_SUFFIX)]
        for name in self.trained:
            if name not in theta.info:
                raise MergeInputError(f"{self.path}: tensor {name} is not in {theta.path}")
        self.whole: list[str] = []

    def delta(self, name: str) -> Reader:
        return delta_reader(self.reader, name, self.theta.info[name].shape)

    @property
    def sent(self) -> int:
        return sum(i.nbytes for i in self.reader.info.values())

    def read(self, names: set[str]) -> int:
        return sum(i.nbytes for n, i in self.reader.info.items() if n.split(SCALE_SUFFIX)[0] in names)

    @property
    def gradient(self) -> int:
        return sum(4 * math.prod(self.theta.info[n].shape) for n in self.trained)


class AdapterPayload:
    """A LoRA worker's adapter over θ (the global it was trained on): Δ_k = −(alpha / r)·B A per
    adapted tensor, θ − θ_k per tensor saved whole."""

    lora = True

    def __init__(self, folder: str | Path, theta: CheckpointReader):
        self.path, self.theta = Path(folder), theta
        self.adapter = AdapterReader(folder, base=theta)
        if self.adapter.unties:  # its lm_head would be a tensor the global does not have
            raise MergeInputError(f"{self.path}: saves lm_head or the embedding whole, untying θ's tied lm_head")
        self.stored = CheckpointReader(self.path / ADAPTER_WEIGHTS).info
        self.trained = [n for n in theta.info if self.adapter.touches(n)]
        self.whole = [n for n in self.trained if not self.adapter.is_delta(n)]

    def delta(self, name: str) -> Reader:
        rows = self.adapter.reader(name)
        if self.adapter.is_delta(name):
            return lambda start, stop: rows(start, stop).neg_()
        theta = self.theta.reader(name)
        # Out of place: safetensors' rows share the file's memory map with every later read.
        return lambda start, stop: theta(start, stop).float() - rows(start, stop).float()

    @property
    def sent(self) -> int:
        return sum(i.nbytes for i in self.stored.values())

    def read(self, names: set[str]) -> int:
        stored = sum(self.stored[k].nbytes for n in names for k in self.adapter.keys(n))
        return stored + sum(self.theta.info[n].nbytes for n in self.whole if n in names)

    @property
    def gradient(self) -> int:
        return sum(4 * math.prod(i.shape) for i in self.stored.values())


Payload = DensePayload | AdapterPayload


def open_payload(folder: str | Path, theta: CheckpointReader) -> Payload:
    """A published payload over θ, the global its worker trained from: an adapter folder or a
    dense Δ."""
    kind = AdapterPayload if (Path(folder) / ADAPTER_CONFIG).is_file() else DensePayload
    return kind(folder, theta)
