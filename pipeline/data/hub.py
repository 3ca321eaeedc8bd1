"""Hub data sets as sources (``format: hub``): one source per subset of a data set id, read offline.

The mixtures users train on are hub data sets whose subsets are the sources:
HuggingFaceM4/the_cauldron (50 configs), lmms-lab/LLaVA-OneVision-Data (90+). ``hf download ID
--repo-type dataset`` leaves a snapshot in the hub cache: a README whose front matter lists the
configs and their data files, and those files (parquet). Offline, ``datasets.load_dataset(ID, ...)``
does not look there (it only finds what it built in its own cache), so the snapshot is found with
``huggingface_hub`` (``local_files_only``) and its folder is what ``datasets`` loads, one config at
a time: the parquet files become memory-mapped Arrow tables in the datasets cache, built once.

Each subset's records are read column by column: the text column as Python objects, the image
column only as counts (Arrow list lengths), so an image is decoded when an example is encoded
(:class:`HubImage`), never held. Known shapes, detected from the columns (a ``columns`` mapping
renames a data set's own): the Cauldron's ``images`` + ``texts`` (a list of {user, assistant}
turns, the images before the first question), LLaVA's ``conversations`` + ``image``, ShareGPT's
``messages`` + ``images``.

Sources are named ``<entry name>/<subset>``; with ``source_column``, one per value of that column,
``<entry name>/<value>`` (``<entry name>/<subset>/<value>`` when several subsets are read).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from pipeline.config import ConfigError, SourceSpec
from pipeline.data.example import DataError, StoredImage
from pipeline.data.formats import RecordParser
from pipeline.hub import REPO_ID, dataset_snapshot, datasets_cache

SHAPES = {  # text column -> the image columns that shape may have
    "texts": ("images",),  # the Cauldron
    "conversations": ("image", "images"),  # LLaVA, LLaVA-OneVision
    "messages": ("images", "image"),  # ShareGPT
}
READ_BATCH = 512  # rows of text read at a time
VIDEO_COLUMNS = ("video", "videos")
# The data files a subset is read from: the tables datasets reads (never an archive of images beside them).
TABLES = [".parquet", ".arrow", ".jsonl", ".json", ".csv", ".tsv"]
SHARD = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.(?P<ext>\w+)")


class HubDataNotFoundError(ConfigError):
    """A hub data set, subset or split this machine's cache does not hold; names the download."""


