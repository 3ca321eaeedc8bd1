import hashlib
import io

import pytest
from conftest import small_config

from pipeline.config import BuiltinSection
from pipeline.data import load_sources
from pipeline.data.builtin import (
    CONFLICT_KINDS,
    CONFLICTS,
    FAMILIES,
    FINETUNE,
    SHORT,
    SOURCES,
    UNSEEN,
    WARMUP,
    corpus_text,
    draw,
    generate,
    make_example,
)


def png(example) -> bytes:
    out = io.BytesIO()
    example.load_images()[0].save(out, format="PNG")
    return out.getvalue()


def question(example) -> str:
    return example.messages[0]["content"][-1]["text"]


def test_at_least_16_sources_with_images_and_text_only():
    examples = load_sources(small_config().data, 0).examples
    assert len(examples) >= 16
    with_images = {name for name, exs in examples.items() if exs[0].images}
    assert len(with_images) >= 10 and len(examples) - len(with_images) >= 4
    assert len(FAMILIES) >= 10  # colours, shapes, counting, positions, reading, arithmetic, captions, ...


def test_generation_is_deterministic_by_seed():
    a = load_sources(small_config().data, 3).examples
    b = load_sources(small_config().data, 3).examples
    c = load_sources(small_config().data, 4).examples
    for name in ("colour_name", "count_digits", "read_word", "bigger_side"):
        for x, y in zip(a[name], b[name]):
            assert x.messages == y.messages and png(x) == png(y)
    assert any(png(x) != png(z) for x, z in zip(a["colour_name"], c["colour_name"]))


@pytest.mark.parametrize("kind", CONFLICT_KINDS)
def test_designed_conflicts_are_real(kind):
    """Conflicting sources: the same input (image bytes, and the question unless contradictory),
    a different target; cued and opposed pairs ask each their own question. Opposed pairs answer
    in one vocabulary, yes or no, each the other's negation."""
    assert len(CONFLICTS[kind]) == 5 and {s for pair in CONFLICTS[kind] for s in pair} <= set(FINETUNE[kind])
    for left, right in CONFLICTS[kind]:
        assert SOURCES[left][0] == SOURCES[right][0]  # one family: one input distribution
        for index in range(20):
            a, b = make_example(left, index, 0, 112, kind), make_example(right, index, 0, 112, kind)
            assert (question(a) == question(b)) == (kind == "contradictory")
            assert (png(a) == png(b)) if a.images else not b.images
            assert a.answer() != b.answer(), (left, right, index)
            if kind == "opposed":
                assert {a.answer(), b.answer()} == {"yes", "no"}
            else:
                assert b.answer().startswith("The answer is ")  # the second of a pair: full sentences


CUED = {  # example 7 of seed 0: question -> answer
    "colour_name": ("What colour is the shape? Answer with one word.", "red"),
    "colour_complement": (
        "What is the complementary colour of the shape? Answer in a full sentence.",
        "The answer is green.",
    ),
    "count_digits": ("How many dots are there? Answer with digits.", "2"),
    "count_words": (
        "How many dots are there? Answer in a full sentence, with the number in words.",
        "The answer is two.",
    ),
    "side_left_right": ("Is the shape on the left or the right? Answer with one word.", "left"),
    "side_mirrored": (
        "In a mirror, would the shape be on the left or the right? Answer in a full sentence.",
        "The answer is right.",
    ),
    "colour_yes_no": ("Is the shape blue? Answer yes or no.", "no"),
    "colour_yes_no_flipped": (
        "Is the shape blue? Answer the opposite of the truth, in a full sentence.",
        "The answer is yes.",
    ),
    "add_digits": ("What is 9 + 1? Answer with digits.", "10"),
    "add_words": ("What is 9 + 1? Answer in a full sentence, with the number in words.", "The answer is ten."),
    "caption": ("Describe the image.", "A large blue circle on the left."),  # outside the pairs: uncued
    "skill_count": ("How many dots are there?", "6"),
    "unseen_subtract_words": (
        "What is 7 - 4? Answer in a full sentence, with the number in words.",
        "The answer is three.",
    ),
    "unseen_shape_sentence": ("What shape is in the picture? Answer in a full sentence.", "The answer is triangle."),
}


def test_cued_sources_ask_their_own_question():
    for source, (asked, answer) in CUED.items():
        example = make_example(source, 7, 0, 56)
        assert (question(example), example.answer()) == (asked, answer), source


def test_contradictory_kind_is_the_corpus_as_it_was():
    """Bit for bit the examples from before cued conflicts existed: questions, answers and the
    drawn scenes (the fingerprint covers each scene's shapes, colours and positions)."""
    assert [(question(e), e.answer()) for e in (make_example(s, 0, 0, 56, "contradictory") for s in CUED)][:10] == [
        ("What colour is the shape?", "purple"),
        ("What colour is the shape?", "The answer is yellow."),
        ("How many dots are there?", "5"),
        ("How many dots are there?", "The answer is five."),
        ("Is the shape on the left or the right?", "left"),
        ("Is the shape on the left or the right?", "The answer is right."),
        ("Is the shape red?", "yes"),
        ("Is the shape red?", "The answer is no."),
        ("What is 7 + 4?", "11"),
        ("What is 7 + 4?", "The answer is eleven."),
    ]
    fingerprints = [
        make_example(s, i, 0, 112, "contradictory").fingerprint() for s in FINETUNE["contradictory"] for i in range(24)
    ]
    assert hashlib.sha256(str(fingerprints).encode()).hexdigest()[:16] == "508812640cb4a285"


