"""The built-in multi-source corpus: generated on the fly, deterministic by seed, no downloads.

Each *family* draws an input (a procedural image and a question, or a text question) and the
facts behind it; each *source* is a family plus an answer convention, and optionally a cue: its
own instruction, which replaces or extends the family's question. Sources come in three suites,
the first two of which depend on the kind of designed conflict (``data.builtin.conflicts``,
:data:`CONFLICT_KINDS`):

- ``finetune`` (:data:`FINETUNE`): what the branches train on, 18 sources. Sources of one family
  see exactly the same inputs (the draw is seeded by family and index, not by source), so two
  sources with opposite conventions conflict. Those pairs are listed in :data:`CONFLICTS` and are
  what a conflict-aware split must separate. With ``cued`` (the default) each source of a pair
  has its own instruction ("What colour is the shape? Answer with one word." against "What is
  the complementary colour of the shape? Answer in a full sentence."): one model can satisfy
  both, and the conflict lives in the parameters they share; the second source of every pair
  also answers in full sentences ("The answer is three.") where the first answers tersely
  ("3"), like VQA-style short-answer datasets against conversational ones. With
  ``contradictory`` both ask the same question and want those different answers, which no
  single model can satisfy. With ``opposed`` five yes/no questions are each answered truthfully
  by one source and negated by the other, in one vocabulary and format, each with its own
  instruction: the conventions differ in nothing but the mapping from the truth to the answer.
- ``warmup`` (:data:`WARMUP`): one skill per family, the plain question and a short answer: what
  a warm-up teaches θ0 (the toy's pre-training) before fine-tuning changes conventions and
  formats. For ``opposed``, instead of their families' skills, the pairs' questions in both
  pairs' words answered by either convention at random, and the same questions answered ``true``
  or ``false``: a θ0 that knows the truth and answers yes or no, but follows neither instruction,
  where the two conventions' gradients oppose (each maps the truth θ0 knows to the other word).
- ``unseen``: instruction and task combinations the fine-tuning suite never trains, to measure
  generalisation.

The warm-up and unseen suites draw their inputs in a namespace of their own, so none of their
examples is a fine-tuning example (only the chance repeats of a small space remain: 20 words,
100 sums).

The benchmark suite (:mod:`pipeline.data.benchmark`) draws with the multiple-choice families and
families of its own (:data:`BENCHMARK_FAMILIES`), and outlines its shapes (:class:`OutlinedScene`)
and writes its words on signs (:class:`Sign`), so that none of its images is a suite's.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, NamedTuple, get_args

from PIL import Image, ImageDraw, ImageFont

from pipeline.config import BuiltinSection
from pipeline.data.example import Example

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "orange": (240, 140, 30),
    "yellow": (235, 215, 40),
    "purple": (140, 60, 190),
}
COMPLEMENT = {
    "red": "green",
    "green": "red",
    "blue": "orange",
    "orange": "blue",
    "yellow": "purple",
    "purple": "yellow",
}
SHAPES = ("circle", "square", "triangle")
NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
]
WORDS = [
    "cat",
    "dog",
    "sun",
    "tree",
    "book",
    "fish",
    "star",
    "moon",
    "bird",
    "cake",
    "door",
    "lamp",
    "rain",
    "ship",
    "milk",
    "frog",
    "kite",
    "rose",
    "bell",
    "coin",
]


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


# --- families: (rng, image size) -> (scene or None, question, facts) -------------------------
Facts = dict[str, Any]
Draw = tuple[Scene | Sign | None, str, Facts]


def _one_shape(
    rng: random.Random, cx: float | None = None, cy: float | None = None, radius: float | None = None
) -> Shape:
    return Shape(
        kind=rng.choice(SHAPES),
        colour=rng.choice(sorted(COLOURS)),
        cx=cx if cx is not None else rng.uniform(0.3, 0.7),
        cy=cy if cy is not None else rng.uniform(0.3, 0.7),
        radius=radius if radius is not None else rng.uniform(0.12, 0.22),
    )


def _colour(rng: random.Random, size: int) -> Draw:
    shape = _one_shape(rng)
    return Scene(size, (shape,)), "What colour is the shape?", {"colour": shape.colour}


def _shape(rng: random.Random, size: int) -> Draw:
    shape = _one_shape(rng)
    return Scene(size, (shape,)), "What shape is in the picture?", {"kind": shape.kind}


def _dots(rng: random.Random, size: int, n: int) -> Scene:
    """``n`` dots of one colour in cells of a 3 × 3 grid."""
    cells = rng.sample([(c, r) for c in range(3) for r in range(3)], n)
    colour = rng.choice(sorted(COLOURS))
    return Scene(size, tuple(Shape("circle", colour, (c + 0.5) / 3, (r + 0.5) / 3, 0.1) for c, r in cells))


def _count(rng: random.Random, size: int) -> Draw:
    n = rng.randint(1, 6)
    return _dots(rng, size, n), "How many dots are there?", {"n": n}


def _side(rng: random.Random, size: int) -> Draw:
    side = rng.choice(("left", "right"))
    shape = _one_shape(rng, cx=0.25 if side == "left" else 0.75)
    return Scene(size, (shape,)), "Is the shape on the left or the right?", {"side": side}


def _asked(rng: random.Random, truth: Any, others: Any) -> Any:
    """What a yes/no question asks about: the truth or, as often, another value of ``others``."""
    return truth if rng.random() < 0.5 else rng.choice(sorted(set(others) - {truth}))


def _verdict(rng: random.Random, match: bool) -> Facts:
    """A yes/no question's facts: whether it is true, and which of the two conventions (``True``:
    truthful, ``False``: negated) an example that may follow either follows, drawn last so that
    every earlier draw is as it was without it."""
    return {"match": match, "convention": rng.random() < 0.5}


def _colour_check(rng: random.Random, size: int) -> Draw:
    shape = _one_shape(rng)
    asked = _asked(rng, shape.colour, COLOURS)
    return Scene(size, (shape,)), f"Is the shape {asked}?", _verdict(rng, asked == shape.colour)


def _shape_check(rng: random.Random, size: int) -> Draw:
    shape = _one_shape(rng)
    asked = _asked(rng, shape.kind, SHAPES)
    return Scene(size, (shape,)), f"Is the shape a {asked}?", _verdict(rng, asked == shape.kind)


def _side_check(rng: random.Random, size: int) -> Draw:
    side = rng.choice(("left", "right"))
    shape = _one_shape(rng, cx=0.25 if side == "left" else 0.75)
    asked = _asked(rng, side, ("left", "right"))
    return Scene(size, (shape,)), f"Is the shape on the {asked}?", _verdict(rng, asked == side)


def _count_check(rng: random.Random, size: int) -> Draw:
    n = rng.randint(1, 6)
    asked = _asked(rng, n, range(1, 7))
    return _dots(rng, size, n), f"Is the number of dots {asked}?", _verdict(rng, asked == n)


def _sum_check(rng: random.Random, size: int) -> Draw:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    asked = _asked(rng, a + b, range(max(0, a + b - 3), a + b + 4))
    return None, f"Is {a} + {b} equal to {asked}?", _verdict(rng, asked == a + b)


def _vertical(rng: random.Random, size: int) -> Draw:
    where = rng.choice(("top", "bottom"))
    shape = _one_shape(rng, cy=0.25 if where == "top" else 0.75)
    return Scene(size, (shape,)), "Is the shape at the top or the bottom?", {"where": where}


def _read_word(rng: random.Random, size: int) -> Draw:
    word = rng.choice(WORDS)
    return Scene(size, text=word), "What word is written in the image?", {"word": word}


def _read_placed(rng: random.Random, size: int) -> Draw:
    """A word anywhere in the image, in a letter size of its own (black on white, as every suite
    writes): reading that does not depend on where the word is."""
    word = rng.choice(WORDS)
    sign = Sign(size, word, None, rng.uniform(0.35, 0.65), rng.uniform(0.25, 0.75), rng.uniform(0.16, 0.28))
    return sign, "Which word can you read in the picture?", {"word": word}


def _caption(rng: random.Random, size: int) -> Draw:
    side = rng.choice(("left", "right"))
    big = rng.random() < 0.5
    shape = _one_shape(rng, cx=0.27 if side == "left" else 0.73, radius=0.2 if big else 0.1)
    facts = {"side": side, "size": "large" if big else "small", "colour": shape.colour, "kind": shape.kind}
    return Scene(size, (shape,)), "Describe the image.", facts


def _bigger(rng: random.Random, size: int) -> Draw:
    radii = (rng.uniform(0.07, 0.12), rng.uniform(0.16, 0.22))
    bigger = rng.choice(("left", "right"))
    left_r, right_r = radii if bigger == "right" else radii[::-1]
    shapes = (_one_shape(rng, cx=0.25, cy=0.5, radius=left_r), _one_shape(rng, cx=0.75, cy=0.5, radius=right_r))
    return Scene(size, shapes), "Which shape is bigger, the left one or the right one?", {"side": bigger}


def _count_add(rng: random.Random, size: int) -> Draw:
    """Count, then add: the two skills of ``count`` and ``add`` in one question."""
    n, extra = rng.randint(1, 6), rng.randint(1, 9)
    return _dots(rng, size, n), f"What is the number of dots plus {extra}?", {"value": n + extra}


def _add(rng: random.Random, size: int) -> Draw:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return None, f"What is {a} + {b}?", {"value": a + b}


def _subtract(rng: random.Random, size: int) -> Draw:
    a = rng.randint(0, 9)
    b = rng.randint(0, a)
    return None, f"What is {a} - {b}?", {"value": a - b}


def _reverse(rng: random.Random, size: int) -> Draw:
    word = rng.choice(WORDS)
    return None, f"Spell the word backwards: {word}", {"word": word}


def _upper(rng: random.Random, size: int) -> Draw:
    word = rng.choice(WORDS)
    return None, f"Write in capital letters: {word}", {"word": word}


# Question formats of instruction-tuned models that the warm-up teaches: multiple choice answered
# by a letter, which the benchmark suite asks about its own scenes (pipeline.data.benchmark), and
# detailed descriptions.
LETTERS = "ABCD"
CHOICE_PROMPT = "Answer with the option's letter from the given choices directly."  # MMBench's, in lmms-eval
PLACES = {"left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25), "bottom": (0.5, 0.75)}
SHAPE_OPTIONS = (*SHAPES, "hexagon")  # a fourth kind, never drawn, as a distractor


def choice_prompt(stem: str, options: list[str]) -> str:
    """A multiple-choice prompt as MMBench's: the question, one lettered option a line, the instruction."""
    listed = "\n".join(f"{letter}. {option}" for letter, option in zip(LETTERS, options))
    return f"{stem}\n{listed}\n{CHOICE_PROMPT}"


