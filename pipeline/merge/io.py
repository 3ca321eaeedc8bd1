"""Lazy, shard-by-shard tensor IO for ``save_pretrained`` folders (or single safetensors files).

:class:`CheckpointReader` opens safetensors files with ``safe_open`` (headers only) and reads
one tensor at a time, as a view of the file's memory map (no copy: a merge reads every input
byte once, from the page cache). :class:`ShardedWriter` plans the output shards from the
tensor names, shapes and dtypes before any tensor is computed, writes each shard's header
first and then every tensor's bytes as it is produced, so the writer holds one tensor at a
time whatever the shard size. :func:`stream_checkpoint` is the loop every checkpoint producer
(a merge, a DiLoCo round) runs over it. Nothing here unpickles: only safetensors is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import queue
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json")
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
VIEWABLE = {dtype for dtype in DTYPES.values() if dtype != torch.bool}  # read as memory-map views
# Bytes per write() of a merged tensor. Beside a thread running tensor operations on 2 cores, 512 MB
# written as one write() per 46 MB took 0.2-3.7 s (6 of 9 tries over 0.3 s), in 1 MB writes 0.13-0.26 s.
WRITE_PIECE = 1 << 20


class MergeInputError(ValueError):
    """An input that cannot be merged; the message names the file or tensor at fault."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def check_complete(out: dict[str, TensorInfo], reference: dict[str, TensorInfo], what: str, against: str) -> int:
    """That ``out`` holds exactly ``reference``'s tensors, in their shapes, float where they are float
    (a merge may change the float dtype, never drop, add or reshape a tensor: merge tools that know
    only a language model's names drop a vision tower or experts silently). Returns the count."""
    missing, extra = sorted(reference.keys() - out.keys()), sorted(out.keys() - reference.keys())
    wrong = sorted(
        name
        for name in reference.keys() & out.keys()
        if out[name].shape != reference[name].shape
        or out[name].dtype.is_floating_point != reference[name].dtype.is_floating_point
    )
    if missing or extra or wrong:
        raise MergeInputError(
            f"{what} would not hold {against}'s tensors: {len(missing)} missing {missing[:5]}, "
            f"{len(extra)} extra {extra[:5]}, {len(wrong)} of another shape or kind {wrong[:5]}; nothing written"
        )
    return len(out)


