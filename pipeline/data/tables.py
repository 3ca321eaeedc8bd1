"""Table files read in place: a hub subset's parquet shards, a ``datasets`` folder's Arrow files.

Prepare streams them a batch of rows at a time (:func:`batches`); later stages read one image cell
by its file and row (:class:`TableImage`), so that no stage copies a subset (its image bytes
included) anywhere: FineVision's 5 TB stay where ``hf download`` put them. A parquet file is read by
row groups (the smallest unit it can be read in: 100 rows of images in the files ``datasets``
writes), the last few kept per process, so the loader's workers decode an image for a few
milliseconds of reading; an Arrow file is memory-mapped and read without a copy.
"""

from __future__ import annotations

import bisect
import functools
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from pipeline.data.example import DataError, StoredImage

ROW_GROUPS_KEPT = 4  # per process: the image cells of a few row groups


def is_table(path: Path) -> bool:
    return path.suffix in (".parquet", ".arrow")


def schema(path: Path) -> pa.Schema:
    return pq.read_schema(path) if path.suffix == ".parquet" else _arrow(str(path)).schema


def num_rows(path: Path) -> int:
    return pq.ParquetFile(path).metadata.num_rows if path.suffix == ".parquet" else _arrow(str(path)).num_rows


def batches(path: Path, columns: list[str], rows: int) -> Iterator[pa.RecordBatch]:
    """The file's ``columns``, ``rows`` rows at a time, never the whole file in memory."""
    if path.suffix == ".parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=rows, columns=columns)
    else:
        yield from _arrow(str(path)).select(columns).to_batches(max_chunksize=rows)


def cell(path: str, row: int, column: str) -> Any:
    """One value of one row, as Python objects."""
    if path.endswith(".parquet"):
        starts = _row_group_starts(path)
        group = bisect.bisect_right(starts, row) - 1
        return _row_group(path, group, column)[row - starts[group]].as_py()
    return _arrow(path).column(column)[row].as_py()


@functools.cache
def _arrow(path: str) -> pa.Table:
    """An Arrow file (``datasets``' stream format, or the IPC file format), memory-mapped."""
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.memory_map(path)).read_all()


@functools.cache
def _row_group_starts(path: str) -> list[int]:
    meta = pq.ParquetFile(path).metadata
    starts = [0]
    for group in range(meta.num_row_groups):
        starts.append(starts[-1] + meta.row_group(group).num_rows)
    return starts[:-1]


@functools.lru_cache(maxsize=ROW_GROUPS_KEPT)
def _row_group(path: str, group: int, column: str) -> pa.ChunkedArray:
    return pq.ParquetFile(path).read_row_group(group, columns=[column]).column(0)


class TableImage(StoredImage):
    """One image of one row of a table file, decoded when called (an
    :class:`~pipeline.data.example.ImageRef`). ``item``: its position in a list column (None: a
    column of one image). ``record`` names the row in errors (its index in the whole subset).
    Prepare hands it the bytes it already read (``data``, never stored or pickled)."""

    def __init__(
        self, path: str, row: int, column: str, item: int | None, origin: str, record: int, data: bytes | None = None
    ):
        self.path, self.row, self.column, self.item = path, row, column, item
        self.origin, self.record, self.data = origin, record, data

    def _open(self) -> Image.Image:
        data = self.data
        if data is None:
            value = cell(self.path, self.row, self.column)
            value = value if self.item is None else value[self.item]
            data = value["bytes"]
        return Image.open(io.BytesIO(data))

    def _unreadable(self, err: Exception) -> DataError:
        where = f"{Path(self.path).name} row {self.row}"  # the shard and its row, beside the subset's row
        return DataError(self.origin, self.record, f"unreadable image ({where}): {err}", "unreadable image")

    def reference(self) -> dict[str, Any]:
        """What the prepared store keeps of it (:func:`pipeline.data.store.image_reference`)."""
        return {"table": self.path, "row": self.row, "column": self.column, "item": self.item, "record": self.record}

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"data": None}

    def __repr__(self) -> str:
        return f"{self.origin}#{self.record}" + ("" if self.item is None else f"[{self.item}]")