def _options(rng: random.Random, scene: Scene, stem: str, truth: str, pool: tuple[str, ...]) -> Draw:
    """A four-option question: the truth and three distractors from ``pool``, shuffled; its facts
    are the question's stem, the options and the letter of the truth."""
    options = [truth, *rng.sample(sorted(set(pool) - {truth}), len(LETTERS) - 1)]
    rng.shuffle(options)
    facts = {"stem": stem, "options": options, "letter": LETTERS[options.index(truth)]}
    return scene, choice_prompt(stem, options), facts


def _choice(rng: random.Random, size: int) -> Draw:
    """One shape; its colour, kind or place as a multiple-choice question (SeedBench, MMBench)."""
    place = rng.choice(sorted(PLACES))
    shape = _one_shape(rng, *PLACES[place])
    scene = Scene(size, (shape,))
    asked = rng.choice(("colour", "kind", "place"))
    if asked == "colour":
        return _options(rng, scene, "What colour is the shape?", shape.colour, tuple(COLOURS))
    if asked == "kind":
        return _options(rng, scene, "What shape is in the picture?", shape.kind, SHAPE_OPTIONS)
    return _options(rng, scene, "Where is the shape in the image?", place, tuple(PLACES))


def _two_shapes(rng: random.Random, size: int) -> tuple[Scene, Shape, Shape]:
    """A small and a large shape, left and right in random order, of different colours."""
    small, large = rng.uniform(0.07, 0.11), rng.uniform(0.16, 0.21)
    left_r, right_r = (small, large) if rng.random() < 0.5 else (large, small)
    left = _one_shape(rng, *PLACES["left"], radius=left_r)
    right = Shape(rng.choice(SHAPES), rng.choice(sorted(set(COLOURS) - {left.colour})), 0.75, 0.5, right_r)
    return Scene(size, (left, right)), left, right