class CheckpointReader:
    """Tensor names, shapes and dtypes from the headers; tensor data on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = self._weight_files()
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, tuple[mmap.mmap, int, dict]] = {}  # file -> (its bytes, data start, header)
        self.location: dict[str, Path] = {}
        self.info: dict[str, TensorInfo] = {}
        for file in self.files:
            handle = self._open(file)
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name in self.location:
                    raise MergeInputError(f"{file}: tensor {name} also stored in {self.location[name]}")
                view = handle.get_slice(name)
                if view.get_dtype() not in DTYPES:
                    raise MergeInputError(f"{file}: tensor {name} has dtype {view.get_dtype()}, which cannot be merged")
                self.location[name] = file
                self.info[name] = TensorInfo(tuple(view.get_shape()), DTYPES[view.get_dtype()])

    def _weight_files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if (self.path / INDEX).is_file():
            try:
                weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise MergeInputError(f"{self.path / INDEX}: not a safetensors index ({err})") from err
            return [self.path / name for name in sorted(set(weight_map.values()))]
        if (self.path / SINGLE).is_file():
            return [self.path / SINGLE]
        found = sorted(self.path.glob("*.safetensors"))
        if not found:
            raise MergeInputError(f"{self.path}: no safetensors weights (pickled .bin files are refused)")
        return found

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as err:
                raise MergeInputError(f"{file}: cannot read safetensors ({err}); corrupt or truncated?") from err
        return self._handles[file]

    def is_delta(self, name: str) -> bool:
        """A checkpoint's tensors are a model's, never task vectors (an adapter's are: ``AdapterReader``)."""
        return False

    def touches(self, name: str) -> bool:
        """Whether this input may differ from θ0 in ``name``: a full checkpoint may differ anywhere."""
        return True

    def get(self, name: str) -> torch.Tensor:
        file = self.location[name]
        try:
            tensor = self._open(file).get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise MergeInputError(f"{file}: cannot read tensor {name} ({err})") from err
        return tensor

    def reader(self, name: str):
        """Rows ``[start, stop)`` of tensor ``name`` as stored: only those bytes are read. The rows
        are a view of the file's memory map where they can be (read-only use: a caller that writes
        to them writes to a private copy, never to the file): copying them first, as
        ``get_slice`` does, was one more pass over every input."""
        file = self.location[name]
        mapped = self._mapped(file, name)

        def rows(start: int, stop: int) -> torch.Tensor:
            if mapped is not None:
                return mapped[start:stop]
            try:
                if not self.info[name].shape:  # a scalar: one row of one entry
                    return self._open(file).get_tensor(name).reshape(1)[start:stop]
                return self._open(file).get_slice(name)[start:stop]
            except (SafetensorError, OSError) as err:
                raise MergeInputError(f"{file}: cannot read tensor {name} ({err})") from err

        return rows

    def _mapped(self, file: Path, name: str) -> torch.Tensor | None:
        """Tensor ``name`` as a view of ``file``'s memory map, or None where a view cannot be made
        (a scalar, an entry not aligned to its dtype: then ``get_slice`` copies it)."""
        info = self.info[name]
        if not math.prod(info.shape) or info.dtype not in VIEWABLE:
            return None
        if file not in self._maps:
            try:
                with open(file, "rb") as f:
                    (size,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(size))
                    # ACCESS_COPY: a private mapping, writable (torch.frombuffer wants that) without
                    # ever writing to the file; pages are shared with the page cache until written.
                    self._maps[file] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), 8 + size, header)
            except (OSError, ValueError, struct.error) as err:
                raise MergeInputError(f"{file}: cannot read safetensors ({err}); corrupt or truncated?") from err
        buffer, start, header = self._maps[file]
        begin, end = header[name]["data_offsets"]
        element = info.dtype.itemsize
        if (start + begin) % element or end - begin != math.prod(info.shape) * element:
            return None
        flat = torch.frombuffer(buffer, dtype=info.dtype, count=(end - begin) // element, offset=start + begin)
        return flat.view(info.shape)

    def config(self) -> dict:
        path = (self.path if self.path.is_dir() else self.path.parent) / "config.json"
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except json.JSONDecodeError as err:
            raise MergeInputError(f"{path}: not valid JSON ({err})") from err

    def aux_files(self) -> list[Path]:
        return [] if self.path.is_file() else aux_files(self.path)


def aux_files(folder: Path) -> list[Path]:
    """Files beside the weights that a loadable checkpoint needs (config, tokenizer, processor,
    chat template, generation config), never weights, a manifest or a hidden file (a
    verification record)."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and p.name != "manifest.json"
        and not p.name.startswith(".")
        and not p.name.endswith(WEIGHT_SUFFIXES)
    )


def plan_shards(tensors: dict[str, TensorInfo], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, order-preserving packing of tensors into shards under ``max_shard_bytes``
    (a single tensor larger than the limit gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, info in tensors.items():
        if shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += info.nbytes
    return shards


class ShardedWriter:
    """Writes planned shards into ``folder``; tensors must arrive in planned order.

    Bytes are written and hashed (sha256, for the manifest) by a background thread, so disk
    writes and hashing overlap the next tensor's merge; at most two tensors wait in the queue.
    """

    def __init__(
        self,
        folder: Path,
        tensors: dict[str, TensorInfo],
        max_shard_bytes: int,
        metadata: dict | None = None,
        stem: str = "model",
    ):
        self.folder, self.tensors = folder, tensors
        self.shards = plan_shards(tensors, max_shard_bytes)
        n = len(self.shards)
        numbered = [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.names = numbered if n > 1 else [f"{stem}.safetensors"]
        self.metadata = {"format": "pt", **(metadata or {})}
        self.order = [name for shard in self.shards for name in shard]
        self._shard_starts = {shard[0]: i for i, shard in enumerate(self.shards)}
        self._next = 0
        self.bytes_written = 0
        self.sha256: dict[str, str] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._raise_worker_error()
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected:
            raise RuntimeError(f"writer expected tensor {expected}, got {name}")
        info = self.tensors[name]
        if tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
            raise RuntimeError(f"{name}: planned {info.shape} {info.dtype}, got {tuple(tensor.shape)} {tensor.dtype}")
        self._queue.put((name, tensor.detach()))
        self._next += 1

    def _drain(self) -> None:
        file: BinaryIO | None = None
        digest = None
        stopped = False
        try:
            while (item := self._queue.get()) is not None:
                name, tensor = item
                if name in self._shard_starts:
                    self._finish_shard(file, digest)
                    file, digest = self._open_shard(self._shard_starts[name])
                data = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
                for start in range(0, data.nbytes, WRITE_PIECE):
                    file.write(data[start : start + WRITE_PIECE])
                digest.update(data)
                self.bytes_written += data.nbytes
            stopped = True
            self._finish_shard(file, digest)
        except BaseException as err:  # surfaced in the caller's thread by write() / close()
            self._error = err
            while not stopped and self._queue.get() is not None:  # unblock the producer until it stops
                pass
        finally:
            if file is not None and not file.closed:
                file.close()

    def _finish_shard(self, file: BinaryIO | None, digest) -> None:
        if file is not None:
            file.close()
            self.sha256[Path(file.name).name] = digest.hexdigest()

    def _open_shard(self, index: int) -> tuple[BinaryIO, object]:
        header, offset = {"__metadata__": self.metadata}, 0
        for name in self.shards[index]:
            info = self.tensors[name]
            header[name] = {
                "dtype": CODES[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data start to 8 bytes
        prefix = struct.pack("<Q", len(encoded)) + encoded
        file = open(self.folder / self.names[index], "wb")  # noqa: SIM115 (closed by _finish_shard)
        file.write(prefix)
        return file, hashlib.sha256(prefix)

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing {self.folder} failed: {self._error}") from self._error

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def close(self) -> list[str]:
        """Wait for the writes to finish; write the index of a sharded checkpoint."""
        self._stop()
        self._raise_worker_error()
        if self._next != len(self.order):
            raise RuntimeError(f"writer closed after {self._next} of {len(self.order)} tensors")
        if len(self.shards) > 1:
            write_index(self.folder, self.weight_map, sum(info.nbytes for info in self.tensors.values()))
        return self.names

    @property
    def weight_map(self) -> dict[str, str]:
        """Each tensor's file."""
        return {name: self.names[i] for i, shard in enumerate(self.shards) for name in shard}


@dataclass
class Streamed:
    """What :func:`stream_checkpoint` wrote."""

    sha256: dict[str, str]  # file, relative to the folder -> digest (for the manifest)
    weight_maps: dict[str, dict[str, str]]  # sub-folder ("" for the folder itself) -> tensor -> file
    bytes_written: int
    wait_seconds: float  # time the producer waited for the writer threads (disk slower than compute)


Produced = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]


