import pytest
import torch
from conftest import small_config

from pipeline.data import Encoder, load_split, prepare_data, read_manifest
from pipeline.data.prepare import heldout_indices
from pipeline.models import processor_for


def test_prepare_manifest_tokens_and_splits(tmp_path, processor):
    cfg = small_config("data.heldout_fraction=0.25")
    manifest = prepare_data(cfg, tmp_path, processor)
    sources = manifest["sources"]
    assert len(sources) == 18
    train, heldout = load_split(cfg, tmp_path, "train"), load_split(cfg, tmp_path, "heldout")
    encoder = Encoder(processor, cfg.data.max_length)
    for name, info in sources.items():
        assert info["examples"] == 12 and len(info["heldout_indices"]) == 3 and info["train_examples"] == 9
        assert len(train[name]) == 9 and len(heldout[name]) == 3
        assert {ex.index for ex in heldout[name]} == set(info["heldout_indices"])
        encoded = [encoder(ex) for ex in train[name]]
        assert info["train_tokens"] == sum(e.num_tokens for e in encoded)
        assert info["supervised_tokens"] == sum(e.num_supervised for e in encoded)
    assert read_manifest(tmp_path) == manifest


def test_cached_token_ids_match_a_fresh_encoding(tmp_path, processor):
    cfg = small_config()
    prepare_data(cfg, tmp_path, processor)
    encoder = Encoder(processor, cfg.data.max_length)
    for examples in load_split(cfg, tmp_path, "train", ["colour_name", "add_words"]).values():
        cached = encoder.encode_batch(examples)
        for ex in examples:
            ex.token_ids = None
        fresh = encoder.encode_batch(examples)
        for a, b in zip(cached, fresh):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
            assert torch.equal(a.mm_token_type_ids, b.mm_token_type_ids)
            assert (a.pixel_values is None and b.pixel_values is None) or torch.equal(a.pixel_values, b.pixel_values)


def test_prepare_is_idempotent_and_redone_when_the_config_changes(tmp_path, processor):
    cfg = small_config()
    prepare_data(cfg, tmp_path, processor)
    path = tmp_path / "data" / "manifest.json"
    stamp = path.stat().st_mtime_ns
    prepare_data(cfg, tmp_path, processor)
    assert path.stat().st_mtime_ns == stamp
    changed = small_config("data.max_length=40")
    manifest = prepare_data(changed, tmp_path, processor_for(changed))
    assert path.stat().st_mtime_ns != stamp
    assert manifest["sources"]["caption"]["truncated"] > 0


def test_heldout_indices_are_seeded_and_bounded():
    assert heldout_indices(100, 0.1, 0, "a") == heldout_indices(100, 0.1, 0, "a")
    assert heldout_indices(100, 0.1, 0, "a") != heldout_indices(100, 0.1, 0, "b")
    assert len(heldout_indices(5, 0.01, 0, "a")) == 1
    assert len(heldout_indices(2, 0.9, 0, "a")) == 1
    assert heldout_indices(100, 0.0, 0, "a") == [] and heldout_indices(1, 0.5, 0, "a") == []


def test_stale_token_cache_is_refused(tmp_path, processor):
    import json

    from conftest import llava_record, write_json

    from pipeline.data import DataError

    path = write_json(tmp_path / "d.json", [llava_record(None, str(i)) for i in range(4)])
    cfg = small_config(f"data.sources={json.dumps([{'name': 'd', 'format': 'llava', 'path': str(path)}])}")
    prepare_data(cfg, tmp_path / "run", processor)
    write_json(path, [llava_record(None, str(i)) for i in (0, 1, 9, 3)])  # record 2 edited in place
    with pytest.raises(DataError, match=r"d\.json record 2: changed since `merit prepare`"):
        load_split(cfg, tmp_path / "run", "train")


def test_seed_change_redoes_prepare_and_entry_heldout_fraction_applies(tmp_path, processor):
    cfg = small_config("data.sources=[{name: b, format: builtin, tasks: [add_digits, caption], heldout_fraction: 0.5}]")
    first = prepare_data(cfg, tmp_path, processor)
    assert [len(v["heldout_indices"]) for v in first["sources"].values()] == [6, 6]
    reseeded = small_config(
        "run.seed=1", "data.sources=[{name: b, format: builtin, tasks: [add_digits, caption], heldout_fraction: 0.5}]"
    )
    second = prepare_data(reseeded, tmp_path, processor_for(reseeded))
    assert second["config_digest"] != first["config_digest"]
    assert load_split(reseeded, tmp_path, "train")["add_digits"]  # the cache matches the new corpus
