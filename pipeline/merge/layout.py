"""A checkpoint's tensors as the model holds them, whatever their layout on disk, and back.

Checkpoints of one model differ in how they store its tensors: Qwen2.5-VL's say ``model.layers.…`` where its
modules say ``model.language_model.layers.…``; Qwen3.5-MoE's hub files fuse each layer's experts into
``mlp.experts.gate_up_proj`` (experts, 2 × inter, hidden), which ``save_pretrained`` writes one matrix per
expert; Qwen3-VL-MoE's hub files store each expert (in, out), transposed as it loads; Qwen3.5's ``mtp.*`` head
is stored and never loaded. A :class:`Layout` maps a checkpoint's stored tensors onto **pieces**: the model's
tensors under its modules' names (the *key*), every expert's gate, up and down matrix a piece of its own,
(out, in), keyed ``…mlp.experts.<e>.gate_proj.weight`` however it is stored. Two checkpoints of one model in
different layouts have the same pieces, key for key, shape for shape; stored tensors the model does not load
(the family's ``unloaded`` globs) are **carried**: never read as the model, copied unchanged.

So every stage reads the model by key through a :class:`ModelView` and writes a checkpoint in the stored layout
of its source (:func:`assemble` puts pieces back into a stored tensor; carried tensors are copied from the
source): a merge's result as transformers loads it does not depend on how θ0 and the branches were stored, and
what a stage writes is what its source was, name for name, shape for shape, ``mtp.*`` included.

A layout is decided from the tensors' names and shapes and the checkpoint's ``config.json`` (a fused expert
tensor is transposed where transformers would transpose it: its shape is the loaded one's reversed, and the
family's hub stores it so), never by building the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.merge.io import CheckpointReader, MergeInputError, TensorInfo
from pipeline.models.families import Experts, Family, declared_family

Reader = Callable[[int, int], torch.Tensor]  # rows [start, stop) of a tensor (its first dimension)

FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
ONE_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_OF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


@dataclass(frozen=True)
class Slot:
    """Where a matrix sits in a fused expert tensor: row ``expert`` of its first dimension (an expert's
    matrix, ``matrix`` as stored), rows ``rows`` of it as (out, in) (gate and up are halves of
    ``gate_up_proj``), stored (in, out) when ``transposed``."""

    expert: int
    matrix: tuple[int, int]
    rows: tuple[int, int] | None = None
    transposed: bool = False

    def of(self, block: torch.Tensor) -> torch.Tensor:
        """The matrix in ``block``, rows [expert, expert + 1) of the fused tensor (any shape of those
        entries): a view where ``block`` is contiguous (write into it to assemble the fused tensor)."""
        matrix = block.reshape(self.matrix)
        matrix = matrix.T if self.transposed else matrix
        return matrix if self.rows is None else matrix[self.rows[0] : self.rows[1]]


@dataclass(frozen=True)
class Piece:
    """One tensor of the model as loaded, or one expert's matrix, and where it is stored."""

    key: str  # as the modules name it; an expert's matrix ``…mlp.experts.<e>.<proj>.weight``
    name: str  # as this checkpoint spells it (an expert's matrix: the per-expert spelling)
    stored: str  # the stored tensor holding it
    shape: tuple[int, ...]
    loaded: str  # the tensor transformers holds it in (the key, but for an expert's matrix)
    slot: Slot | None = None  # where in ``stored`` (None: all of it)
    loaded_slot: Slot | None = None  # where in ``loaded`` (None: all of it)

    def reader(self, rows: Reader) -> Reader:
        """Rows of this piece, from a reader of its stored tensor's rows: an expert's matrix reads its one
        row of the fused tensor (a view of a memory map reads no other byte)."""
        if self.slot is None:
            return rows
        e, slot = self.slot.expert, self.slot
        return lambda start, stop: slot.of(rows(e, e + 1))[start:stop]