def stream_checkpoint(
    folder: Path,
    plan: dict[str, TensorInfo],
    produce: Callable[[str], Produced],
    max_shard_bytes: int,
    *,
    stem: str = "model",
    side: tuple[str, dict[str, TensorInfo]] | None = None,
    progress: str | None = None,
) -> Streamed:
    """The tensors of ``plan`` computed one at a time by ``produce(name)`` and streamed into
    ``folder`` in shard order, so that one output tensor is held at a time (plus the two the
    writer thread may still be writing). With ``side = (sub, side_plan)`` a second checkpoint is
    written alongside into ``folder/sub`` (a DiLoCo global's outer momentum): ``produce`` returns
    a pair for the names of ``side_plan``, the tensor and its side tensor. ``progress`` labels a
    tqdm bar (none when None). The index of a sharded checkpoint is written; the manifest is the
    caller's."""
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(ShardedWriter(folder, plan, max_shard_bytes, stem=stem))
        sub, side_plan = side or ("", {})
        extra = None
        if side_plan:
            (folder / sub).mkdir(exist_ok=True)
            extra = stack.enter_context(ShardedWriter(folder / sub, side_plan, max_shard_bytes, stem=stem))
        waited = 0.0
        for name in tqdm(writer.order, desc=progress, unit="tensor", disable=progress is None, leave=False):
            value = produce(name)
            tensor, other = value if isinstance(value, tuple) else (value, None)
            if name in side_plan and other is None:
                raise RuntimeError(f"{name}: no {sub} tensor produced for {folder / sub}")
            began = time.perf_counter()
            writer.write(name, tensor)
            if name in side_plan:
                extra.write(name, other)
            waited += time.perf_counter() - began
        writer.close()
        streamed = Streamed(dict(writer.sha256), {"": writer.weight_map}, writer.bytes_written, waited)
        if extra is not None:
            extra.close()
            streamed.sha256 |= {f"{sub}/{file}": digest for file, digest in extra.sha256.items()}
            streamed.weight_maps[sub] = extra.weight_map
            streamed.bytes_written += extra.bytes_written
    return streamed


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """The index of a checkpoint in several files, as transformers writes and reads it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2))


def copy_aux_files(files: Iterable[Path], folder: Path) -> None:
    for file in files:
        shutil.copy2(file, folder / file.name)


TOKENIZER_FILES = (
    "tokenizer*",
    "vocab.*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
)


def tokenizer_files(folder: Path) -> list[Path]:
    """A checkpoint's tokenizer files (vocabulary, merges, special tokens, chat template)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and any(p.match(g) for g in TOKENIZER_FILES))


def copy_tokenizer(source: Path, folder: Path) -> None:
    """``folder``'s tokenizer replaced by ``source``'s."""
    if not tokenizer_files(source):
        raise MergeInputError(f"{source}: no tokenizer files to take the tokenizer from")
    for file in tokenizer_files(folder):
        file.unlink()
    copy_aux_files(tokenizer_files(source), folder)
