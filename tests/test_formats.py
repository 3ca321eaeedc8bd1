"""Each loader on small fixture files written here."""

import io
import json
import tarfile
import zipfile

import datasets
import pytest
from conftest import llava_record, small_config, write_image, write_json
from PIL import Image, ImageFile

from pipeline.data import DataError, load_sources
from pipeline.data.formats import read_json_records


def load(tmp_path, *sources, **data):
    overrides = [f"data.sources={json.dumps(list(sources))}"] + [f"data.{k}={v}" for k, v in data.items()]
    return load_sources(small_config(*overrides).data, seed=0)


def test_llava_json(tmp_path):
    write_image(tmp_path / "imgs" / "a.png")
    path = write_json(tmp_path / "llava.json", [llava_record("a.png"), llava_record(None, "2")])
    loaded = load(tmp_path, {"name": "l", "format": "llava", "path": str(path), "images_dir": str(tmp_path / "imgs")})
    first, second = loaded.examples["l"]
    assert first.messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ]
    assert first.images == [(tmp_path / "imgs" / "a.png").resolve()]
    assert first.load_images()[0].size == (64, 48)
    assert second.images == [] and second.answer() == "2"


def test_sharegpt_json_with_system_turn_and_two_images(tmp_path):
    write_image(tmp_path / "x.png")
    write_image(tmp_path / "sub" / "y.png", (0, 0, 255))
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "<image><image>Which is blue?"},
            {"role": "assistant", "content": "the second"},
        ],
        "images": ["x.png", "sub/y.png"],
    }
    path = write_json(tmp_path / "sg.json", [record])
    (example,) = load(tmp_path, {"name": "s", "format": "sharegpt", "path": str(path)}).examples["s"]
    assert [m["role"] for m in example.messages] == ["system", "user", "assistant"]
    assert example.messages[1]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "Which is blue?"},
    ]
    assert [img.getpixel((0, 0)) for img in example.load_images()] == [(255, 0, 0), (0, 0, 255)]


def test_vision_flan_one_source_per_task(tmp_path):
    write_image(tmp_path / "images" / "p.png")
    records = [
        {
            "id": str(i),
            "task_name": task,
            "image": "p.png",
            "conversations": [{"from": "human", "value": "<image>\nQ?"}, {"from": "gpt", "value": task}],
        }
        for i, task in enumerate(["ocr", "vqa", "ocr", "caption"])
    ]
    path = write_json(tmp_path / "annotation_191-task_1k.json", records)
    spec = {"name": "vflan", "format": "vision_flan", "path": str(path), "images_dir": str(tmp_path / "images")}
    loaded = load(tmp_path, spec)
    assert sorted(loaded.examples) == ["caption", "ocr", "vqa"]
    assert [ex.index for ex in loaded.examples["ocr"]] == [0, 2]
    only = load(tmp_path, {**spec, "tasks": ["vqa"]})
    assert list(only.examples) == ["vqa"] and only.examples["vqa"][0].answer() == "vqa"


def test_jsonl_mixes_record_shapes_and_caps_examples(tmp_path):
    write_image(tmp_path / "a.png")
    lines = [
        llava_record("a.png"),
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines * 3) + "\n\n")
    spec = {"name": "j", "format": "jsonl", "path": str(path), "max_examples": 4}
    kept = load(tmp_path, spec).examples["j"]
    # A seeded sample of 4 of the 6 records, in their order: not the first 4, the same on every load.
    assert [ex.index for ex in kept] == [1, 3, 4, 5] and [ex.answer() for ex in kept] == [
        "hello",
        "hello",
        "red",
        "hello",
    ]
    assert [ex.index for ex in load(tmp_path, spec).examples["j"]] == [1, 3, 4, 5]


def test_datasets_saved_to_disk_with_decoded_images(tmp_path):
    ds = datasets.Dataset.from_dict(
        {
            "messages": [[{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "green"}]],
            "images": [[Image.new("RGB", (32, 32), (0, 255, 0))]],
        },
        features=datasets.Features(
            {
                "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                "images": datasets.Sequence(datasets.Image()),
            }
        ),
    )
    ds.save_to_disk(tmp_path / "ds")
    (example,) = load(tmp_path, {"name": "h", "format": "hf_disk", "path": str(tmp_path / "ds")}).examples["h"]
    assert example.answer() == "green"
    assert example.load_images()[0].getpixel((3, 3)) == (0, 255, 0)


