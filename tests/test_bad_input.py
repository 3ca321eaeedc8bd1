"""Every kind of bad record: an error naming the file and record, or skipped and counted."""

import json

import pytest
from conftest import llava_record, small_config, write_image, write_json

from pipeline.data import DataError, load_sources, prepare_data
from pipeline.models import processor_for

GOOD = llava_record("a.png")
BAD_RECORDS = {
    "no conversations": ({"image": "a.png"}, "no 'conversations' or 'messages'"),
    "unknown role": (
        {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},
        "unknown role 'robot'",
    ),
    "tag count": (llava_record("a.png") | {"image": ["a.png", "a.png"]}, "1 <image> tags but 2 images"),
    "missing image": (llava_record("nope.png"), "'nope.png' not found"),
    "escaping path": (llava_record("../secret.png"), "escapes the images folder"),
    "absolute path": (llava_record("/etc/passwd"), "escapes the images folder"),
    "no answer": ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
}


def write_source(tmp_path, bad_record):
    write_image(tmp_path / "imgs" / "a.png")
    write_image(tmp_path / "secret.png")
    return write_json(tmp_path / "imgs" / "data.json", [GOOD, bad_record, GOOD])


def config(path, policy="error", **extra):
    spec = {"name": "src", "format": "llava", "path": str(path), **extra}
    return small_config(f"data.sources={json.dumps([spec])}", f"data.on_bad_record={policy}")


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_record_error_names_file_and_record(tmp_path, case):
    record, message = BAD_RECORDS[case]
    path = write_source(tmp_path, record)
    with pytest.raises(DataError, match=rf"data\.json record 1: .*{message}") as err:
        load_sources(config(path).data, 0)
    assert err.value.index == 1 and err.value.origin == str(path)


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_record_skipped_and_counted(tmp_path, case):
    record, message = BAD_RECORDS[case]
    loaded = load_sources(config(write_source(tmp_path, record), "skip").data, 0)
    assert [ex.index for ex in loaded.examples["src"]] == [0, 2]
    (reason,) = loaded.skipped["src"]
    assert "record 1" in reason and message.split("'")[0] in reason


def test_unreadable_image_fails_in_prepare_naming_the_record(tmp_path):
    path = write_source(tmp_path, llava_record("broken.png"))
    (tmp_path / "imgs" / "broken.png").write_bytes(b"not a png at all")
    cfg = config(path)
    with pytest.raises(DataError, match=r"data\.json record 1: unreadable image"):
        prepare_data(cfg, tmp_path / "run", processor_for(cfg))


def test_invalid_jsonl_line_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(llava_record(None)) + "\n{oops\n")
    with pytest.raises(DataError, match=r"d\.jsonl record 1: invalid JSON"):
        load_sources(config(path, format="jsonl").data, 0)


def test_empty_source_is_an_error_or_dropped(tmp_path):
    path = write_json(tmp_path / "empty.json", [])
    with pytest.raises(DataError, match="empty.json: source 'src' has no examples"):
        load_sources(config(path).data, 0)
    other = {"name": "b", "format": "builtin", "tasks": ["add_digits"]}
    spec = {"name": "src", "format": "llava", "path": str(path)}
    cfg = small_config(f"data.sources={json.dumps([spec, other])}", "data.on_bad_record=skip")
    manifest = prepare_data(cfg, tmp_path / "run", processor_for(cfg))
    assert manifest["sources"]["src"]["dropped"] is True
    assert manifest["sources"]["add_digits"]["examples"] == 12


def test_unreadable_file_and_missing_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json: cannot read JSON"):
        load_sources(config(tmp_path / "bad.json").data, 0)
    with pytest.raises(DataError, match="file not found"):
        load_sources(config(tmp_path / "absent.json").data, 0)
    with pytest.raises(DataError, match=r"absent\.json: source 'src': file not found"):  # so does prepare
        prepare_data(
            config(tmp_path / "absent.json"), tmp_path / "run", processor_for(config(tmp_path / "absent.json"))
        )


def test_an_example_longer_than_a_packed_micro_batch_is_refused_by_prepare_naming_it(tmp_path):
    """Record 1's long answer does not fit train.max_tokens: prepare names it; with data.max_length
    within the budget it is truncated instead, and counted."""
    long = llava_record("a.png", answer=" ".join(["red"] * 200))
    path = write_source(tmp_path, long)
    spec = {"name": "src", "format": "llava", "path": str(path)}
    tight = small_config(f"data.sources={json.dumps([spec])}", "train.max_tokens=128")
    with pytest.raises(
        DataError, match=r"data\.json record 1: \d+ tokens do not fit a packed micro batch of train.max_tokens = 128"
    ):
        prepare_data(tight, tmp_path / "run", processor_for(tight))
    cut = tight.model_copy(update={"data": tight.data.model_copy(update={"max_length": 128})})
    manifest = prepare_data(cut, tmp_path / "run", processor_for(cut))
    assert manifest["sources"]["src"]["truncated"] == 1
