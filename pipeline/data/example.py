"""The one in-memory form every loader produces: an :class:`Example` in Qwen message format."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

# An image is a file path, an already decoded PIL image (datasets on disk), or a zero-argument
# callable that renders one (the built-in corpus draws its images only when they are encoded).
ImageRef = Path | Image.Image | Callable[[], Image.Image]

ROLES = ("system", "user", "assistant")
# What PIL raises on an image it cannot decode: OSError (UnidentifiedImageError, "image file is
# truncated"), and from inside a decoder on cut data, struct.error, SyntaxError or ValueError.
DECODE_ERRORS = (OSError, SyntaxError, ValueError, struct.error)


class DataError(ValueError):
    """Bad input data; the message names the file (or source) and the record index. ``reason``:
    what kind of problem it is, the key ``on_bad_record: skip`` counts skips by (default: the
    problem up to its first colon, numbers and quoted names left out)."""

    def __init__(self, origin: str, index: int | None, problem: str, reason: str | None = None):
        self.origin, self.index, self.problem = origin, index, problem
        self.reason = reason or _QUOTED.sub("…", _NUMBER.sub("N", problem.split(":")[0]))
        where = f"{origin} record {index}" if index is not None else origin
        super().__init__(f"{where}: {problem}")

    def __reduce__(self) -> tuple:  # raised in a prepare worker, re-raised whole in the stage
        return type(self), (self.origin, self.index, self.problem, self.reason)


_NUMBER, _QUOTED = re.compile(r"\d+"), re.compile(r"'[^']*'|\"[^\"]*\"")


class StoredImage(ABC):
    """An image kept as bytes until called (an :class:`ImageRef`): a hub data set's, an archive
    member's. A subclass says how its bytes open (``_open``) and what names it when they do not
    (``_unreadable``); :meth:`header_size` and :meth:`check` read the header only."""

    def __call__(self) -> Image.Image:
        with self._opened() as image:
            try:
                return image.convert("RGB")
            except DECODE_ERRORS as err:  # a header that reads, pixels that do not
                raise self._unreadable(err) from err

    def check(self) -> None:
        """Raise the DataError of an image whose header does not read (corrupt or missing bytes)."""
        self.header_size()

    def header_size(self) -> tuple[int, int]:
        """(width, height), from the header (read once: prepare checks it, then counts its tokens)."""
        if getattr(self, "_size", None) is None:
            with self._opened() as image:
                self._size = image.size
        return self._size

    def _opened(self) -> Image.Image:
        try:
            return self._open()
        except (OSError, TypeError, KeyError, IndexError) as err:  # no image, or no bytes where they should be
            raise self._unreadable(err) from err

    @abstractmethod
    def _open(self) -> Image.Image: ...

    @abstractmethod
    def _unreadable(self, err: Exception) -> DataError: ...


@dataclass
class Example:
    """One conversation. ``messages`` follow the Qwen chat format with content lists; image
    items are ``{"type": "image"}`` placeholders filled, in order, from ``images``."""

    source: str
    index: int  # position of the record in its file (for error messages)
    origin: str  # file (or generator) the record came from
    messages: list[dict[str, Any]]
    images: list[ImageRef] = field(default_factory=list)
    token_ids: Any = None  # tensor of input ids cached by ``prepare``; None until attached
    tags_inserted: int = 0  # <image> tags the reader put in (a row with images and none)

    def error(self, problem: str) -> DataError:
        return DataError(self.origin, self.index, problem)

    def load_images(self) -> list[Image.Image]:
        return [self._open(ref) for ref in self.images]

    def image_sizes(self) -> list[tuple[int, int]]:
        """(width, height) of each image, from its header where it has one (nothing decoded)."""
        return [self._size(ref) for ref in self.images]

    def _size(self, ref: ImageRef) -> tuple[int, int]:
        if isinstance(ref, Image.Image):
            return ref.size
        if hasattr(ref, "header_size"):  # a hub image, an archive member
            return ref.header_size()
        if callable(ref):  # drawn when asked (the built-in corpus)
            return ref().size
        try:
            with Image.open(ref) as img:
                return img.size
        except (OSError, UnidentifiedImageError) as err:
            raise self.error(f"unreadable image {ref}: {err}") from err

    def _open(self, ref: ImageRef) -> Image.Image:
        if isinstance(ref, Image.Image):
            return ref.convert("RGB")
        if callable(ref):
            try:
                return ref()
            except DataError as err:  # an archive member names its archive: the record is named here
                raise self.error(err.problem) from err
        try:
            with Image.open(ref) as img:
                return img.convert("RGB")
        except DECODE_ERRORS as err:
            raise self.error(f"unreadable image {ref}: {err}") from err

    def fingerprint(self) -> int:
        """A 64-bit hash of the conversation and its image references (paths, or the drawing
        of a built-in scene; decoded images count by position only)."""
        refs = [
            str(ref) if isinstance(ref, (Path, str)) else repr(ref) if callable(ref) else "image" for ref in self.images
        ]
        text = json.dumps([self.messages, refs], sort_keys=True)
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)

    def answer(self) -> str:
        """Text of the last assistant turn: the exact target used for held-out accuracy."""
        for message in reversed(self.messages):
            if message["role"] == "assistant":
                return "".join(c["text"] for c in message["content"] if c["type"] == "text")
        raise self.error("no assistant turn")
