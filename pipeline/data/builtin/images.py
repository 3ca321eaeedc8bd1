"""The built-in corpus's pictures: coloured shapes (:class:`Scene`) and words on signs
(:class:`Sign`), each a frozen, picklable description drawn with PIL only when it is called (an
:data:`~pipeline.data.example.ImageRef`), and the JSON reference the prepared store keeps of one
(:func:`drawing_reference`, :func:`drawing_from_reference`). The benchmark suite outlines its shapes
(:class:`OutlinedScene`) and writes its words on coloured signs, so that none of its images is a
suite's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

from PIL import Image, ImageDraw, ImageFont

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "orange": (240, 140, 30),
    "yellow": (235, 215, 40),
    "purple": (140, 60, 190),
}


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cx: float  # centre, as fractions of the image side
    cy: float
    radius: float


@dataclass(frozen=True)
class Scene:
    """A drawable picture; calling it renders a PIL image (a lazy, picklable image reference)."""

    size: int
    shapes: tuple[Shape, ...] = ()
    text: str | None = None
    # The shapes' outline colour: a class attribute, so the fields (and examples' fingerprints) stay as they were
    outline: ClassVar[tuple[int, int, int] | None] = None

    def __call__(self) -> Image.Image:
        img = Image.new("RGB", (self.size, self.size), "white")
        draw = ImageDraw.Draw(img)
        pen = {"outline": self.outline, "width": max(1, self.size // 56)} if self.outline else {}
        for s in self.shapes:
            x, y, r = s.cx * self.size, s.cy * self.size, s.radius * self.size
            box = (x - r, y - r, x + r, y + r)
            fill = COLOURS[s.colour]
            if s.kind == "circle":
                draw.ellipse(box, fill=fill, **pen)
            elif s.kind == "square":
                draw.rectangle(box, fill=fill, **pen)
            else:
                draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill, **pen)
        if self.text:
            draw.text((self.size / 2, self.size / 2), self.text, fill="black", font=_font(self.size // 4), anchor="mm")
        return img


@dataclass(frozen=True)
class OutlinedScene(Scene):
    """A scene whose shapes have a dark outline: how the benchmark suite draws its scenes
    (:mod:`pipeline.data.benchmark`), so that none of them is a suite's image, whose shapes have none."""

    outline: ClassVar[tuple[int, int, int] | None] = (60, 60, 60)


@dataclass(frozen=True)
class Sign:
    """A word on a pale coloured sign, drawn like a :class:`Scene` (calling it renders the image):
    the benchmark's reading task writes its words so. Without a colour, the word alone, black on
    white as every suite writes (the warm-up's ``read_placed`` skill, anywhere in the image)."""

    size: int
    word: str
    colour: str | None
    cx: float  # the sign's centre, as fractions of the image side
    cy: float
    text_size: float  # the font size, as a fraction of the image side

    def __call__(self) -> Image.Image:
        img = Image.new("RGB", (self.size, self.size), "white")
        draw = ImageDraw.Draw(img)
        font = _font(round(self.text_size * self.size))
        centre = (self.cx * self.size, self.cy * self.size)
        if self.colour:
            left, top, right, bottom = draw.textbbox(centre, self.word, font=font, anchor="mm")
            pad = self.size // 20
            pale = tuple((c + 255) // 2 for c in COLOURS[self.colour])  # black letters stay legible on it
            draw.rounded_rectangle((left - pad, top - pad, right + pad, bottom + pad), radius=pad, fill=pale)
        draw.text(centre, self.word, fill="black", font=font, anchor="mm")
        return img


DRAWINGS = (Scene, Sign)  # OutlinedScene is a Scene


def drawing_reference(drawing: Scene | Sign) -> dict[str, Any]:
    """A drawing as JSON (the prepared store keeps it so and draws it again when it is read)."""
    return {"kind": type(drawing).__name__, **dataclasses.asdict(drawing)}


def drawing_from_reference(ref: dict[str, Any]) -> Scene | Sign:
    fields = {k: v for k, v in ref.items() if k != "kind"}
    if ref["kind"] == "Sign":
        return Sign(**fields)
    shapes = tuple(Shape(**shape) for shape in fields.pop("shapes"))
    return {"Scene": Scene, "OutlinedScene": OutlinedScene}[ref["kind"]](shapes=shapes, **fields)


@cache
def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)