def test_builtin_task_selection(tmp_path):
    loaded = load(tmp_path, {"name": "b", "format": "builtin", "tasks": ["add_digits", "caption"], "max_examples": 3})
    assert {k: len(v) for k, v in loaded.examples.items()} == {"add_digits": 3, "caption": 3}
    with pytest.raises(ValueError, match="unknown built-in tasks"):
        load(tmp_path, {"name": "b", "format": "builtin", "tasks": ["nope"]})


def test_a_dataset_dict_folder_is_named(tmp_path):
    from pipeline.data import DataError

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": [[]]})}).save_to_disk(tmp_path / "dd")
    with pytest.raises(DataError, match=r"dd: a DatasetDict with splits \['train'\]"):
        load(tmp_path, {"name": "h", "format": "hf_disk", "path": str(tmp_path / "dd")})


def test_vision_flans_release_reads_its_images_inside_the_zip_as_shipped(tmp_path):
    """The release's layout: the annotation file beside ``image_191-task_1k.zip``, whose members sit
    under one top folder; no unzip step. A tar archive is read the same way."""
    pictures = {name: Image.new("RGB", (40 + i, 30), colour) for i, (name, colour) in enumerate(
        [("ocr_1.jpg", (250, 0, 0)), ("vqa_2.jpg", (0, 250, 0))]
    )}  # fmt: skip
    with zipfile.ZipFile(tmp_path / "image_191-task_1k.zip", "w") as archive:
        for name, picture in pictures.items():
            data = io.BytesIO()
            picture.save(data, format="PNG")
            archive.writestr(f"image_191-task_1k/images/{name}", data.getvalue())
    records = [
        {"id": str(i), "task_name": name.split("_")[0], "image": f"images/{name}",
         "conversations": [{"from": "human", "value": "<image>\nQ?"}, {"from": "gpt", "value": name}]}
        for i, name in enumerate(pictures)
    ]  # fmt: skip
    path = write_json(tmp_path / "annotation_191-task_1k.json", records)
    loaded = load(tmp_path, {"name": "vflan", "format": "vision_flan", "path": str(path)})
    for name, picture in pictures.items():
        (example,) = loaded.examples[name.split("_")[0]]
        assert repr(example.images[0]) == f"{tmp_path / 'image_191-task_1k.zip'}!image_191-task_1k/images/{name}"
        assert example.load_images()[0].tobytes() == picture.tobytes()

    tarred = tmp_path / "tarred"
    tarred.mkdir()
    with tarfile.open(tarred / "images.tar", "w") as archive:
        archive.add(write_image(tmp_path / "loose" / "images" / "a.png"), arcname="images/a.png")
    path = write_json(tarred / "llava.json", [llava_record("images/a.png")])
    (example,) = load(tarred, {"name": "t", "format": "llava", "path": str(path)}).examples["t"]
    assert example.load_images()[0].size == (64, 48)


def test_a_json_annotation_file_is_read_a_chunk_at_a_time_and_a_cut_one_is_named(tmp_path):
    records = [{"id": i, "text": "]" * (i % 9), "nested": [{"x": "[,"}]} for i in range(200)]
    path = write_json(tmp_path / "big.json", records)
    for chunk in (1, 5, 64, 1 << 20):  # records split across reads at every place
        assert list(read_json_records(path, chunk)) == records
    path.write_text(path.read_text()[:-40])
    with pytest.raises(DataError, match=r"big.json record 19\d: cannot read JSON"):
        list(read_json_records(path, 64))


def test_a_truncated_image_passes_the_header_read_and_is_named_by_its_record_when_decoded(tmp_path, monkeypatch):
    # PIL's own default; lmms-eval's task module sets it to True in any process that imports it
    # (then a cut image decodes padded), which a test run may have done before this test.
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)
    data = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(data, format="PNG")
    with zipfile.ZipFile(tmp_path / "images.zip", "w") as archive:
        archive.writestr("images/cut.png", data.getvalue()[:-30])  # its header whole, its pixels cut
    path = write_json(tmp_path / "llava.json", [llava_record("images/cut.png")])
    (example,) = load(tmp_path, {"name": "t", "format": "llava", "path": str(path)}).examples["t"]
    assert example.image_sizes() == [(64, 48)]  # what prepare reads
    with pytest.raises(DataError, match=r"llava.json record 0: unreadable image images/cut.png"):
        example.load_images()
