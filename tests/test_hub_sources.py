"""``format: hub`` sources: a hub data set's subsets as sources, read offline from a hub-shaped cache
(what ``hf download ID --repo-type dataset`` leaves), in the Cauldron's and LLaVA-OneVision-Data's
shapes, through prepare, preflight and calibration."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import small_config
from datasets import Dataset, Features, Image, List, Value
from PIL import Image as PILImage

from calibration.errors import CalibrationError
from calibration.plots import clustered, plot_conflicts
from calibration.split import plan_split
from calibration.stage import refuse_small_sources
from merit.bench.hub_cache import image, revision, write_dataset_cache, write_mixture
from merit.cli import main as merit
from pipeline.config import ConfigError, DataSection, SourceSpec, load_config
from pipeline.data import DataError, Encoder, Example, active_sources, load_sources, load_split, prepare_data
from pipeline.data.hub import check_hub_source
from pipeline.layout import run_config
from pipeline.preflight import PreflightError, check_run

ROOT = Path(__file__).parent.parent
DEMO = str(ROOT / "configs" / "demo.yaml")
CAULDRON, ONEVISION = "HuggingFaceM4/the_cauldron", "lmms-lab/LLaVA-OneVision-Data"
SUBSETS, ROWS = 40, 6


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    """HF_HOME with a 40-subset Cauldron-shaped mixture and a 6-subset LLaVA-OneVision-shaped one."""
    home = tmp_path_factory.mktemp("hf")
    write_mixture(home, CAULDRON, SUBSETS, ROWS)
    write_mixture(home, ONEVISION, 6, 10, shape="onevision")
    return home


@pytest.fixture
def offline_hub(hub_home, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return hub_home


def hub_source(name: str, repo: str, **fields) -> str:
    return yaml.safe_dump({"name": name, "format": "hub", "path": repo, **fields}, default_flow_style=True).strip()


def test_forty_cauldron_subsets_become_forty_sources_and_calibration_splits_them_into_eight(offline_hub, tmp_path):
    run = tmp_path / "run"
    settings = [
        f"data.sources=[{hub_source('cauldron', CAULDRON, subsets='all')}]",
        "warmup.steps=0",
        "warmup.sources=[]",
        "eval.sources=[]",
        "eval.benchmarks=[]",
        "calibration.r=3",
        "calibration.n_per_source=4",
    ]
    args = [DEMO, "--run-dir", str(run), *[a for s in settings for a in ("--set", s)]]
    assert merit(["init", *args]) == 0
    assert merit(["prepare", "--run-dir", str(run)]) == 0
    assert merit(["calibrate", "--run-dir", str(run)]) == 0

    manifest = json.loads((run / "data" / "manifest.json").read_text())
    names = [f"cauldron/task_{i:03d}" for i in range(SUBSETS)]
    assert sorted(manifest["sources"]) == names
    first = manifest["sources"]["cauldron/task_000"]
    assert first["examples"] == ROWS and first["train_tokens"] > 0 and first["max_examples"] is None
    assert first["origin"] == f"{CAULDRON}@{revision(CAULDRON)[:12]}:task_000/train"
    saved = load_config(run / "config.yaml")  # the snapshot's commit, pinned for every later stage
    assert saved.data.sources[0].revision == revision(CAULDRON)

    split = json.loads((run / "calibration" / "split.json").read_text())
    groups = split["groups"]
    assert len(groups) == 8 and sorted(s for g in groups for s in g) == names
    assert sorted(len(g) for g in groups) == [5] * 8  # equal sources, balanced by samples
    assert (run / "calibration" / "conflicts.png").is_file()


def test_llava_onevision_subsets_load_by_their_names_with_images_decoded_when_encoded(offline_hub, processor, tmp_path):
    subsets = ["Task-001(source 1)", "Task-004(source 4)"]
    entry = hub_source("ov", ONEVISION, subsets=subsets, max_examples=7)
    data = DataSection(sources=[yaml.safe_load(entry)])
    manifest = prepare_data(small_config(f"data.sources=[{entry}]"), tmp_path / "run", processor)
    prepared = active_sources(manifest)
    assert sorted(prepared) == [f"ov/{s}" for s in subsets]
    assert all(p["examples"] == 7 and p["max_examples"] == 7 and p["train_tokens"] > 0 for p in prepared.values())
    loaded = load_sources(data, seed=0)
    assert list(loaded.examples) == [f"ov/{s}" for s in subsets]
    examples = loaded.examples["ov/Task-004(source 4)"]
    assert len(examples) == 7  # max_examples caps each subset: a seeded sample of its 10 rows
    assert [ex.index for ex in examples] == [0, 2, 3, 4, 6, 8, 9]
    text_only, pictured = examples[0], examples[1]  # rows 0 and 2: the fixture's every fifth row has no image
    assert text_only.images == [] and text_only.messages[0]["content"] == [
        {"type": "text", "text": "Task 4: what does picture 0 show?"}
    ]
    assert pictured.messages[0]["content"][0] == {"type": "image"}
    assert repr(pictured.images[0]) == f"{ONEVISION}@{revision(ONEVISION)[:12]}:Task-004(source 4)/train#2"
    decoded = np.asarray(pictured.load_images()[0])
    assert np.array_equal(decoded, np.asarray(image(4 + 2)))  # the stored picture of row 2, pixel for pixel
    assert pictured.fingerprint() == load_sources(data, seed=0).examples["ov/Task-004(source 4)"][1].fingerprint()


def test_a_subset_missing_from_the_cache_is_refused_before_any_stage_with_the_command_that_fetches_it(
    offline_hub, tmp_path
):
    snapshot = offline_hub / "hub" / f"datasets--{CAULDRON.replace('/', '--')}" / "snapshots" / revision(CAULDRON)
    gone = snapshot / "task_007" / "train-00000-of-00001.parquet"
    target = gone.resolve()
    gone.unlink()  # as after `hf download ... --include` of the other subsets
    try:
        sources = [
            hub_source("cauldron", CAULDRON, subsets="all"),
            hub_source("picked", CAULDRON, subsets=["task_001", "no_such_subset"]),
            hub_source("absent", "someone/not-downloaded"),
        ]
        cfg, run = run_config(DEMO, [f"data.sources=[{', '.join(sources)}]"], tmp_path / "run")
        with pytest.raises(PreflightError) as refused:
            check_run(cfg, run)
        message = str(refused.value)
        fetch = (
            f"hf download {CAULDRON} --repo-type dataset --revision {revision(CAULDRON)} --include 'task_007/train-*'"
        )
        assert fetch in message
        assert "has no subsets ['no_such_subset']" in message
        assert "`hf download someone/not-downloaded --repo-type dataset`" in message
        assert not run.exists()  # nothing ran, nothing was written

        # the prepare stage, started anyway, refuses the same way before it encodes anything
        with pytest.raises(ConfigError, match="task_007"):
            load_sources(DataSection(sources=[yaml.safe_load(sources[0])]), seed=0)
    finally:
        gone.symlink_to(target)


def test_a_column_mapping_and_a_source_column_split_one_table_into_named_sources(offline_hub):
    features = Features(
        {
            "dialogue": List({"role": Value("string"), "content": Value("string")}),
            "picture": List(Image()),
            "task": Value("string"),
        }
    )
    rows = [
        {
            "dialogue": [{"role": "user", "content": f"<image>Q{i}"}, {"role": "assistant", "content": f"A{i}"}],
            "picture": [image(i)],
            "task": ["ocr", "vqa", "caption"][i % 3],
        }
        for i in range(9)
    ]
    table = Dataset.from_dict({k: [r[k] for r in rows] for k in features}, features=features)
    write_dataset_cache(offline_hub, "someone/flan-like", {"default": {"train": table}})
    spec = hub_source(
        "flan", "someone/flan-like", source_column="task", columns={"messages": "dialogue", "images": "picture"}
    )
    loaded = load_sources(DataSection(sources=[yaml.safe_load(spec)]), seed=0)
    assert list(loaded.examples) == ["flan/caption", "flan/ocr", "flan/vqa"]
    assert [e.index for e in loaded.examples["flan/vqa"]] == [1, 4, 7]
    assert loaded.examples["flan/vqa"][0].answer() == "A1"

    unmapped = hub_source("raw", "someone/flan-like")
    with pytest.raises(DataError, match=r"match no known shape.*columns: \{messages: <column>"):
        load_sources(DataSection(sources=[yaml.safe_load(unmapped)]), seed=0)


def test_a_malformed_record_is_named_and_follows_on_bad_record(offline_hub):
    features = Features(
        {"images": List(Image()), "texts": List({"user": Value("string"), "assistant": Value("string")})}
    )
    rows = {
        "images": [[image(i)] for i in range(4)],
        "texts": [[{"user": f"q{i}", "assistant": None if i == 2 else f"a{i}"}] for i in range(4)],
    }
    write_dataset_cache(offline_hub, "someone/broken", {"one": {"train": Dataset.from_dict(rows, features=features)}})
    spec = yaml.safe_load(hub_source("broken", "someone/broken"))
    with pytest.raises(DataError, match=r"someone/broken@[0-9a-f]{12}:one/train record 2: turn text must be a string"):
        load_sources(DataSection(sources=[spec]), seed=0)
    loaded = load_sources(DataSection(sources=[spec], on_bad_record="skip"), seed=0)
    assert [e.index for e in loaded.examples["broken/one"]] == [0, 1, 3]
    assert len(loaded.skipped["broken/one"]) == 1


def png(i: int) -> bytes:
    out = io.BytesIO()
    image(i).save(out, format="PNG")
    return out.getvalue()


CORRUPT = {"bytes": b"these bytes are no image", "path": None}


def test_a_corrupt_image_in_a_two_shard_multi_turn_subset_is_skipped_by_name_and_counted(
    offline_hub, processor, tmp_path
):
    features = Features(
        {"images": List(Image()), "texts": List({"user": Value("string"), "assistant": Value("string")})}
    )
    rows = {
        "images": [[CORRUPT] if i == 5 else [image(i), image(i + 1)] for i in range(8)],
        "texts": [
            [{"user": f"q{i}", "assistant": f"a{i}"}, {"user": f"again {i}", "assistant": f"b{i}"}] for i in range(8)
        ],
    }
    write_dataset_cache(
        offline_hub, "someone/corrupt", {"one": {"train": Dataset.from_dict(rows, features=features)}}, shards=2
    )
    entry = hub_source("corrupt", "someone/corrupt")
    with pytest.raises(
        DataError,
        match=r"someone/corrupt@[0-9a-f]{12}:one/train record 5: unreadable image "
        r"\(train-00001-of-00002\.parquet row 1\): cannot identify",
    ):
        load_sources(DataSection(sources=[yaml.safe_load(entry)]), seed=0)
    cfg = small_config(f"data.sources=[{entry}]", "data.on_bad_record=skip")
    manifest = prepare_data(cfg, tmp_path / "run", processor)
    source = manifest["sources"]["corrupt/one"]
    assert source["examples"] == 7 and source["skipped"] == 1 and source["skipped_by_reason"] == {"unreadable image": 1}
    # The prepared store keeps where each image is (the second shard's row 3 for row 7), not its bytes:
    # read from the parquet file when a batch needs it, it is the row's picture, and its ids are the full path's.
    splits = [load_split(cfg, tmp_path / "run", split)["corrupt/one"] for split in ("train", "heldout")]
    stored = {ex.index: ex for split in splits for ex in split}
    assert sorted(stored) == [0, 1, 2, 3, 4, 6, 7]
    first = stored[7].images[0]
    assert (Path(first.path).name, first.row, first.item) == ("train-00001-of-00002.parquet", 3, 0)
    assert [np.asarray(d).tolist() for d in stored[7].load_images()] == [np.asarray(image(i)).tolist() for i in (7, 8)]
    encoder = Encoder(processor, cfg.data.max_length)
    fresh = Example(*(getattr(stored[7], f) for f in ("source", "index", "origin", "messages", "images")))
    assert torch.equal(encoder(stored[7]).input_ids, encoder(fresh).input_ids)
    assert torch.equal(encoder(stored[7]).pixel_values, encoder(fresh).pixel_values)
    # Both shards read, each image of a row decoded once when the row is encoded.
    examples = load_sources(DataSection(sources=[yaml.safe_load(entry)], on_bad_record="skip"), seed=0).examples
    (row,) = [ex for ex in examples["corrupt/one"] if ex.index == 7]
    opened = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PILImage, "open", lambda *a, **k: opened.append(1) or OPEN(*a, **k))
        decoded = row.load_images()
    assert len(opened) == 2 and [np.asarray(d).tolist() for d in decoded] == [
        np.asarray(image(i)).tolist() for i in (7, 8)
    ]


OPEN = PILImage.open


def test_a_partly_downloaded_subset_is_refused_naming_its_missing_shards(offline_hub):
    rows = {"texts": [[{"user": f"q{i}", "assistant": f"a{i}"}] for i in range(4)]}
    features = Features({"texts": List({"user": Value("string"), "assistant": Value("string")})})
    folder = write_dataset_cache(
        offline_hub, "someone/partial", {"one": {"train": Dataset.from_dict(rows, features=features)}}, shards=2
    )
    (folder / "one" / "train-00001-of-00002.parquet").unlink()  # a download stopped halfway
    with pytest.raises(
        ConfigError, match=r"partly downloaded: 1 shard\(s\) missing \(one/train-00001-of-00002.parquet\)"
    ):
        check_hub_source(SourceSpec(**yaml.safe_load(hub_source("partial", "someone/partial"))))


def test_path_images_untagged_rows_videos_and_data_dir_configs_are_read_as_the_hub_lays_them_out(
    offline_hub, processor, tmp_path
):
    """LLaVA-shaped rows whose image column holds paths into the snapshot, one row with an image and
    no <image> tag, one video entry; a card that names each config's data_dir only, with an archive
    of images beside the parquet files that is no data file."""
    features = Features(
        {
            "image": Value("string"),
            "video": Value("string"),
            "conversations": List({"from": Value("string"), "value": Value("string")}),
        }
    )
    rows = {
        "image": [f"images/{i}.png" if i != 3 else None for i in range(5)],
        "video": [None, None, None, "clips/3.mp4", None],
        "conversations": [
            [{"from": "human", "value": ("" if i == 1 else "<image>\n") + f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]
            for i in range(5)
        ],
    }
    extra = {f"images/{i}.png": png(i) for i in range(5)} | {"paths/images.zip": b"PK an archive of images"}
    write_dataset_cache(
        offline_hub,
        "someone/paths",
        {"paths": {"train": Dataset.from_dict(rows, features=features)}},
        data_dir=True,
        extra=extra,
    )
    entry = hub_source("paths", "someone/paths")
    manifest = prepare_data(
        small_config(f"data.sources=[{entry}]", "data.on_bad_record=skip"), tmp_path / "run", processor
    )
    source = manifest["sources"]["paths/paths"]
    assert (
        source["examples"] == 4 and source["skipped_by_reason"] == {"video": 1} and source["image_tags_inserted"] == 1
    )
    examples = load_sources(DataSection(sources=[yaml.safe_load(entry)], on_bad_record="skip"), seed=0).examples[
        "paths/paths"
    ]
    assert [ex.index for ex in examples] == [0, 1, 2, 4]
    assert examples[1].messages[0]["content"][0] == {"type": "image"}  # the tag the row lacked
    for ex in examples:
        assert np.asarray(ex.load_images()[0]).tolist() == np.asarray(image(ex.index)).tolist()


def test_sources_smaller_than_the_calibration_sample_are_refused_when_asked_naming_each():
    with pytest.raises(CalibrationError, match=r"2 sources .*'a' \(3\), 'c' \(1\)"):
        refuse_small_sources({"a": 3, "b": 8, "c": 1}, 8)
    refuse_small_sources({"a": 8}, 8)
    with pytest.raises(ValueError, match="are for hub sources only"):
        DataSection(sources=[{"name": "x", "format": "llava", "path": "x.json", "subsets": ["a"]}])


def test_the_conflict_plot_of_176_sources_stays_a_readable_size_clustered_within_groups(tmp_path):
    n = 176
    g = torch.Generator().manual_seed(0)
    axes = torch.randn(n, 4, generator=g)
    conflicts = torch.nn.functional.cosine_similarity(axes[:, None], axes[None], dim=-1)
    sources = [f"mix/subset_{i:03d}" for i in range(n)]
    plan = plan_split(sources, dict.fromkeys(sources, 100), 4, "pca", conflicts)
    path = plot_conflicts(conflicts, sources, plan, tmp_path / "conflicts.png")
    with PILImage.open(path) as png:
        assert max(png.size) <= (22 + 1.5) * 120  # capped: labels shrink instead
    for group in plan.groups:
        members = [sources.index(s) for s in group]
        order = clustered(members, conflicts)
        assert sorted(order) == sorted(members)
        # the leaf order puts agreeing sources side by side: neighbours agree more than the group on average
        inside = conflicts[members][:, members]
        neighbours = torch.stack([conflicts[a, b] for a, b in itertools.pairwise(order)]).mean()
        assert neighbours > inside[~torch.eye(len(members), dtype=torch.bool)].mean()
