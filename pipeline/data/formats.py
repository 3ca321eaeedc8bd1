"""Readers for the instruction-data formats users bring, all producing :class:`Example`.

Record shapes (detected per record, so JSONL and ``datasets`` folders may hold either):
- LLaVA / qwen-vl-finetune: ``{"image": str | [str], "conversations": [{"from", "value"}]}``
- ShareGPT (LLaMA-Factory, ms-swift): ``{"messages": [{"role", "content"}], "images": [...]}``
In both, ``<image>`` tags in the text mark where the images go, in order.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from pipeline.data.example import DataError, Example, ImageRef

IMAGE_TAG = "<image>"
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


def read_json_records(path: Path) -> list[Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(str(path), None, f"cannot read JSON: {err}") from err
    if not isinstance(data, list):
        raise DataError(str(path), None, "expected a JSON list of records")
    return data


def read_jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line index, record)``; a line that is not JSON yields a DataError in its place."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(str(path), None, f"cannot read JSONL: {err}") from err
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield index, json.loads(line)
        except json.JSONDecodeError as err:
            yield index, DataError(str(path), index, f"invalid JSON line: {err}")


def read_hf_disk_records(path: Path) -> Iterable[Any]:
    import datasets  # heavy import, only for this format

    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise DataError(str(path), None, f"not a dataset saved with save_to_disk: {err}") from err
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(
            str(path), None, f"a DatasetDict with splits {sorted(dataset)}: point path at one split's folder"
        )
    return dataset


class RecordParser:
    """Turns raw records of one file into :class:`Example`, resolving images under one folder."""

    def __init__(self, source: str, origin: Path, images_dir: Path):
        self.source, self.origin, self.images_root = source, str(origin), images_dir.resolve()

    def parse(self, index: int, raw: Any) -> Example:
        if isinstance(raw, DataError):
            raise raw
        if not isinstance(raw, dict):
            raise DataError(self.origin, index, f"a record must be a mapping, got {type(raw).__name__}")
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
        if tags != len(image_refs):
            raise DataError(self.origin, index, f"{tags} <image> tags but {len(image_refs)} images")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(self.origin, index, "no assistant turn to learn from")
        images = [self._image(index, ref) for ref in image_refs]
        return Example(self.source, index, self.origin, messages, images)

    def _message(self, index: int, role: Any, text: Any) -> dict[str, Any]:
        if role not in ROLE_ALIASES:
            raise DataError(self.origin, index, f"unknown role {role!r} (known: {sorted(ROLE_ALIASES)})")
        if not isinstance(text, str):
            raise DataError(self.origin, index, f"turn text must be a string, got {type(text).__name__}")
        return {"role": ROLE_ALIASES[role], "content": split_image_tags(text)}

    def _image(self, index: int, ref: Any) -> ImageRef:
        if isinstance(ref, Image.Image) or callable(ref):  # decoded, or decoded when encoded (a hub image)
            return ref
        if isinstance(ref, dict) and ref.get("bytes"):  # datasets Image feature, not decoded
            try:
                return Image.open(io.BytesIO(ref["bytes"]))
            except (OSError, UnidentifiedImageError) as err:
                raise DataError(self.origin, index, f"unreadable image bytes: {err}") from err
        if isinstance(ref, dict) and ref.get("path"):
            ref = ref["path"]
        if not isinstance(ref, str) or not ref:
            raise DataError(self.origin, index, f"bad image reference {ref!r}")
        path = (self.images_root / ref).resolve()
        # Refuse paths that leave the images folder (``../``, absolute paths, symlinks out):
        # annotation files are untrusted input and must not read arbitrary files.
        if not path.is_relative_to(self.images_root):
            raise DataError(self.origin, index, f"image path {ref!r} escapes the images folder {self.images_root}")
        if not path.is_file():
            raise DataError(self.origin, index, f"image {ref!r} not found under {self.images_root}")
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
