"""The prepared example store: what ``merit prepare`` writes once per source and every later stage
reads by index, memory-mapped.

``data/store/<source>/shard-NNNNN.arrow`` (Arrow IPC files of up to ``SHARD_ROWS`` rows, the source's
name percent-encoded): per example its record index in its origin, its messages (JSON), its image
references (JSON: a path, an archive member, a table cell, a built-in drawing; never the image's
bytes, which stay in the source files and are decoded by the loader's workers when a batch needs
them), its token ids, supervised tokens and whether it was truncated. A stage opens the shards
memory-mapped and builds an :class:`Example` only for the rows it reads, so a process holds pages
of the rows it touched plus an index array (8 bytes an example: its group's rows for a branch's
rank), never the corpus: at 24 M examples every rank of a node shares one copy in the page cache.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import torch

from pipeline.checkpoint import staged_dir
from pipeline.data import builtin
from pipeline.data.example import Example, ImageRef
from pipeline.data.formats import ArchiveImage
from pipeline.data.tables import TableImage

if TYPE_CHECKING:
    from pipeline.data.encode import Encoded

STORE_DIR = Path("data") / "store"
SHARD_ROWS = 1 << 16
WRITE_ROWS = 4096  # rows a record batch holds
SCHEMA = pa.schema(
    [
        ("index", pa.int64()),  # the record's index in its origin (what errors name)
        ("messages", pa.string()),
        ("images", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("supervised", pa.int32()),
        ("truncated", pa.bool_()),
    ]
)


def store_folder(source: str) -> Path:
    """A source's folder, relative to the run directory (hub names hold ``/`` and parentheses)."""
    return STORE_DIR / quote(source, safe="")


def image_reference(ref: ImageRef) -> dict[str, Any]:
    """What the store keeps of an image: where to read it again, never its pixels."""
    if isinstance(ref, Path):
        return {"path": str(ref)}
    if isinstance(ref, ArchiveImage):
        return {"archive": str(ref.archive), "member": ref.member}
    if isinstance(ref, TableImage):
        return ref.reference()
    if isinstance(ref, builtin.DRAWINGS):
        return {"drawing": builtin.drawing_reference(ref)}
    raise TypeError(f"an image of type {type(ref).__name__} cannot be referenced by the prepared store")


def image_from_reference(ref: dict[str, Any], origin: str) -> ImageRef:
    if "path" in ref:
        return Path(ref["path"])
    if "archive" in ref:
        return ArchiveImage(Path(ref["archive"]), ref["member"])
    if "table" in ref:
        return TableImage(ref["table"], ref["row"], ref["column"], ref["item"], origin, ref["record"])
    return builtin.drawing_from_reference(ref["drawing"])


class StoreWriter:
    """Rows appended a batch at a time, written ``WRITE_ROWS`` at a time into shards of ``SHARD_ROWS``;
    the folder appears whole or not at all. Few large record batches, not one per encoded batch: a
    reader touches each batch's header, and the kernel maps the pages around every page touched
    (64 KB), so batches of 32 rows would map the whole file into every reader."""

    def __init__(self, folder: Path):
        self.folder, self.rows = folder, 0
        self._pending: dict[str, list] = {name: [] for name in SCHEMA.names}
        self._shard: Any = None
        self._in_shard = 0

    def __enter__(self) -> StoreWriter:
        self._staged = staged_dir(self.folder)
        self._tmp = self._staged.__enter__()
        return self

    def add(self, examples: list[Example], encoded: list[Encoded]) -> None:
        pending = self._pending
        for example, enc in zip(examples, encoded, strict=True):
            pending["index"].append(example.index)
            pending["messages"].append(json.dumps(example.messages))
            pending["images"].append(json.dumps([image_reference(ref) for ref in example.images]))
            pending["input_ids"].append(enc.input_ids.to(torch.int32).numpy())
            pending["supervised"].append(enc.num_supervised)
            pending["truncated"].append(enc.truncated)
        if len(pending["index"]) >= WRITE_ROWS:
            self._flush()

    def _flush(self) -> None:
        batch = pa.RecordBatch.from_pydict(self._pending, schema=SCHEMA)
        self._pending = {name: [] for name in SCHEMA.names}
        done = 0
        while done < len(batch):
            if self._shard is None:
                self._sink = pa.OSFile(str(self._tmp / f"shard-{self.rows // SHARD_ROWS:05d}.arrow"), "wb")
                self._shard = pa.ipc.new_file(self._sink, SCHEMA)
            part = batch.slice(done, SHARD_ROWS - self._in_shard)
            self._shard.write_batch(part)
            done, self.rows, self._in_shard = done + len(part), self.rows + len(part), self._in_shard + len(part)
            if self._in_shard == SHARD_ROWS:
                self._close_shard()

    def _close_shard(self) -> None:
        self._shard.close()
        self._sink.close()
        self._shard, self._in_shard = None, 0

    def __exit__(self, *exc: Any) -> bool:
        if exc[0] is None:
            if self._pending["index"]:
                self._flush()
            if self._shard is not None:
                self._close_shard()
        elif self._shard is not None:
            self._sink.close()
        return bool(self._staged.__exit__(*exc))


