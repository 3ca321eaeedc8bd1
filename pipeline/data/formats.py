"""Readers for the instruction-data formats users bring, all producing :class:`Example`.

Record shapes (detected per record, so JSONL and ``datasets`` folders may hold either):
- LLaVA / qwen-vl-finetune: ``{"image": str | [str], "conversations": [{"from", "value"}]}``
- ShareGPT (LLaMA-Factory, ms-swift): ``{"messages": [{"role", "content"}], "images": [...]}``
In both, ``<image>`` tags in the text mark where the images go, in order.
"""

from __future__ import annotations

import functools
import io
import json
import os
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from pipeline.data.example import DataError, Example, ImageRef, StoredImage

IMAGE_TAG = "<image>"
JSON_CHUNK = 1 << 22  # characters of a JSON annotation file read at a time
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


def read_json_records(path: Path, chunk: int = JSON_CHUNK) -> Iterator[Any]:
    """The records of a JSON array, one at a time, read ``chunk`` characters at a time: LLaVA's
    and ShareGPT's annotation files run to tens of GB (LLaVA-OneVision's 21.8 GB), which a whole
    read would hold twice (the text and its objects)."""
    decoder = json.JSONDecoder()
    try:
        with open(path, encoding="utf-8") as file:
            buffer, position, ended, index = file.read(chunk), 0, False, 0
            position = _skip(buffer, position, " \t\r\n\ufeff")
            if buffer[position : position + 1] != "[":
                raise DataError(str(path), None, "cannot read JSON: expected a list of records")
            position += 1
            while True:
                position = _skip(buffer, position, " \t\r\n," if index else " \t\r\n")
                if position == len(buffer) and not ended:
                    buffer, position = file.read(chunk), 0
                    ended = not buffer
                    continue
                if buffer[position : position + 1] == "]":
                    return
                try:
                    record, end = decoder.raw_decode(buffer, position)
                except json.JSONDecodeError as err:
                    more = "" if ended else file.read(max(chunk, len(buffer)))  # a record longer than the rest
                    if not more:
                        raise DataError(str(path), index, f"cannot read JSON: {err}") from err
                    buffer, position = buffer[position:] + more, 0
                    continue
                yield record
                index, position = index + 1, end
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(str(path), None, f"cannot read JSON: {err}") from err


def _skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position


def read_jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line index, record)``, a line at a time; a line that is not JSON yields a DataError in its place."""
    try:
        with open(path, encoding="utf-8") as file:
            for index, line in enumerate(file):
                if not line.strip():
                    continue
                try:
                    yield index, json.loads(line)
                except json.JSONDecodeError as err:
                    yield index, DataError(str(path), index, f"invalid JSON line: {err}")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(str(path), None, f"cannot read JSONL: {err}") from err


def hf_disk_files(path: Path) -> list[Path]:
    """The Arrow files of a folder written by ``datasets``' ``save_to_disk`` (one split), read in place."""
    import datasets  # heavy import, only for this format

    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise DataError(str(path), None, f"not a dataset saved with save_to_disk: {err}") from err
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(
            str(path), None, f"a DatasetDict with splits {sorted(dataset)}: point path at one split's folder"
        )
    return [Path(f["filename"]) for f in dataset.cache_files]


class RecordParser:
    """Turns raw records of one file into :class:`Example`, resolving images under one folder."""

    def __init__(self, source: str, origin: Path, images_dir: Path, links: Path | None = None):
        self.source, self.origin, self.images_root = source, str(origin), images_dir.resolve()
        self.links = links.resolve() if links else None  # a hub snapshot's files link into its blobs

    def parse(self, index: int, raw: Any) -> Example:
        """The record as an Example, every image's header read (a corrupt or missing image is this
        record's DataError, which ``on_bad_record`` then decides on). A record with images and no
        ``<image>`` tag gets one per image at the start of its first user turn, as the Cauldron's
        rows are read (LLaVA-OneVision's robut_wikisql has such rows); a video is refused."""
        if isinstance(raw, DataError):
            raise raw
        if not isinstance(raw, dict):
            raise DataError(self.origin, index, f"a record must be a mapping, got {type(raw).__name__}")
        if raw.get("video") or raw.get("videos"):
            raise DataError(self.origin, index, "a video entry: videos are not supported yet", "video")
        if raw.get("conversations"):
            turns = [(t.get("from"), t.get("value")) for t in _turn_list(raw["conversations"], self, index)]
            image_refs = raw.get("image") or raw.get("images") or []
        elif raw.get("messages"):
            turns = [(t.get("role"), t.get("content")) for t in _turn_list(raw["messages"], self, index)]
            image_refs = raw.get("images") or raw.get("image") or []
        else:
            raise DataError(self.origin, index, "record has no 'conversations' or 'messages'")
        image_refs = image_refs if isinstance(image_refs, list) else [image_refs]
        messages = [self._message(index, role, text) for role, text in turns]
        tags = sum(1 for m in messages for c in m["content"] if c["type"] == "image")
        inserted = 0
        if tags == 0 and image_refs and (first := next((m for m in messages if m["role"] == "user"), None)):
            first["content"][:0] = [{"type": "image"}] * len(image_refs)
            tags = inserted = len(image_refs)
        if tags != len(image_refs):
            raise DataError(self.origin, index, f"{tags} <image> tags but {len(image_refs)} images")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(self.origin, index, "no assistant turn to learn from")
        images = [self._image(index, ref) for ref in image_refs]
        for image in images:
            self._check(index, image)
        return Example(self.source, index, self.origin, messages, images, tags_inserted=inserted)

    def _check(self, index: int, image: ImageRef) -> None:
        """Read an image's header: a file or bytes that are no image fail here, inside the record's guard."""
        if isinstance(image, Path):
            try:
                with Image.open(image):
                    pass
            except (OSError, UnidentifiedImageError) as err:
                raise DataError(self.origin, index, f"unreadable image: {err}", "unreadable image") from err
        elif hasattr(image, "check"):  # a hub image, an archive member
            try:
                image.check()
            except DataError as err:
                raise DataError(self.origin, index, err.problem, err.reason) from err

    def _message(self, index: int, role: Any, text: Any) -> dict[str, Any]:
        if role not in ROLE_ALIASES:
            raise DataError(self.origin, index, f"unknown role {role!r} (known: {sorted(ROLE_ALIASES)})")
        if not isinstance(text, str):
            raise DataError(self.origin, index, f"turn text must be a string, got {type(text).__name__}")
        return {"role": ROLE_ALIASES[role], "content": split_image_tags(text)}

    def _image(self, index: int, ref: Any) -> ImageRef:
        if isinstance(ref, Image.Image) or callable(ref):  # decoded, or decoded when encoded (a table's image)
            return ref
        if isinstance(ref, dict) and ref.get("path"):
            ref = ref["path"]
        if not isinstance(ref, str) or not ref:
            raise DataError(self.origin, index, f"bad image reference {ref!r}")
        path = (self.images_root / ref).resolve()
        # Refuse paths that leave the images folder (``../``, absolute paths, symlinks out, but
        # a hub snapshot's into its blobs): annotation files are untrusted input and must not
        # read arbitrary files.
        inside = path.is_relative_to(self.images_root) or (self.links is not None and path.is_relative_to(self.links))
        if not inside or not Path(os.path.normpath(self.images_root / ref)).is_relative_to(self.images_root):
            raise DataError(self.origin, index, f"image path {ref!r} escapes the images folder {self.images_root}")
        if not path.is_file():
            if member := archived(self.images_root).get(Path(os.path.normpath(ref)).as_posix()):
                return member
            raise DataError(self.origin, index, f"image {ref!r} not found under {self.images_root}", "image not found")
        return path