@dataclass
class Layout:
    """A checkpoint's stored tensors and the pieces they hold, in stored order."""

    stored: dict[str, TensorInfo]
    pieces: dict[str, Piece]  # by key
    carried: list[str]  # stored, not loaded
    experts: str | None = None  # how experts are stored: "fused", "fused_in_out", "per_expert"; None: none
    # The tensors transformers holds (fused experts (experts, out, in)), in their first piece's dtype
    loaded: dict[str, TensorInfo] = field(init=False, repr=False)
    _of_stored: dict[str, list[Piece]] = field(init=False, repr=False)
    _of_loaded: dict[str, list[Piece]] = field(init=False, repr=False)

    def __post_init__(self):
        self._of_stored, self._of_loaded, self.loaded = {}, {}, {}
        for piece in self.pieces.values():
            self._of_stored.setdefault(piece.stored, []).append(piece)
            self._of_loaded.setdefault(piece.loaded, []).append(piece)
            slot, dtype = piece.loaded_slot, self.stored[piece.stored].dtype
            if slot is None:
                self.loaded[piece.loaded] = TensorInfo(piece.shape, dtype)
                continue
            experts, rows = self.loaded[piece.loaded].shape[:2] if piece.loaded in self.loaded else (0, 0)
            top = slot.rows[1] if slot.rows else piece.shape[0]  # gate and up: halves of the rows
            shape = (max(experts, slot.expert + 1), max(rows, top), piece.shape[1])
            self.loaded[piece.loaded] = TensorInfo(shape, dtype)

    def in_stored(self, name: str) -> list[Piece]:
        """The pieces stored tensor ``name`` holds (none: a carried tensor)."""
        return self._of_stored.get(name, [])

    def in_loaded(self, name: str) -> list[Piece]:
        """The pieces of the tensor transformers holds as ``name``."""
        return self._of_loaded.get(name, [])

    def summary(self) -> str:
        """The layout in words, for logs, manifests and reports."""
        parts = [f"{len(self.stored)} tensors"]
        parts += [EXPERT_STYLES[self.experts]] if self.experts else []
        if self.carried:
            parts.append(f"{len(self.carried)} tensors transformers does not load ({_globs(self.carried)}), carried")
        return ", ".join(parts)


EXPERT_STYLES = {
    "fused": "experts fused (experts, out, in)",
    "fused_in_out": "experts fused (experts, in, out)",
    "per_expert": "experts one matrix each",
}


def _globs(names: list[str]) -> str:
    """Names by their first part: ``mtp.*``."""
    return ", ".join(sorted({name.split(".")[0] + ".*" for name in names}))


def layout_of(stored: Mapping[str, TensorInfo], config: Mapping[str, Any]) -> Layout:
    """The layout of tensors ``stored`` (name -> shape and dtype) of a checkpoint whose ``config.json`` is
    ``config``; each stored name a piece of its own where no family declares the model type."""
    family = declared_family(dict(config))
    pieces: dict[str, Piece] = {}
    carried, styles = [], set()
    for name, info in stored.items():
        if family is None:
            found = [Piece(name, name, name, info.shape, name)]
        elif family.is_unloaded(name):
            carried.append(name)
            continue
        elif family.experts is not None and (fused := FUSED.match(name)):
            found, style = _fused_pieces(name, fused, info, family, config)
            styles.add(style)
        else:
            found = [_whole_piece(name, info, family, config)]
            styles |= {"per_expert"} if found[0].loaded_slot is not None else set()
        for piece in found:
            if piece.key in pieces:
                raise MergeInputError(
                    f"tensors {pieces[piece.key].stored} and {name} both hold the model's {piece.key}"
                )
            pieces[piece.key] = piece
    if len(styles) > 1:
        raise MergeInputError(f"experts stored in several layouts at once ({sorted(styles)})")
    return Layout(dict(stored), pieces, carried, styles.pop() if styles else None)