class SourceStore:
    """One source's prepared rows, memory-mapped when first read (so it pickles as its folder)."""

    def __init__(self, folder: Path, source: str, origin: str):
        self.folder, self.source, self.origin = Path(folder), source, origin
        self._batches: list[pa.RecordBatch] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_batches": None}

    @property
    def batches(self) -> list[pa.RecordBatch]:
        if self._batches is None:
            readers = [pa.ipc.open_file(pa.memory_map(str(p))) for p in sorted(self.folder.glob("shard-*.arrow"))]
            self._batches = [r.get_batch(i) for r in readers for i in range(r.num_record_batches)]
            self._starts = np.cumsum([0] + [b.num_rows for b in self._batches]).tolist()
        return self._batches

    def __len__(self) -> int:
        return sum(b.num_rows for b in self.batches)

    def lengths(self) -> np.ndarray:
        """Every row's token count, from the id lists' offsets alone."""
        return np.concatenate([np.diff(_spans(b, "input_ids")[0]) for b in self.batches] or [np.zeros(0, np.int64)])

    def column_array(self, name: str) -> np.ndarray:
        """A column of numbers (4 bytes a row or less), whole."""
        parts = [b.column(name).to_numpy(zero_copy_only=False) for b in self.batches]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def example(self, row: int) -> Example:
        batches = self.batches
        number = bisect.bisect_right(self._starts, row) - 1
        batch, at = batches[number], row - self._starts[number]
        messages, images, ids = (_item(batch, name, at) for name in ("messages", "images", "input_ids"))
        index = int(np.frombuffer(batch.column("index").buffers()[1], np.int64)[batch.column("index").offset + at])
        refs = [image_from_reference(ref, self.origin) for ref in json.loads(images.tobytes())]
        tokens = torch.from_numpy(ids.astype(np.int64))
        return Example(self.source, index, self.origin, json.loads(messages.tobytes()), refs, token_ids=tokens)


def _spans(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A batch's column of lists (ids) or strings as (offsets, values): NumPy views of its buffers,
    so that reading one item touches that item's pages (pyarrow's ``.values.to_numpy()`` touches the
    whole values buffer of the batch)."""
    column = batch.column(name)
    offsets, values = column.buffers()[1], column.buffers()[-1]
    dtype = np.int32 if name == "input_ids" else np.uint8
    return np.frombuffer(offsets, np.int32)[column.offset : column.offset + len(column) + 1], np.frombuffer(
        values, dtype
    )


def _item(batch: pa.RecordBatch, name: str, at: int) -> np.ndarray:
    offsets, values = _spans(batch, name)
    return values[offsets[at] : offsets[at + 1]]


class StoredExamples(Sequence):
    """Examples read from stores by position: ``rows[i]`` of ``stores[which[i]]``. Slicing gives
    another view; nothing is read until an example is asked for."""

    def __init__(self, stores: list[SourceStore], which: np.ndarray, rows: np.ndarray):
        self.stores, self.which, self.rows = stores, which, rows

    @classmethod
    def of(cls, store: SourceStore, rows: np.ndarray) -> StoredExamples:
        return cls([store], np.zeros(len(rows), dtype=np.int32), np.asarray(rows, dtype=np.int64))

    @classmethod
    def joined(cls, parts: list[StoredExamples]) -> StoredExamples:
        stores: list[SourceStore] = []
        which, rows = [], []
        for part in parts:
            which.append(part.which + len(stores))
            rows.append(part.rows)
            stores += part.stores
        empty = np.zeros(0, dtype=np.int64)
        return cls(stores, np.concatenate(which or [empty]).astype(np.int32), np.concatenate(rows or [empty]))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return StoredExamples(self.stores, self.which[i], self.rows[i])
        return self.stores[self.which[i]].example(int(self.rows[i]))

    def __iter__(self) -> Iterator[Example]:
        return (self[i] for i in range(len(self)))

    def lengths(self) -> np.ndarray:
        """Each example's token count, in order, read from the stores' offsets."""
        out = np.zeros(len(self), dtype=np.int64)
        for number, store in enumerate(self.stores):
            mine = self.which == number
            out[mine] = store.lengths()[self.rows[mine]]
        return out
