"""The question families of the built-in corpus: each draws, from a seeded ``random.Random`` and
the image side, an input (a picture of :mod:`~pipeline.data.builtin.images` and a question, or a
text question alone) and the facts behind it, a :data:`Draw` that the answer conventions of
:mod:`~pipeline.data.builtin.answers` turn into answers. :data:`FAMILIES` are the suites' (among
them the multiple-choice and description formats instruction-tuned models know);
:data:`BENCHMARK_FAMILIES` are the benchmark suite's own, given the question's index as well."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from pipeline.data.builtin.images import COLOURS, Scene, Shape, Sign

# A family: (rng, image size) -> (picture or None, question, facts)
Facts = dict[str, Any]
Draw = tuple[Scene | Sign | None, str, Facts]

SHAPES = ("circle", "square", "triangle")
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