def _whole_piece(name: str, info: TensorInfo, family: Family, config: Mapping[str, Any]) -> Piece:
    key = family.module_name(name)
    one = ONE_EXPERT.match(key) if family.experts is not None else None
    if one is None:
        return Piece(key, name, name, info.shape, key)
    if not family.experts.one_by_one:
        raise MergeInputError(
            f"tensor {name}: transformers does not load {family.model_type} experts stored one matrix each"
        )
    inter, hidden = Experts.dims(dict(config))
    rows = {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}.get(one["proj"])
    loaded, matrix = f"{one['prefix']}.{FUSED_OF[one['proj']]}", (2 * inter, hidden) if rows else (hidden, inter)
    return Piece(key, name, name, info.shape, loaded, loaded_slot=Slot(int(one["e"]), matrix, rows))


def _fused_pieces(
    name: str, fused: re.Match, info: TensorInfo, family: Family, config: Mapping[str, Any]
) -> tuple[list[Piece], str]:
    """The expert matrices of a fused tensor, and whether it is stored as loaded or each expert (in, out)
    (as transformers decides: by its shape against the loaded one's)."""
    inter, hidden = Experts.dims(dict(config))
    gate_up = fused["proj"] == "gate_up_proj"
    loaded = (2 * inter, hidden) if gate_up else (hidden, inter)
    matrix = tuple(info.shape[1:])
    if len(info.shape) == 3 and matrix == loaded:
        transposed = False
    elif len(info.shape) == 3 and family.experts.transposed and matrix == loaded[::-1]:
        transposed = True
    else:
        also = f" or (experts, {loaded[1]}, {loaded[0]})" if family.experts.transposed else ""
        raise MergeInputError(
            f"tensor {name} is {tuple(info.shape)}: a {family.model_type} model with moe_intermediate_size {inter} "
            f"and hidden_size {hidden} loads it as (experts, {loaded[0]}, {loaded[1]}){also}"
        )
    parts = {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)} if gate_up else {"down_proj": None}
    prefix, key_prefix = fused["prefix"], family.module_name(fused["prefix"])
    pieces = []
    for e in range(info.shape[0]):
        for proj, rows in parts.items():
            shape = (rows[1] - rows[0], hidden) if rows else loaded
            pieces.append(
                Piece(
                    key=f"{key_prefix}.{e}.{proj}.weight",
                    name=f"{prefix}.{e}.{proj}.weight",
                    stored=name,
                    shape=shape,
                    slot=Slot(e, matrix, rows, transposed),
                    loaded=family.module_name(name),
                    loaded_slot=Slot(e, loaded, rows),
                )
            )
    return pieces, "fused_in_out" if transposed else "fused"


def assemble(
    pieces: list[Piece], info: TensorInfo, value: Callable[[Piece], torch.Tensor], device: str | torch.device = "cpu"
) -> torch.Tensor:
    """The stored tensor ``info`` made of ``pieces`` (all of its pieces), ``value(piece)`` each, on ``device``
    where it has several pieces (a whole tensor stays where ``value`` made it)."""
    if len(pieces) == 1 and pieces[0].slot is None:
        return value(pieces[0]).reshape(info.shape).to(info.dtype)
    out = torch.empty(info.shape, dtype=info.dtype, device=device)
    for piece in pieces:
        e = piece.slot.expert
        piece.slot.of(out[e : e + 1]).copy_(value(piece).reshape(piece.shape))
    return out


class Stored(Protocol):
    """Stored tensors read lazily: a checkpoint's files (:class:`CheckpointReader`), tensors in memory
    (:class:`InMemory`), a DiLoCo payload's dequantised rows."""

    info: dict[str, TensorInfo]

    def reader(self, name: str) -> Reader: ...