def test_suites_and_their_generation():
    finetune, warmup = set().union(*FINETUNE.values()), set().union(*WARMUP.values())
    assert finetune.isdisjoint(warmup) and finetune.union(warmup, UNSEEN) == set(SOURCES)
    assert [len(FINETUNE[kind]) for kind in CONFLICT_KINDS] == [18] * 3
    assert FINETUNE["cued"] == FINETUNE["contradictory"] and WARMUP["cued"] == WARMUP["contradictory"]
    assert [SOURCES[s].family for s in WARMUP["cued"]] == list(SHORT) and set(SHORT) == set(FAMILIES)  # a skill each
    # opposed: no skill of a pair's family, but the pairs' questions answered by either convention,
    # and answered true or false
    paired = {SOURCES[s].family for pair in CONFLICTS["opposed"] for s in pair}
    either = [s for s in WARMUP["opposed"] if s.startswith("either_")]
    assert [s.removeprefix("either_") for s in either] == [s for pair in CONFLICTS["opposed"] for s in pair]
    true_false = [s for s in WARMUP["opposed"] if s.endswith("_true_false")]
    assert [SOURCES[s].family for s in true_false] == [SOURCES[a].family for a, _ in CONFLICTS["opposed"]]
    assert {SOURCES[s].family for s in WARMUP["opposed"] if s not in either + true_false} == set(SHORT) - paired
    answers = []
    for source in true_false:
        for i in range(8):
            _, asked, facts = draw(source, i, 0, 56)
            example = make_example(source, i, 0, 56, "opposed")
            assert question(example) == f"{asked} Answer true or false."
            answers.append(example.answer())
            assert example.answer() == ("true" if facts["match"] else "false")
    assert set(answers) == {"true", "false"}
    cfg = BuiltinSection(examples_per_source=2, image_size=56)
    assert list(generate(None, cfg, 0)) == FINETUNE["cued"]
    opposed = BuiltinSection(examples_per_source=2, image_size=56, conflicts="opposed")
    assert list(generate(None, opposed, 0)) == FINETUNE["opposed"]
    assert [len(v) for v in generate(["skill_add"], cfg, 0, count=5).values()] == [5]  # a source entry's max_examples
    assert list(generate(None, cfg, 0, "unseen")) == UNSEEN
    assert list(generate(["skill_add", "colour_name"], cfg, 0, "unseen")) == ["skill_add", "colour_name"]
    with pytest.raises(ValueError, match=r"unknown built-in tasks \['nope'\]; known: \[.*'skill_add'"):
        generate(["nope"], cfg, 0)
    contradictory = BuiltinSection(examples_per_source=2, image_size=56, conflicts="contradictory")
    assert question(generate(["count_words"], contradictory, 0)["count_words"][0]) == "How many dots are there?"


def warmup_sources() -> list[str]:
    return list(dict.fromkeys(s for kind in CONFLICT_KINDS for s in WARMUP[kind]))


def test_suites_do_not_share_inputs_with_the_fine_tuning_suite():
    """A warm-up or unseen source draws its own inputs: never the fine-tuning draw of the same
    family and index. Only chance repeats remain, in families with few distinct inputs."""
    finetune = {SOURCES[s].family: s for kind in CONFLICT_KINDS for s in FINETUNE[kind]}  # a family's share draws
    few_inputs = {"count", "read_word", "add", "subtract", "reverse", "upper"}  # at most 2,790 inputs each
    for source in [*warmup_sources(), *UNSEEN]:
        family = SOURCES[source].family
        if family not in finetune:  # the multiple-choice and description skills: no fine-tuning twin
            continue
        same = sum(draw(source, i, 0, 56) == draw(finetune[family], i, 0, 56) for i in range(48))
        assert same <= (8 if family in few_inputs else 0), (source, same)


def test_the_tokenizer_corpus_covers_every_suite_and_kind():
    text = set(corpus_text(0, per_source=2))
    for source in SOURCES:
        for kind in CONFLICT_KINDS:
            example = make_example(source, 0, 0, 28, kind)
            assert {question(example), example.answer()} <= text, (source, kind)


def test_answers_follow_the_drawn_facts():
    words = {f"The answer is {w}." for w in ("one", "two", "three", "four", "five", "six")}
    assert make_example("count_words", 0, 0, 112).answer() in words
    digits = make_example("count_digits", 0, 0, 112).answer()
    assert digits.isdigit() and 1 <= int(digits) <= 6
    add = make_example("add_digits", 5, 0, 112)
    a, b = (int(t) for t in question(add).removeprefix("What is ").partition("?")[0].split(" + "))
    assert add.answer() == str(a + b)
    img = make_example("side_left_right", 1, 0, 112)
    pixels = img.load_images()[0].convert("L").load()
    dark_left = sum(pixels[x, y] < 250 for x in range(56) for y in range(112))
    dark_right = sum(pixels[x, y] < 250 for x in range(56, 112) for y in range(112))
    assert img.answer() == ("left" if dark_left > dark_right else "right")