def _turn_list(turns: Any, parser: RecordParser, index: int) -> list[dict]:
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DataError(parser.origin, index, "conversation must be a list of turns")
    return turns


def split_image_tags(text: str) -> list[dict[str, str]]:
    """``"<image>\\nWhat is it?"`` -> ``[{"type": "image"}, {"type": "text", "text": "What is it?"}]``."""
    content: list[dict[str, str]] = []
    for i, piece in enumerate(text.split(IMAGE_TAG)):
        if i:
            content.append({"type": "image"})
            piece = piece.removeprefix("\n")
        if piece:
            content.append({"type": "text", "text": piece})
    return content


class ArchiveImage(StoredImage):
    """An image inside a zip or tar archive, read in place when called (an
    :class:`~pipeline.data.example.ImageRef`): Vision-FLAN, ShareGPT4V and MAmmoTH-VL ship their
    images as archives beside the annotations, and unpacking them would double the disk they take.
    The repr names archive and member, for the fingerprint."""

    def __init__(self, archive: Path, member: str):
        self.archive, self.member = archive, member

    def _open(self) -> Image.Image:
        return Image.open(io.BytesIO(_archive(self.archive).read(self.member)))

    def _unreadable(self, err: Exception) -> DataError:
        return DataError(str(self.archive), None, f"unreadable image {self.member}: {err}", "unreadable image")

    def __repr__(self) -> str:
        return f"{self.archive}!{self.member}"


ARCHIVES = ("*.zip", "*.tar")


@functools.cache
def archived(folder: Path) -> dict[str, ArchiveImage]:
    """Every file inside the zip and tar archives of ``folder`` (its own, not its subfolders'), by
    its path in the archive and by that path without its first folder (``images/x.jpg`` of an
    archive whose members are ``image_191-task_1k/images/x.jpg``): a member list read once."""
    found: dict[str, ArchiveImage] = {}
    for archive in sorted(p for pattern in ARCHIVES for p in folder.glob(pattern)):
        for name in _archive(archive).names():
            image = ArchiveImage(archive, name)
            found.setdefault(name, image)
            if "/" in name:
                found.setdefault(name.split("/", 1)[1], image)
    return found


class _Members:
    """One archive opened for reading members by name (zip: its central directory; tar: its
    member list, read once)."""

    def __init__(self, path: Path):
        # Held open for the process' reads (closed when it exits): one open per image would reread
        # a zip's central directory, a tar's member list, every time.
        self.zip = zipfile.ZipFile(path) if zipfile.is_zipfile(path) else None
        self.tar = None if self.zip else tarfile.open(path)  # noqa: SIM115
        self.members = {} if self.zip else {m.name: m for m in self.tar.getmembers() if m.isfile()}

    def names(self) -> list[str]:
        return [n for n in self.zip.namelist() if not n.endswith("/")] if self.zip else list(self.members)

    def read(self, name: str) -> bytes:
        if self.zip:
            return self.zip.read(name)
        return self.tar.extractfile(self.members[name]).read()


_opened_archives: dict[tuple[int, Path], _Members] = {}


def _archive(path: Path) -> _Members:
    """The archive opened by this process: a DataLoader worker forked from another must not share
    its file offset, so each process opens its own."""
    key = (os.getpid(), path)
    if key not in _opened_archives:
        _opened_archives[key] = _Members(path)
    return _opened_archives[key]