@dataclass(frozen=True)
class HubDataset:
    """A data set's snapshot folder and the subsets (configs) its card declares, with their splits'
    file patterns; a card without configs has one, ``default``, as ``datasets`` infers it."""

    spec: SourceSpec
    folder: Path
    subsets: dict[str, dict[str, list[str]]]

    @classmethod
    def find(cls, spec: SourceSpec) -> HubDataset:
        folder = _snapshot(spec)
        return cls(spec, folder, _declared_subsets(folder))

    @property
    def links(self) -> Path | None:
        """Where a hub cache's snapshot links point (its repo's ``blobs``): image paths may resolve there."""
        return self.folder.parent.parent / "blobs" if self.folder.parent.name == "snapshots" else None

    @property
    def label(self) -> str:
        return f"{self.spec.path}@{self.folder.name[:12]}" if REPO_ID.fullmatch(self.spec.path) else self.spec.path

    def origin(self, subset: str) -> str:
        """What names the subset's records in errors and the manifest: ``ORG/NAME@<commit>:<subset>/<split>``."""
        return f"{self.label}:{subset}/{self.spec.split}"

    def wanted(self) -> list[str]:
        """The subsets the entry names, each declared by the card and with its split's files here."""
        spec = self.spec
        names = sorted(self.subsets) if spec.subsets == "all" else spec.subsets
        unknown = [s for s in names if s not in self.subsets]
        if unknown:
            raise ConfigError(
                f"source '{spec.name}': {self.label} has no subsets {unknown} (it has {len(self.subsets)}: "
                f"{', '.join(sorted(self.subsets)[:20])}{', …' if len(self.subsets) > 20 else ''})"
            )
        no_split = [s for s in names if spec.split not in self.subsets[s]]
        if no_split:
            splits = sorted({split for s in no_split for split in self.subsets[s]})
            raise ConfigError(
                f"source '{spec.name}': subsets {no_split} of {self.label} have no split '{spec.split}' ({splits})"
            )
        missing = {s: p for s in names if (p := self._absent_patterns(s))}
        if missing:
            patterns = [p for ps in missing.values() for p in ps]
            raise HubDataNotFoundError(
                f"source '{spec.name}': the files of subsets {sorted(missing)} of {self.label} are not in the "
                f"cache {self.folder}. Download them first: `{download_command(spec, self.folder, patterns)}`"
            )
        partial = {s: shards for s in names if (shards := self._absent_shards(s))}
        if partial:
            shards = sorted(f for fs in partial.values() for f in fs)
            raise HubDataNotFoundError(
                f"source '{spec.name}': subsets {sorted(partial)} of {self.label} are partly downloaded: "
                f"{len(shards)} shard(s) missing ({', '.join(shards[:5])}{', …' if len(shards) > 5 else ''}). "
                f"Download them first: `{download_command(spec, self.folder, shards)}`"
            )
        return names

    def _absent_patterns(self, subset: str) -> list[str]:
        return [p for p in self.subsets[subset][self.spec.split] if not any(self.folder.glob(p))]

    def _absent_shards(self, subset: str) -> list[str]:
        """Shards of a ``<name>-00000-of-00004.<ext>`` series (the hub's naming) that are not here."""
        present = {
            f.relative_to(self.folder).as_posix()
            for p in self.subsets[subset][self.spec.split]
            for f in self.folder.glob(p)
        }
        absent = set()
        for name in present:
            if series := SHARD.fullmatch(name):
                stem, count, ext = series["stem"], int(series["count"]), series["ext"]
                absent |= {f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(count)} - present
        return sorted(absent)

    def load(self, subset: str) -> Any:
        """The subset's split as a ``datasets.Dataset`` (memory-mapped; built once in the datasets cache).
        Its files are resolved from the card read once here and loaded by ``datasets``' packaged
        builder for their format: loading the snapshot folder by subset name would parse the whole
        card again for every subset (0.45 s each at 176 subsets: quadratic in the subsets)."""
        import datasets
        from datasets.data_files import DataFilesDict
        from datasets.load import infer_module_for_data_files

        patterns = {self.spec.split: self.subsets[subset][self.spec.split]}
        try:
            files = DataFilesDict.from_patterns(patterns, base_path=str(self.folder), allowed_extensions=TABLES)
            builder, kwargs = infer_module_for_data_files(files)
            return datasets.load_dataset(
                builder, data_files=dict(files), split=self.spec.split, cache_dir=str(datasets_cache()), **kwargs
            )
        except (ValueError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as err:
            raise DataError(self.origin(subset), None, f"cannot load it: {err}") from err


def _snapshot(spec: SourceSpec) -> Path:
    path = Path(spec.path).expanduser()
    if path.is_dir():
        return path.resolve()
    if not REPO_ID.fullmatch(spec.path):
        raise ConfigError(f"source '{spec.name}': {spec.path} is no folder and no hub data set id (ORG/NAME)")
    folder = dataset_snapshot(spec.path, spec.revision)
    if folder is None:
        where = f"revision {spec.revision} of " if spec.revision else ""
        raise HubDataNotFoundError(
            f"source '{spec.name}': {where}the data set {spec.path} is not in the Hugging Face cache. "
            f"Download it first: `{download_command(spec, None, [])}` "
            "(with HF_HOME pointing at the cache the run reads)"
        )
    return folder


def download_command(spec: SourceSpec, folder: Path | None, patterns: list[str]) -> str:
    words = ["hf", "download", spec.path, "--repo-type", "dataset"]
    if spec.revision or folder is not None:
        words += ["--revision", spec.revision or folder.name]
    for pattern in patterns:
        words += ["--include", pattern]
    return shlex.join(words)


def _declared_subsets(folder: Path) -> dict[str, dict[str, list[str]]]:
    """config -> split -> file patterns, from the card's ``configs:`` (``datasets``' own reading)."""
    from datasets.data_files import DataFilesDict, get_data_patterns, sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    readme = folder / "README.md"
    configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data) if readme.is_file() else {}
    subsets = {}
    for name, config in (configs or {"default": {}}).items():
        # As datasets reads a config: its data_files, else the data files found under its data_dir
        # (else the whole folder), both relative to that data_dir.
        where = config.get("data_dir")
        prefix = f"{where.strip('/')}/" if where else ""
        if config.get("data_files") is not None:
            patterns = sanitize_patterns(config["data_files"])
            subsets[name] = {str(split): [prefix + p for p in ps] for split, ps in patterns.items()}
            continue
        # Inferred patterns are alternatives (any may match): the files they find are the subset's.
        try:
            base = folder / where if where else folder
            found = DataFilesDict.from_patterns(get_data_patterns(str(base)), str(base), allowed_extensions=TABLES)
        except FileNotFoundError:
            raise ConfigError(f"{folder}: config '{name}' has no data files to read") from None
        subsets[name] = {
            str(split): [Path(os.path.relpath(f, folder)).as_posix() for f in files] for split, files in found.items()
        }
    return subsets


