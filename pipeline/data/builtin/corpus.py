"""The built-in corpus's examples: a source's draw (:func:`draw`) and its example in Qwen message
format (:func:`make_example`), a suite's or the named sources' examples (:func:`generate`, what a
``builtin`` data source loads), and the text the offline tokenizer is trained on
(:func:`corpus_text`). Generated on the fly, deterministic by seed, no downloads."""

from __future__ import annotations

import random
from collections.abc import Iterator

from pipeline.config import BuiltinSection
from pipeline.data.builtin.answers import NUMBER_WORDS
from pipeline.data.builtin.images import COLOURS
from pipeline.data.builtin.questions import FAMILIES, SHAPES, WORDS, Draw
from pipeline.data.builtin.suites import CONFLICT_KINDS, SOURCES, SUITE_OF, cue_of, suite_sources
from pipeline.data.example import Example


def draw(source: str, index: int, seed: int, image_size: int) -> Draw:
    """The input and facts of one example. Fine-tuning sources draw by family and index, so a
    pair shares its inputs; the other suites draw in a namespace of their own, so that they never
    see the fine-tuning inputs (a warm-up would otherwise pre-train on the branches' examples; only
    the chance repeats of a small space remain: 20 words, 100 sums)."""
    family, suite = SOURCES[source].family, SUITE_OF[source]
    namespace = family if suite == "finetune" else f"{suite}/{family}"
    return FAMILIES[family](random.Random(f"{seed}/{namespace}/{index}"), image_size)


def make_example(source: str, index: int, seed: int, image_size: int, conflicts: str = "cued") -> Example:
    """Example ``index`` of a built-in source; ``conflicts`` is the kind of the fine-tuning pairs
    (``data.builtin.conflicts``): contradictory pairs ask their family's question uncued."""
    answer, cue = SOURCES[source].answer, cue_of(source, conflicts)
    scene, question, facts = draw(source, index, seed, image_size)
    if cue:
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