class InMemory:
    """Tensors in memory as :class:`Stored` (a model's state dict: the layout transformers holds)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.info = {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in tensors.items()}

    def reader(self, name: str) -> Reader:
        tensor = self.tensors[name]
        flat = tensor.reshape(tensor.shape[0], -1) if tensor.dim() else tensor.reshape(1, 1)
        return lambda start, stop: flat[start:stop]

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class ModelView:
    """A checkpoint's pieces by key: ``info`` (the pieces' shapes, their stored dtype), ``reader(key)``
    (rows), ``get(key)``; ``loaded()`` and ``get_loaded(name)`` give the tensors as transformers holds them
    (a fused expert tensor assembled from its pieces). The interface of a merge input
    (:mod:`pipeline.merge.driver`), as :class:`pipeline.merge.adapter.AdapterReader`'s."""

    def __init__(self, files: Stored, config: Mapping[str, Any], path: str | Path | None = None):
        self.files, self._config = files, dict(config)
        self.path = Path(path) if path is not None else Path(getattr(files, "path", "(in memory)"))
        self.layout = layout_of(files.info, self._config)
        self.family = declared_family(self._config)
        self.info = {key: TensorInfo(p.shape, files.info[p.stored].dtype) for key, p in self.layout.pieces.items()}

    @classmethod
    def open(cls, path: str | Path, config: Mapping[str, Any] | None = None) -> ModelView:
        """A checkpoint folder (or safetensors file), read as the model its ``config.json`` names, or where
        it has none (a bare safetensors file, Fisher values) as ``config``'s."""
        files = CheckpointReader(path)
        return cls(files, files.config() or config or {}, path)

    def key(self, name: str) -> str:
        """A tensor name as the modules spell it (an adapter's, a stored one): the key of its piece."""
        return self.family.module_name(name) if self.family is not None else name

    def reader(self, key: str) -> Reader:
        piece = self.layout.pieces[key]
        return piece.reader(self.files.reader(piece.stored))

    def get(self, key: str) -> torch.Tensor:
        shape = self.info[key].shape
        return self.reader(key)(0, shape[0] if shape else 1).reshape(shape)

    def loaded(self) -> dict[str, TensorInfo]:
        return self.layout.loaded

    def get_loaded(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as transformers holds it (a fused expert tensor (experts, out, in))."""
        pieces = self.layout.in_loaded(name)
        if not pieces:
            raise KeyError(f"{self.path}: no tensor {name}")
        info = self.layout.loaded[name]
        if pieces[0].loaded_slot is None:
            return self.get(pieces[0].key)
        out = torch.empty(info.shape, dtype=info.dtype)
        for piece in pieces:
            e = piece.loaded_slot.expert
            piece.loaded_slot.of(out[e : e + 1]).copy_(self.get(piece.key))
        return out

    def is_delta(self, key: str) -> bool:
        """A model's tensors are the model's, never task vectors (an adapter's are)."""
        return False

    def touches(self, key: str) -> bool:
        """Whether this input may differ from θ0 in ``key``: a full checkpoint may differ anywhere."""
        return True

    def config(self) -> dict[str, Any]:
        return self._config

    def aux_files(self) -> list[Path]:
        return self.files.aux_files() if isinstance(self.files, CheckpointReader) else []


def restyled(loaded: Mapping[str, TensorInfo], config: Mapping[str, Any], experts: str | None = None) -> Layout:
    """The layout in which the hub's checkpoints of ``config``'s family store the tensors transformers holds
    (``loaded``: name -> shape and dtype): its spelling of the names, its experts' storage, or ``experts``
    ("fused", "fused_in_out", "per_expert")."""
    family = declared_family(dict(config))
    if family is None:
        return layout_of(loaded, config)
    style = experts or (family.experts.hub if family.experts else None)
    stored: dict[str, TensorInfo] = {}
    for name, info in loaded.items():
        fused = FUSED.match(name) if family.experts is not None else None
        base = family.stored_name(name)
        if fused is None or style == "fused":
            stored[base] = info
        elif style == "fused_in_out":
            stored[base] = TensorInfo((info.shape[0], info.shape[2], info.shape[1]), info.dtype)
        else:
            prefix = family.stored_name(fused["prefix"])
            projs = ("gate_proj", "up_proj") if fused["proj"] == "gate_up_proj" else ("down_proj",)
            rows = info.shape[1] // len(projs)
            for e in range(info.shape[0]):
                for proj in projs:
                    stored[f"{prefix}.{e}.{proj}.weight"] = TensorInfo((rows, info.shape[2]), info.dtype)
    return layout_of(stored, config)