def _relation_choice(rng: random.Random, size: int) -> Draw:
    """Two shapes; a relation between them as a multiple-choice question (AI2D)."""
    scene, left, right = _two_shapes(rng, size)
    if rng.random() < 0.5:
        bigger = left if left.radius > right.radius else right
        return _options(rng, scene, "What colour is the bigger shape?", bigger.colour, tuple(COLOURS))
    side, shape = rng.choice((("left", left), ("right", right)))
    return _options(rng, scene, f"What shape is on the {side}?", shape.kind, SHAPE_OPTIONS)


def _phrase(shape: Shape, side: str) -> str:
    return f"a {'large' if shape.radius >= 0.15 else 'small'} {shape.colour} {shape.kind} on the {side}"


def _describe(rng: random.Random, size: int) -> Draw:
    """One or two shapes, described in a sentence (LLaVA-in-the-Wild's detailed descriptions)."""
    if rng.random() < 0.5:
        side = rng.choice(("left", "right"))
        shape = _one_shape(rng, cx=0.27 if side == "left" else 0.73, radius=rng.choice((0.1, 0.2)))
        scene, text = Scene(size, (shape,)), _phrase(shape, side)
    else:
        scene, left, right = _two_shapes(rng, size)
        text = f"{_phrase(left, 'left')} and {_phrase(right, 'right')}"
    return scene, "Describe the image in detail.", {"text": f"A{text[1:]}."}


