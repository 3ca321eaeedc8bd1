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
