"""Hub data sets as sources (``format: hub``): one source per subset of a data set id, read offline.

The mixtures users train on are hub data sets whose subsets are the sources:
HuggingFaceM4/the_cauldron (50 configs), lmms-lab/LLaVA-OneVision-Data (90+). ``hf download ID
--repo-type dataset`` leaves a snapshot in the hub cache: a README whose front matter lists the
configs and their data files, and those files (parquet). Offline, ``datasets.load_dataset(ID, ...)``
does not look there (it only finds what it built in its own cache), so the snapshot is found with
``huggingface_hub`` (``local_files_only``) and its card is read once for every subset's files.

A subset's parquet files are read in place, a batch of rows at a time (:class:`SubsetTable`): never
copied into the ``datasets`` cache (FineVision's 5 TB would take 5 TB more), never whole in memory.
Each image becomes a :class:`~pipeline.data.tables.TableImage` (its file, row and column), whose
header prepare reads from the bytes at hand and which the loader's workers decode when a batch
needs it. Known shapes, detected from the columns (a ``columns`` mapping
renames a data set's own): the Cauldron's ``images`` + ``texts`` (a list of {user, assistant}
turns, the images before the first question), LLaVA's ``conversations`` + ``image``, ShareGPT's
``messages`` + ``images``.

Sources are named ``<entry name>/<subset>``; with ``source_column``, one per value of that column,
``<entry name>/<value>`` (``<entry name>/<subset>/<value>`` when several subsets are read).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.config import ConfigError, SourceSpec
from pipeline.data.example import DataError
from pipeline.data.formats import RecordParser
from pipeline.data.tables import TableImage, batches, is_table, num_rows, schema
from pipeline.hub import REPO_ID, dataset_snapshot, datasets_cache, hub_access

SHAPES = {  # text column -> the image columns that shape may have
    "texts": ("images",),  # the Cauldron
    "conversations": ("image", "images"),  # LLaVA, LLaVA-OneVision
    "messages": ("images", "image"),  # ShareGPT
}
READ_BATCH = 64  # rows read at a time (their image bytes with them)
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

    @property
    def named(self) -> list[str]:
        """The subsets the entry names (``all``: every one the card declares)."""
        return sorted(self.subsets) if self.spec.subsets == "all" else self.spec.subsets

    def wanted(self) -> list[str]:
        """The subsets the entry names, each declared by the card and with its split's files here."""
        spec, names = self.spec, self.named
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

    def data_files(self, subset: str) -> list[Path]:
        """The files of the subset's split that are here."""
        return sorted({f for p in self.subsets[subset][self.spec.split] for f in self.folder.glob(p)})

    def _absent_shards(self, subset: str) -> list[str]:
        """Shards of a ``<name>-00000-of-00004.<ext>`` series (the hub's naming) that are not here."""
        present = {f.relative_to(self.folder).as_posix() for f in self.data_files(subset)}
        absent = set()
        for name in present:
            if series := SHARD.fullmatch(name):
                stem, count, ext = series["stem"], int(series["count"]), series["ext"]
                absent |= {f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(count)} - present
        return sorted(absent)

    def files(self, subset: str) -> list[Path]:
        """The subset's split's table files, read in place: its parquet (or Arrow) files where the
        snapshot holds them. A subset of JSON or CSV files (text, and images as paths) is converted
        once by ``datasets``' packaged builder for its format, and its cache's Arrow files are read.
        The files are resolved from the card read once here: loading the snapshot folder by subset
        name would parse the whole card again for every subset (0.45 s each at 176 subsets)."""
        import datasets
        from datasets.data_files import DataFilesDict
        from datasets.load import infer_module_for_data_files

        patterns = {self.spec.split: self.subsets[subset][self.spec.split]}
        try:
            files = DataFilesDict.from_patterns(patterns, base_path=str(self.folder), allowed_extensions=TABLES)
            paths = [Path(f) for f in files[self.spec.split]]
            if all(is_table(p) for p in paths):
                return paths
            builder, kwargs = infer_module_for_data_files(files)
            with local_datasets():
                dataset = datasets.load_dataset(
                    builder, data_files=dict(files), split=self.spec.split, cache_dir=str(datasets_cache()), **kwargs
                )
            return [Path(f["filename"]) for f in dataset.cache_files]
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
            f"(with HF_HOME pointing at the cache the run reads){hub_access(spec.path, 'dataset')}"
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