# The benchmark suite's own draws, given the question's index: the reading and reasoning draws
# cycle through every answer (question i has the i-th), so each answer is equally frequent and no
# constant answer scores more than its share; the chat draw cycles through the places.
REASONING_VALUES = range(2, 16)  # a count of 1-6 dots plus 1-9


def _sign_word(rng: random.Random, size: int, index: int) -> Draw:
    """A word of :data:`WORDS` on a sign of random colour, place and letter size (TextVQA)."""
    word = WORDS[index % len(WORDS)]
    colour, cx, cy = rng.choice(sorted(COLOURS)), rng.uniform(0.4, 0.6), rng.uniform(0.3, 0.7)
    return Sign(size, word, colour, cx, cy, rng.uniform(0.18, 0.26)), "What is written on the sign?", {"word": word}


def _dots_plus(rng: random.Random, size: int, index: int) -> Draw:
    """Count the dots, then add a number (MathVista, MMMU): 1-6 dots as the count family draws
    them, and a number chosen so that the sum is the index's."""
    value = REASONING_VALUES[index % len(REASONING_VALUES)]
    n = rng.randint(max(1, value - 9), min(6, value - 1))
    extra = value - n
    question = f"How many dots are there? Add {extra} to that number."
    return _dots(rng, size, n), question, {"value": value, "extra": extra}


def _scene_chat(rng: random.Random, size: int, index: int) -> Draw:
    """One shape, its place cycling by index; what is in the picture and where, answered in a
    sentence no suite answers in (LLaVA-in-the-Wild's conversation questions)."""
    place = sorted(PLACES)[index % len(PLACES)]
    shape = _one_shape(rng, *PLACES[place])
    article = "an" if shape.colour[0] in "aeiou" else "a"
    text = f"The picture shows {article} {shape.colour} {shape.kind} in its {place} half."
    facts = {"text": text, "colour": shape.colour, "kind": shape.kind, "place": place}
    return Scene(size, (shape,)), "What do you see in this picture, and where is it?", facts


BENCHMARK_FAMILIES: dict[str, Callable[[random.Random, int, int], Draw]] = {
    "sign_word": _sign_word,
    "dots_plus": _dots_plus,
    "scene_chat": _scene_chat,
}