def check_hub_source(spec: SourceSpec) -> int:
    """Preflight: the number of subsets the entry reads, all in the cache (else an error naming the download)."""
    return len(HubDataset.find(spec).wanted())


class HubImage(StoredImage):
    """One image of one row, decoded when called (an :class:`~pipeline.data.example.ImageRef`), alone:
    the row's column is read undecoded (its bytes), so a row of three images decodes three, not nine.
    Its repr names it, for the example's fingerprint."""

    def __init__(self, table: Any, origin: str, row: int, position: int | None):
        self.table, self.origin, self.row, self.position = table, origin, row, position

    def _open(self) -> Image.Image:
        value = self.table[self.row][self.table.column_names[0]]
        stored = value if self.position is None else value[self.position]
        return Image.open(io.BytesIO(stored["bytes"]) if stored.get("bytes") else stored["path"])

    def _unreadable(self, err: Exception) -> DataError:
        return DataError(self.origin, self.row, f"unreadable image: {err}", "unreadable image")

    def __repr__(self) -> str:
        return f"{self.origin}#{self.row}" + ("" if self.position is None else f"[{self.position}]")


def hub_records(spec: SourceSpec) -> Iterator[tuple[str, RecordParser, Iterator[tuple[int, Any]], int]]:
    """``(source name, parser, records, their number)`` per source of a hub entry: records as the
    LLaVA and ShareGPT readers give them, ``(row, record)``, images as :class:`HubImage` (or paths in
    the snapshot)."""
    data = HubDataset.find(spec)
    subsets = data.wanted()
    for subset in subsets:
        table, origin = data.load(subset), data.origin(subset)
        if spec.columns:
            table = _renamed(table, spec.columns, origin)
        text, image = _shape(table.column_names, origin, spec.name)
        images = _Images(table, image, origin)
        rows = _rows(table, text, spec.source_column, origin)
        if spec.source_column is None:
            name = f"{spec.name}/{subset}"
            yield name, RecordParser(name, origin, data.folder, data.links), _records(rows, text, images), len(table)
            continue
        by_value: dict[str, list[tuple[int, Any]]] = defaultdict(list)
        for row, value, turns, video in rows:
            by_value[str(value)].append((row, value, turns, video))
        prefix = spec.name if len(subsets) == 1 else f"{spec.name}/{subset}"
        for value, grouped in sorted(by_value.items()):
            name = f"{prefix}/{value}"
            parser = RecordParser(name, origin, data.folder, data.links)
            yield name, parser, _records(iter(grouped), text, images), len(grouped)


def _renamed(table: Any, columns: dict[str, str], where: str) -> Any:
    absent = sorted(col for col in columns.values() if col not in table.column_names)
    if absent:
        raise DataError(where, None, f"columns {absent} of the `columns` mapping are not in {table.column_names}")
    return table.rename_columns({theirs: ours for ours, theirs in columns.items()})


