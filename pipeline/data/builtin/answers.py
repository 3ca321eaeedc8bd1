"""The answer conventions of the built-in corpus: functions from a question family's facts to the
answer a source wants (:data:`SHORT`, each family's terse answer; in a full sentence, with the
number in words, the complementary colour, the mirrored side; yes/no truthful, negated, either at
random, or true/false), and the cues, the instructions a source asks for its convention with, in
which ``{question}`` stands for its family's question."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.data.builtin.questions import Facts

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
COMPLEMENT = {
    "red": "green",
    "green": "red",
    "blue": "orange",
    "orange": "blue",
    "yellow": "purple",
    "purple": "yellow",
}
_OTHER_SIDE = {"left": "right", "right": "left"}


def yes_no(facts: Facts) -> str:
    return "yes" if facts["match"] else "no"


def negated(facts: Facts) -> str:
    return "no" if facts["match"] else "yes"


def either(facts: Facts) -> str:
    return yes_no(facts) if facts["convention"] else negated(facts)


def true_false(facts: Facts) -> str:
    return "true" if facts["match"] else "false"


# The short answer to each family's question: the warm-up skills' and the pairs' terse side.
SHORT: dict[str, Callable[[Facts], str]] = {
    "colour": lambda f: f["colour"],
    "shape": lambda f: f["kind"],
    "count": lambda f: str(f["n"]),
    "side": lambda f: f["side"],
    "colour_check": yes_no,
    "shape_check": yes_no,
    "side_check": yes_no,
    "count_check": yes_no,
    "sum_check": yes_no,
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


def sentence(answer: Callable[[Facts], str]) -> Callable[[Facts], str]:
    return lambda facts: f"The answer is {answer(facts)}."


def in_words(key: str) -> Callable[[Facts], str]:
    return sentence(lambda f: NUMBER_WORDS[f[key]])


def complement(facts: Facts) -> str:
    return COMPLEMENT[facts["colour"]]


def mirrored(facts: Facts) -> str:
    return _OTHER_SIDE[facts["side"]]


# Cues: the question a source asks, "{question}" standing for its family's.
WORD = "{question} Answer with one word."
DIGITS = "{question} Answer with digits."
SENTENCE = "{question} Answer in a full sentence."
IN_WORDS = "{question} Answer in a full sentence, with the number in words."
COMPLEMENT_QUESTION = "What is the complementary colour of the shape?"
YES_NO = "{question} Answer yes or no."
NEGATED = "{question} Answer yes or no, the opposite of the truth."
TRUE_FALSE = "{question} Answer true or false."