FAMILIES: dict[str, Callable[[random.Random, int], Draw]] = {
    "colour": _colour,
    "shape": _shape,
    "count": _count,
    "side": _side,
    "colour_check": _colour_check,
    "shape_check": _shape_check,
    "side_check": _side_check,
    "count_check": _count_check,
    "sum_check": _sum_check,
    "vertical": _vertical,
    "read_word": _read_word,
    "read_placed": _read_placed,
    "caption": _caption,
    "bigger": _bigger,
    "count_add": _count_add,
    "add": _add,
    "subtract": _subtract,
    "reverse": _reverse,
    "upper": _upper,
    "choice": _choice,
    "describe": _describe,
    "relation_choice": _relation_choice,
}


_OTHER_SIDE = {"left": "right", "right": "left"}


def _yes_no(facts: Facts) -> str:
    return "yes" if facts["match"] else "no"


def _negated(facts: Facts) -> str:
    return "no" if facts["match"] else "yes"


def _either(facts: Facts) -> str:
    return _yes_no(facts) if facts["convention"] else _negated(facts)


def _true_false(facts: Facts) -> str:
    return "true" if facts["match"] else "false"


# The short answer to each family's question: the warm-up skills' and the pairs' terse side.
SHORT: dict[str, Callable[[Facts], str]] = {
    "colour": lambda f: f["colour"],
    "shape": lambda f: f["kind"],
    "count": lambda f: str(f["n"]),
    "side": lambda f: f["side"],
    "colour_check": _yes_no,
    "shape_check": _yes_no,
    "side_check": _yes_no,
    "count_check": _yes_no,
    "sum_check": _yes_no,
    "vertical": lambda f: f["where"],
    "read_word": lambda f: f["word"],
    "read_placed": lambda f: f["word"],
    "caption": lambda f: f"A {f['size']} {f['colour']} {f['kind']} on the {f['side']}.",
    "bigger": lambda f: f["side"],
    "count_add": lambda f: str(f["value"]),
    "add": lambda f: str(f["value"]),
    "subtract": lambda f: str(f["value"]),
    "reverse": lambda f: f["word"][::-1],
    "upper": lambda f: f["word"].upper(),
    "choice": lambda f: f["letter"],
    "relation_choice": lambda f: f["letter"],
    "describe": lambda f: f["text"],
}


def _sentence(answer: Callable[[Facts], str]) -> Callable[[Facts], str]:
    return lambda facts: f"The answer is {answer(facts)}."


def _in_words(key: str) -> Callable[[Facts], str]:
    return _sentence(lambda f: NUMBER_WORDS[f[key]])


def _complement(facts: Facts) -> str:
    return COMPLEMENT[facts["colour"]]


# Cues: the question a source asks, "{question}" standing for its family's.
WORD = "{question} Answer with one word."
DIGITS = "{question} Answer with digits."
SENTENCE = "{question} Answer in a full sentence."
IN_WORDS = "{question} Answer in a full sentence, with the number in words."
COMPLEMENT_QUESTION = "What is the complementary colour of the shape?"
YES_NO = "{question} Answer yes or no."
NEGATED = "{question} Answer yes or no, the opposite of the truth."
TRUE_FALSE = "{question} Answer true or false."


class Source(NamedTuple):
    family: str
    answer: Callable[[Facts], str]
    cue: str | None = None  # None: the family's question as it is