def _shape(columns: list[str], origin: str, name: str) -> tuple[str, str | None]:
    """The text column and the image column (or None) of a known shape."""
    for text, image_columns in SHAPES.items():
        if text in columns:
            return text, next((c for c in image_columns if c in columns), None)
    raise DataError(
        origin,
        None,
        f"columns {columns} match no known shape (Cauldron texts + images, LLaVA conversations + image, "
        f"ShareGPT messages + images); map them in source '{name}' with `columns: {{messages: <column>, ...}}`",
    )


class _Images:
    """A subset's image column: images per row, from the Arrow column's list lengths (or validity:
    LLaVA's ``image`` holds one or none), so that no image bytes are read, and each as a HubImage,
    or, for a column of path strings, as the paths (relative to the snapshot, where the parser
    resolves them)."""

    def __init__(self, table: Any, column: str | None, origin: str):
        import pyarrow as pa
        import pyarrow.compute as pc
        from datasets import Image as ImageFeature
        from datasets import List

        self.origin, self.counts, self.table, self.single, self.paths = origin, None, None, False, None
        if column is None:
            return
        values = table.data.table.column(column)
        self.single = not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type))
        lengths = pc.cast(values.is_valid(), pa.int64()) if self.single else pc.list_value_length(values)
        self.counts = pc.fill_null(lengths, 0).to_pylist()
        item = values.type if self.single else values.type.value_type
        if pa.types.is_string(item) or pa.types.is_large_string(item):  # paths in the snapshot
            self.paths = values.to_pylist()
            return
        undecoded = ImageFeature(decode=False)
        self.table = table.select_columns([column]).cast_column(column, undecoded if self.single else List(undecoded))

    def of(self, row: int) -> list[HubImage | str]:
        n = self.counts[row] if self.counts else 0
        if self.paths is not None:
            return [p for p in ([self.paths[row]] if self.single else self.paths[row] or []) if p is not None]
        return [HubImage(self.table, self.origin, row, None if self.single else i) for i in range(n)]


def _rows(table: Any, text: str, source_column: str | None, origin: str) -> Iterator[tuple[int, Any, Any, Any]]:
    """``(row, source column value, text, video)``, read a batch of columns at a time (a video
    column's entry, which the parser refuses until videos are supported)."""
    if source_column is not None and source_column not in table.column_names:
        raise DataError(origin, None, f"source_column '{source_column}' is not a column ({table.column_names})")
    video = next((c for c in VIDEO_COLUMNS if c in table.column_names), None)
    columns = [text] + ([source_column] if source_column else []) + ([video] if video else [])
    row = 0
    for batch in table.select_columns(columns).iter(batch_size=READ_BATCH):
        absent = [None] * len(batch[text])
        values, videos = batch[source_column] if source_column else absent, batch[video] if video else absent
        for value, turns, clip in zip(values, batch[text], videos, strict=True):
            yield row, value, turns, clip
            row += 1


def _records(rows: Iterator[tuple[int, Any, Any, Any]], text: str, images: _Images) -> Iterator[tuple[int, Any]]:
    for row, _, turns, video in rows:
        refs = images.of(row)
        record = _cauldron_record(turns, refs) if text == "texts" else {text: turns, "images": refs}
        yield row, record | ({"video": video} if video else {})


def _cauldron_record(turns: Any, images: list[HubImage]) -> Any:
    """The Cauldron's [{user, assistant}] turns as a ShareGPT record, its images before the first question."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return {"messages": turns, "images": images}  # the parser names what is wrong
    messages = []
    for i, turn in enumerate(turns):
        user = turn.get("user")
        if i == 0 and isinstance(user, str) and user.count("<image>") != len(images):
            user = "<image>" * len(images) + user
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": turn.get("assistant")}]
    return {"messages": messages, "images": images}


@contextlib.contextmanager
def local_datasets() -> Iterator[None]:
    """``datasets`` reading local files only: no progress bar per subset (the prepare stage has its
    own), and none of the download-count requests it sends for every ``load_dataset`` when
    HF_HUB_OFFLINE is unset (a network call per subset, for files already here)."""
    import datasets

    shown, counts = not datasets.are_progress_bars_disabled(), datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.disable_progress_bars()
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts
        if shown:
            datasets.enable_progress_bars()
