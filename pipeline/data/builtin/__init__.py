"""The built-in multi-source corpus, generated on the fly and deterministic by seed, no downloads:
``images`` draws the pictures (shapes, words on signs); ``questions`` holds the question
families, which draw an input and the facts behind it; ``answers`` the answer conventions and
the cues that ask for them; ``suites`` the sources (a family, a convention, a cue), their suites
and the pairs that conflict by design; ``corpus`` makes their examples and the tokenizer's text.
The benchmark suite built on the families is :mod:`pipeline.data.benchmark`."""

from pipeline.data.builtin.answers import NUMBER_WORDS, SHORT
from pipeline.data.builtin.corpus import corpus_text, draw, generate, make_example
from pipeline.data.builtin.images import (
    COLOURS,
    DRAWINGS,
    OutlinedScene,
    Scene,
    Sign,
    drawing_from_reference,
    drawing_reference,
)
from pipeline.data.builtin.questions import (
    BENCHMARK_FAMILIES,
    FAMILIES,
    LETTERS,
    PLACES,
    SHAPE_OPTIONS,
    WORDS,
    Draw,
    choice_prompt,
)
from pipeline.data.builtin.suites import CONFLICT_KINDS, CONFLICTS, FINETUNE, SOURCES, UNSEEN, WARMUP, suite_sources

__all__ = [
    "BENCHMARK_FAMILIES",
    "COLOURS",
    "CONFLICTS",
    "CONFLICT_KINDS",
    "DRAWINGS",
    "FAMILIES",
    "FINETUNE",
    "LETTERS",
    "NUMBER_WORDS",
    "PLACES",
    "SHAPE_OPTIONS",
    "SHORT",
    "SOURCES",
    "UNSEEN",
    "WARMUP",
    "WORDS",
    "Draw",
    "OutlinedScene",
    "Scene",
    "Sign",
    "choice_prompt",
    "corpus_text",
    "draw",
    "drawing_from_reference",
    "drawing_reference",
    "generate",
    "make_example",
    "suite_sources",
]