# Sources of the fine-tuning suite that no designed pair holds, in every kind of conflict.
_UNPAIRED = {
    "shape_name": Source("shape", SHORT["shape"]),
    "vertical_position": Source("vertical", SHORT["vertical"]),
    "read_word": Source("read_word", SHORT["read_word"]),
    "caption": Source("caption", SHORT["caption"]),
    "bigger_side": Source("bigger", SHORT["bigger"]),
    "subtract": Source("subtract", SHORT["subtract"]),
    "reverse_word": Source("reverse", SHORT["reverse"]),
    "uppercase": Source("upper", SHORT["upper"]),
}
# cued and contradictory: five conventions of their own, the second source of each pair in full sentences.
_STYLED = {
    "colour_name": Source("colour", SHORT["colour"], WORD),
    "colour_complement": Source("colour", _sentence(_complement), SENTENCE.format(question=COMPLEMENT_QUESTION)),
    "count_digits": Source("count", SHORT["count"], DIGITS),
    "count_words": Source("count", _in_words("n"), IN_WORDS),
    "side_left_right": Source("side", SHORT["side"], WORD),
    "side_mirrored": Source(
        "side",
        _sentence(lambda f: _OTHER_SIDE[f["side"]]),
        SENTENCE.format(question="In a mirror, would the shape be on the left or the right?"),
    ),
    "colour_yes_no": Source("colour_check", SHORT["colour_check"], YES_NO),
    "colour_yes_no_flipped": Source(
        "colour_check", _sentence(_negated), "{question} Answer the opposite of the truth, in a full sentence."
    ),
    "add_digits": Source("add", SHORT["add"], DIGITS),
    "add_words": Source("add", _in_words("value"), IN_WORDS),
}
# opposed: five yes/no questions, each answered truthfully by one source and negated by the other.
_OPPOSED = {
    name: Source(family, answer, cue)
    for topic, family in {
        "colour": "colour_check",
        "shape": "shape_check",
        "side": "side_check",
        "count": "count_check",
        "sum": "sum_check",
    }.items()
    for name, answer, cue in ((f"{topic}_yes_no", _yes_no, YES_NO), (f"{topic}_yes_no_negated", _negated, NEGATED))
}
_WARMUP = {f"skill_{family}": Source(family, answer) for family, answer in SHORT.items()}
# opposed's pre-training: the pairs' questions in both pairs' words, answered by either convention at
# random (one draw for both words), so that θ0 answers yes or no but follows neither instruction;
# and the same questions answered true or false, so that θ0 knows the truth both conventions map.
_EITHER = {f"either_{name}": Source(source.family, _either, source.cue) for name, source in _OPPOSED.items()}
_TRUE_FALSE = {
    f"{name.removesuffix('_yes_no')}_true_false": Source(source.family, _true_false, TRUE_FALSE)
    for name, source in _OPPOSED.items()
    if source.cue == YES_NO
}
_UNSEEN = {  # each a task the fine-tuning suite trains, with an instruction it never pairs with that task
    "unseen_shape_sentence": Source("shape", _sentence(SHORT["shape"]), SENTENCE),
    "unseen_vertical_sentence": Source("vertical", _sentence(SHORT["vertical"]), SENTENCE),
    "unseen_read_sentence": Source("read_word", _sentence(SHORT["read_word"]), SENTENCE),
    "unseen_subtract_words": Source("subtract", _in_words("value"), IN_WORDS),
    "unseen_complement_word": Source("colour", _complement, WORD.format(question=COMPLEMENT_QUESTION)),
}
_STYLED_ORDER = [  # the fine-tuning suite as it always was listed (the split's tie-breaks follow it)
    "colour_name", "colour_complement", "shape_name", "count_digits", "count_words", "side_left_right",
    "side_mirrored", "colour_yes_no", "colour_yes_no_flipped", "vertical_position", "read_word", "caption",
    "bigger_side", "add_digits", "add_words", "subtract", "reverse_word", "uppercase",
]  # fmt: skip
# The fine-tuning suite of each kind of conflict (data.builtin.conflicts): 18 sources, 5 designed pairs.
FINETUNE: dict[str, list[str]] = {
    "cued": _STYLED_ORDER,
    "contradictory": _STYLED_ORDER,
    "opposed": [*_OPPOSED, *_UNPAIRED],
}
_OPPOSED_FAMILIES = {source.family for source in _OPPOSED.values()}
# The warm-up suite of each kind: a skill per family, for opposed none of a pair's family but its
# questions answered either way and true or false.
WARMUP: dict[str, list[str]] = {
    "cued": list(_WARMUP),
    "contradictory": list(_WARMUP),
    "opposed": [*(s for s in _WARMUP if _WARMUP[s].family not in _OPPOSED_FAMILIES), *_EITHER, *_TRUE_FALSE],
}
UNSEEN: list[str] = list(_UNSEEN)
SOURCES: dict[str, Source] = _UNPAIRED | _STYLED | _OPPOSED | _WARMUP | _EITHER | _TRUE_FALSE | _UNSEEN
_SUITE_OF = (
    dict.fromkeys(_UNPAIRED | _STYLED | _OPPOSED, "finetune")
    | dict.fromkeys(_WARMUP | _EITHER | _TRUE_FALSE, "warmup")
    | dict.fromkeys(UNSEEN, "unseen")
)

