"""The sources of the built-in corpus and the suites they come in. A source is a question family
of :mod:`~pipeline.data.builtin.questions`, an answer convention of
:mod:`~pipeline.data.builtin.answers` and optionally a cue: its own instruction, which replaces or
extends the family's question. The suites (:func:`suite_sources`) are ``finetune``
(:data:`FINETUNE`, what the branches train on, 18 sources), ``warmup`` (:data:`WARMUP`, one skill
per family, the plain question and a short answer: what a warm-up teaches θ0, the toy's
pre-training, before fine-tuning changes conventions and formats) and ``unseen`` (:data:`UNSEEN`,
instruction and task combinations the fine-tuning suite never trains, to measure
generalisation); the first two depend on the kind of designed conflict
(``data.builtin.conflicts``, :data:`CONFLICT_KINDS`), whose pairs (:data:`CONFLICTS`) are what a
conflict-aware split must separate."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, get_args

from pipeline.config import BuiltinSection
from pipeline.data.builtin.answers import (
    COMPLEMENT_QUESTION,
    DIGITS,
    IN_WORDS,
    NEGATED,
    SENTENCE,
    SHORT,
    TRUE_FALSE,
    WORD,
    YES_NO,
    complement,
    either,
    in_words,
    mirrored,
    negated,
    sentence,
    true_false,
    yes_no,
)
from pipeline.data.builtin.questions import Facts


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
# cued and contradictory: five conventions of their own, the second source of each pair in full sentences
# ("The answer is three.") where the first answers tersely ("3"), like VQA-style short-answer datasets
# against conversational ones. cued: each source of a pair has its own instruction, so one model can
# satisfy both and the conflict lives in the parameters they share; contradictory: both ask their
# family's question uncued (cue_of) and want those different answers, which no single model can satisfy.
_STYLED = {
    "colour_name": Source("colour", SHORT["colour"], WORD),
    "colour_complement": Source("colour", sentence(complement), SENTENCE.format(question=COMPLEMENT_QUESTION)),
    "count_digits": Source("count", SHORT["count"], DIGITS),
    "count_words": Source("count", in_words("n"), IN_WORDS),
    "side_left_right": Source("side", SHORT["side"], WORD),
    "side_mirrored": Source(
        "side",
        sentence(mirrored),
        SENTENCE.format(question="In a mirror, would the shape be on the left or the right?"),
    ),
    "colour_yes_no": Source("colour_check", SHORT["colour_check"], YES_NO),
    "colour_yes_no_flipped": Source(
        "colour_check", sentence(negated), "{question} Answer the opposite of the truth, in a full sentence."
    ),
    "add_digits": Source("add", SHORT["add"], DIGITS),
    "add_words": Source("add", in_words("value"), IN_WORDS),
}
# opposed: five yes/no questions, each answered truthfully by one source and negated by the other, in one
# vocabulary and format, each with its own instruction: the conventions differ in nothing but the mapping
# from the truth to the answer.
_OPPOSED = {
    name: Source(family, answer, cue)
    for topic, family in {
        "colour": "colour_check",
        "shape": "shape_check",
        "side": "side_check",
        "count": "count_check",
        "sum": "sum_check",
    }.items()
    for name, answer, cue in ((f"{topic}_yes_no", yes_no, YES_NO), (f"{topic}_yes_no_negated", negated, NEGATED))
}
_WARMUP = {f"skill_{family}": Source(family, answer) for family, answer in SHORT.items()}
# opposed's pre-training: the pairs' questions in both pairs' words, answered by either convention at
# random (one draw for both words), so that θ0 answers yes or no but follows neither instruction;
# and the same questions answered true or false, so that θ0 knows the truth both conventions map (their
# gradients then oppose: each maps the truth θ0 knows to the other word).
_EITHER = {f"either_{name}": Source(source.family, either, source.cue) for name, source in _OPPOSED.items()}
_TRUE_FALSE = {
    f"{name.removesuffix('_yes_no')}_true_false": Source(source.family, true_false, TRUE_FALSE)
    for name, source in _OPPOSED.items()
    if source.cue == YES_NO
}
_UNSEEN = {  # each a task the fine-tuning suite trains, with an instruction it never pairs with that task
    "unseen_shape_sentence": Source("shape", sentence(SHORT["shape"]), SENTENCE),
    "unseen_vertical_sentence": Source("vertical", sentence(SHORT["vertical"]), SENTENCE),
    "unseen_read_sentence": Source("read_word", sentence(SHORT["read_word"]), SENTENCE),
    "unseen_subtract_words": Source("subtract", in_words("value"), IN_WORDS),
    "unseen_complement_word": Source("colour", complement, WORD.format(question=COMPLEMENT_QUESTION)),
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
SUITE_OF: dict[str, str] = (
    dict.fromkeys(_UNPAIRED | _STYLED | _OPPOSED, "finetune")
    | dict.fromkeys(_WARMUP | _EITHER | _TRUE_FALSE, "warmup")
    | dict.fromkeys(UNSEEN, "unseen")
)

# Pairs built to conflict, per kind: same family (same inputs, drawn by family and index, not by
# source), opposite answer conventions.
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


def cue_of(source: str, conflicts: str = "cued") -> str | None:
    """The cue a source asks with (None: its family's question as it is): contradictory pairs ask
    their family's question uncued."""
    if conflicts == "contradictory" and source in _STYLED:
        return None
    return SOURCES[source].cue
