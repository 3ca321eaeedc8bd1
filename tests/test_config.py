from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config, save_config

DEMO = Path(__file__).parent.parent / "configs" / "demo.yaml"


def test_demo_config_loads_and_overrides_apply():
    cfg = load_config(
        DEMO, ["data.max_length=256", "model.freeze.freeze_vision_tower=true", "data.sources.0.max_examples=5"]
    )
    assert cfg.data.max_length == 256
    assert cfg.model.freeze.freeze_vision_tower is True
    assert cfg.data.sources[0].max_examples == 5
    assert cfg.model.name_or_path == "tiny"


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"data\.max_lenght"):
        load_config(DEMO, ["data.max_lenght=5"])


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=r"data\.heldout_fraction.*1\.5"):
        load_config(DEMO, ["data.heldout_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"model\.dtype"):
        load_config(DEMO, ["model.dtype=float8"])


def test_bad_list_index_is_named():
    with pytest.raises(ConfigError, match=r"data\.sources.*'3' is not an index"):
        load_config(DEMO, ["data.sources.3.max_examples=5"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(DEMO, ["data.max_length"])


def test_source_without_path_is_an_error():
    with pytest.raises(ConfigError, match="needs a path"):
        load_config(None, ["data.sources=[{name: x, format: llava}]"])


def test_yaml_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(DEMO, ["run.seed=7"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    assert cfg.digest("data") == load_config(tmp_path / "config.yaml").digest("data")
    assert cfg.digest("run") != load_config(DEMO).digest("run")


def test_paths_in_a_config_file_are_its_folders_and_an_overrides_the_current_ones(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    (folder / "data" / "images").mkdir(parents=True)
    (folder / "model").mkdir()
    (folder / "config.yaml").write_text(
        "model: {name_or_path: model}\n"
        "train: {deepspeed: ds/mine.json}\n"
        "eval: {include_path: [tasks]}\n"
        "data:\n  sources:\n"
        "    - {name: a, format: llava, path: data/a.json, images_dir: data/images}\n"
        "    - {name: b, format: hub, path: ORG/NAME}\n"
        "    - {name: c, format: jsonl, path: /abs/c.jsonl}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(folder / "config.yaml", ["data.sources.2.path=c.jsonl"])
    a, b, c = cfg.data.sources
    assert (a.path, a.images_dir) == (str(folder / "data/a.json"), str(folder / "data/images"))
    assert b.path == "ORG/NAME"  # a hub id: no such folder beside the config
    assert c.path == str(elsewhere / "c.jsonl")  # an override: the current folder's
    assert cfg.model.name_or_path == str(folder / "model")  # a folder beside the config, not a hub id
    assert cfg.train.deepspeed_file == folder / "ds/mine.json"
    assert cfg.eval.include_path == [str(folder / "tasks")]
    shipped = load_config(None, ["train.deepspeed=zero3"]).train.deepspeed_file
    assert shipped.is_file() and shipped.parent == Path(__file__).parent.parent / "pipeline/train/deepspeed"
    saved = tmp_path / "saved.yaml"
    save_config(cfg, saved)
    assert load_config(saved) == cfg  # whole paths: read back from anywhere, the same config