# Pairs built to conflict, per kind: same family (same inputs), opposite answer conventions.
_STYLED_PAIRS = (
    ("colour_name", "colour_complement"),
    ("count_digits", "count_words"),
    ("side_left_right", "side_mirrored"),
    ("colour_yes_no", "colour_yes_no_flipped"),
    ("add_digits", "add_words"),
)
CONFLICTS: dict[str, tuple[tuple[str, str], ...]] = {
    "cued": _STYLED_PAIRS,
    "contradictory": _STYLED_PAIRS,
    "opposed": tuple((a, b) for a, b in zip(list(_OPPOSED)[::2], list(_OPPOSED)[1::2])),
}
CONFLICT_KINDS: tuple[str, ...] = get_args(BuiltinSection.model_fields["conflicts"].annotation)


def suite_sources(suite: str, conflicts: str = "cued") -> list[str]:
    """The sources of a suite; the fine-tuning and warm-up suites' depend on the kind of conflict."""
    if suite == "unseen":
        return UNSEEN
    return {"finetune": FINETUNE, "warmup": WARMUP}[suite][conflicts]


def draw(source: str, index: int, seed: int, image_size: int) -> Draw:
    """The input and facts of one example. Fine-tuning sources draw by family and index, so a
    pair shares its inputs; the other suites draw in a namespace of their own, so that they never
    see the fine-tuning inputs (a warm-up would otherwise pre-train on the branches' examples)."""
    family, suite = SOURCES[source].family, _SUITE_OF[source]
    namespace = family if suite == "finetune" else f"{suite}/{family}"
    return FAMILIES[family](random.Random(f"{seed}/{namespace}/{index}"), image_size)


def make_example(source: str, index: int, seed: int, image_size: int, conflicts: str = "cued") -> Example:
    """Example ``index`` of a built-in source; ``conflicts`` is the kind of the fine-tuning pairs
    (``data.builtin.conflicts``): contradictory pairs ask their family's question uncued."""
    _, answer, cue = SOURCES[source]
    scene, question, facts = draw(source, index, seed, image_size)
    if cue and not (conflicts == "contradictory" and source in _STYLED):
        question = cue.format(question=question)
    user = [{"type": "image"}] if scene else []
    user.append({"type": "text", "text": question})
    messages = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": answer(facts)}]},
    ]
    return Example(source, index, f"builtin:{source}", messages, [scene] if scene else [])


def generate(
    tasks: list[str] | None, cfg: BuiltinSection, seed: int, suite: str = "finetune", count: int | None = None
) -> dict[str, list[Example]]:
    """The sources of a suite (or the named built-in sources, of any suite), ``count`` examples
    each (default ``cfg.examples_per_source``)."""
    names = tasks or suite_sources(suite, cfg.conflicts)
    unknown = sorted(set(names) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown built-in tasks {unknown}; known: {sorted(SOURCES)}")
    count = count or cfg.examples_per_source
    return {name: [make_example(name, i, seed, cfg.image_size, cfg.conflicts) for i in range(count)] for name in names}


def corpus_text(seed: int, per_source: int = 64) -> Iterator[str]:
    """Text the offline tokenizer is trained on: the questions and answers of every suite in
    every kind of conflict, plus the vocabulary every answer convention uses, independent of
    the data config (one tokenizer serves every corpus)."""
    yield " ".join([*COLOURS, *SHAPES, *NUMBER_WORDS, *WORDS, *(w.upper() for w in WORDS), "The answer is"])
    for conflicts in CONFLICT_KINDS:
        for source in SOURCES:
            for i in range(per_source):
                example = make_example(source, i, seed, image_size=28, conflicts=conflicts)
                for message in example.messages:
                    yield from (c["text"] for c in message["content"] if c["type"] == "text")