def subset_records(data: HubDataset, subset: str) -> Iterator[tuple[str, RecordParser, Iterator[tuple[int, Any]], int]]:
    """``(source name, parser, records, their number)`` per source of one subset: records as the
    LLaVA and ShareGPT readers give them, ``(row, record)``, images as
    :class:`~pipeline.data.tables.TableImage` (or paths in the snapshot), streamed from the files."""
    spec, origin = data.spec, data.origin(subset)
    table = SubsetTable(data.files(subset), spec.columns, origin, spec.name)
    if spec.source_column is None:
        name = f"{spec.name}/{subset}"
        records = ((row, record) for row, _, record in table.records(None, keep_bytes=True))
        yield name, RecordParser(name, origin, data.folder, data.links), records, table.rows
        return
    # Grouped by value: the subset's text is held (its images are read again by cell, not kept).
    by_value: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for row, value, record in table.records(spec.source_column, keep_bytes=False):
        by_value[str(value)].append((row, record))
    prefix = spec.name if len(data.named) == 1 else f"{spec.name}/{subset}"
    for value, grouped in sorted(by_value.items()):
        name = f"{prefix}/{value}"
        yield name, RecordParser(name, origin, data.folder, data.links), iter(grouped), len(grouped)


class SubsetTable:
    """A subset's table files read as records, ``READ_BATCH`` rows at a time: the text columns as
    Python objects, each image as a :class:`~pipeline.data.tables.TableImage` naming its file and row
    (with the bytes just read, for its header), or as the path a column of strings holds. Columns
    are the data set's own, or renamed by a ``columns`` mapping (ours -> theirs)."""

    def __init__(self, files: list[Path], columns: dict[str, str] | None, origin: str, entry: str):
        if not files:
            raise DataError(origin, None, "no data files")
        self.files, self.origin, self.theirs = files, origin, dict(columns or {})
        names = schema(files[0]).names
        absent = sorted(col for col in self.theirs.values() if col not in names)
        if absent:
            raise DataError(origin, None, f"columns {absent} of the `columns` mapping are not in {names}")
        ours = {theirs: mine for mine, theirs in self.theirs.items()}
        self.columns = [ours.get(n, n) for n in names]
        self.text, self.image = _shape(self.columns, origin, entry)
        self.video = next((c for c in VIDEO_COLUMNS if c in self.columns), None)
        self.single, self.paths = False, False
        if self.image is not None:
            kind = schema(files[0]).field(self._theirs(self.image)).type
            self.single = not (pa.types.is_list(kind) or pa.types.is_large_list(kind))
            item = kind if self.single else kind.value_type
            self.paths = pa.types.is_string(item) or pa.types.is_large_string(item)
        self.rows = sum(num_rows(f) for f in files)

    def _theirs(self, column: str) -> str:
        return self.theirs.get(column, column)

    def records(self, source_column: str | None, keep_bytes: bool) -> Iterator[tuple[int, Any, Any]]:
        """``(row, source column value, record)``; a video column's entry goes in the record (the
        parser refuses it until videos are supported)."""
        if source_column is not None and source_column not in self.columns:
            raise DataError(self.origin, None, f"source_column '{source_column}' is not a column ({self.columns})")
        wanted = [c for c in (self.text, self.image, source_column, self.video) if c is not None]
        row = 0
        for path in self.files:
            in_file = 0
            for batch in batches(path, [self._theirs(c) for c in wanted], READ_BATCH):
                values = dict(zip(wanted, (column.to_pylist() for column in batch.columns), strict=True))
                for j in range(batch.num_rows):
                    refs = self._images(path, in_file + j, row + j, values, j, keep_bytes)
                    turns = values[self.text][j]
                    record = (
                        _cauldron_record(turns, refs) if self.text == "texts" else {self.text: turns, "images": refs}
                    )
                    if self.video and values[self.video][j]:
                        record["video"] = values[self.video][j]
                    yield row + j, values[source_column][j] if source_column else None, record
                row, in_file = row + batch.num_rows, in_file + batch.num_rows

    def _images(
        self, path: Path, in_file: int, row: int, values: dict[str, list], j: int, keep_bytes: bool
    ) -> list[TableImage | str]:
        if self.image is None:
            return []
        items = [values[self.image][j]] if self.single else values[self.image][j] or []
        if self.paths:
            return [p for p in items if p is not None]
        refs: list[TableImage | str] = []
        for i, stored in enumerate(items):
            if self.single and stored is None:  # LLaVA's ``image``: one or none
                continue
            if isinstance(stored, dict) and not stored.get("bytes") and stored.get("path"):
                refs.append(stored["path"])  # a file beside the table, resolved by the parser
                continue
            data = stored.get("bytes") if keep_bytes and isinstance(stored, dict) else None
            item = None if self.single else i
            refs.append(TableImage(str(path), in_file, self._theirs(self.image), item, self.origin, row, data))
        return refs


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


def _cauldron_record(turns: Any, images: list[TableImage | str]) -> Any:
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
