import torch
from conftest import small_config

from pipeline.data import IGNORE_INDEX, Collator, Encoder, Example, load_sources
from pipeline.data.builtin import make_example


def text_example(*turns: str) -> Example:
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in zip(roles, turns)]
    return Example("t", 0, "test", messages)


def ids(processor, text: str) -> list[int]:
    return processor.tokenizer.encode(text, add_special_tokens=False)


def test_labels_cover_exactly_the_assistant_turns(processor):
    enc = Encoder(processor, 512)(text_example("What is 1 + 1?", "2", "And 2 + 2?", "four"))
    # An independent expectation: tokenize the template's pieces one by one.
    prompt1 = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt2 = "<|im_start|>user\nAnd 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    pieces = [(prompt1, False), ("2<|im_end|>\n", True), (prompt2, False), ("four<|im_end|>\n", True)]
    expected_ids, expected_labels = [], []
    for text, learned in pieces:
        piece = ids(processor, text)
        expected_ids += piece
        expected_labels += piece if learned else [IGNORE_INDEX] * len(piece)
    assert enc.input_ids.tolist() == expected_ids
    assert enc.labels.tolist() == expected_labels
    assert enc.num_supervised == len(ids(processor, "2<|im_end|>\n")) + len(ids(processor, "four<|im_end|>\n"))


def test_image_tokens_are_never_labelled(processor):
    cfg = small_config()
    enc = Encoder(processor, 512)(make_example("colour_name", 0, 0, 112))
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((enc.input_ids == image_id).sum()) == 16  # 112x112 -> 8x8 patches -> 2x2 merge
    assert torch.equal(enc.mm_token_type_ids, (enc.input_ids == image_id).long())
    assert (enc.labels[enc.input_ids == image_id] == IGNORE_INDEX).all()
    answer = make_example("colour_name", 0, 0, 112).answer()
    learned = enc.labels[enc.labels != IGNORE_INDEX].tolist()
    assert learned == ids(processor, answer + "<|im_end|>\n")
    assert enc.pixel_values.shape == (64, 3 * 2 * 14 * 14) and enc.image_grid_thw.tolist() == [[1, 8, 8]]
    assert cfg.data.max_length > enc.num_tokens


def test_truncation_never_splits_an_image(processor):
    example = make_example("colour_name", 0, 0, 112)
    full = Encoder(processor, 512)(example)
    vision_start = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    start = int((full.input_ids == vision_start).nonzero()[0])
    inside = Encoder(processor, start + 5)(example)  # the cut falls inside the image span
    assert inside.truncated and inside.num_tokens == start
    assert inside.pixel_values is None and inside.image_grid_thw is None
    assert torch.equal(inside.input_ids, full.input_ids[:start])
    after = Encoder(processor, full.num_tokens - 2)(example)  # cut in the answer: image kept
    assert after.truncated and after.num_tokens == full.num_tokens - 2
    assert torch.equal(after.pixel_values, full.pixel_values)
    assert torch.equal(after.labels, full.labels[: full.num_tokens - 2])


def test_batch_encoding_matches_one_by_one(processor):
    cfg = small_config()
    loaded = load_sources(cfg.data, 0).examples
    examples = [loaded[s][i] for s in ("colour_name", "add_words", "bigger_side", "caption") for i in (0, 1)]
    encoder = Encoder(processor, 512)
    for batched, example in zip(encoder.encode_batch(examples), examples):
        single = encoder(example)
        assert torch.equal(batched.input_ids, single.input_ids)
        assert torch.equal(batched.labels, single.labels)
        assert (batched.pixel_values is None) == (single.pixel_values is None)
        if single.pixel_values is not None:
            assert torch.equal(batched.pixel_values, single.pixel_values)


def test_collator_pads_and_concatenates_images(processor):
    encoder = Encoder(processor, 512)
    items = [encoder(make_example(s, 0, 0, 112)) for s in ("add_digits", "colour_name", "uppercase", "bigger_side")]
    batch = Collator(processor.tokenizer.pad_token_id)(items)
    length = max(i.num_tokens for i in items)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, length)
    for row, item in enumerate(items):
        n = item.num_tokens
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (length - n)
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert torch.equal(batch["input_ids"][row, :n], item.input_ids)
    assert batch["pixel_values"].shape[0] == 2 * 64
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    text_only = Collator(0)([items[0], items[2]])
    assert "pixel_values" not in text_only
