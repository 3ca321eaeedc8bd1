import io

from conftest import small_config

from pipeline.data import load_sources
from pipeline.data.builtin import CONFLICTS, FAMILIES, SOURCES, make_example


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


def test_designed_conflicts_are_real():
    """Conflicting sources: the same input (image bytes and question), a different target."""
    assert len(CONFLICTS) >= 4
    for left, right in CONFLICTS:
        assert SOURCES[left][0] == SOURCES[right][0]  # one family: one input distribution
        for index in range(20):
            a, b = make_example(left, index, 0, 112), make_example(right, index, 0, 112)
            assert question(a) == question(b)
            assert (png(a) == png(b)) if a.images else not b.images
            assert a.answer() != b.answer(), (left, right, index)


def test_answers_follow_the_drawn_facts():
    words = {f"The answer is {w}." for w in ("one", "two", "three", "four", "five", "six")}
    assert make_example("count_words", 0, 0, 112).answer() in words
    digits = make_example("count_digits", 0, 0, 112).answer()
    assert digits.isdigit() and 1 <= int(digits) <= 6
    add = make_example("add_digits", 5, 0, 112)
    a, b = (int(t) for t in question(add).removeprefix("What is ").removesuffix("?").split(" + "))
    assert add.answer() == str(a + b)
    img = make_example("side_left_right", 1, 0, 112)
    pixels = img.load_images()[0].convert("L").load()
    dark_left = sum(pixels[x, y] < 250 for x in range(56) for y in range(112))
    dark_right = sum(pixels[x, y] < 250 for x in range(56, 112) for y in range(112))
    assert img.answer() == ("left" if dark_left > dark_right else "right")
