import json
import shutil

import pytest
import torch
from conftest import small_config

import pipeline.data.prepare as prepare_module
from calibration.stage import calibrate
from pipeline.data import DataError, Encoder, active_sources, load_split, prepare_data, read_manifest
from pipeline.data.builtin import UNSEEN
from pipeline.data.prepare import data_digest, heldout_indices
from pipeline.diloco.plan import shards
from pipeline.models import processor_for
from pipeline.train.plan import group_specs, joint_spec, warmup_spec
from pipeline.train.sampling import BranchData


def test_prepare_manifest_tokens_and_splits(tmp_path, processor):
    cfg = small_config("data.heldout_fraction=0.25")
    manifest = prepare_data(cfg, tmp_path, processor)
    sources = manifest["sources"]
    assert len(sources) == 18
    train, heldout = load_split(cfg, tmp_path, "train"), load_split(cfg, tmp_path, "heldout")
    encoder = Encoder(processor, cfg.data.max_length)
    for name, info in sources.items():
        assert info["examples"] == 12 and len(info["heldout_indices"]) == 3 and info["train_examples"] == 9
        assert info["role"] == "finetune"
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


THREE_ENTRIES = (
    "data.sources=[{name: a, format: builtin, tasks: [add_digits]}, {name: b, format: builtin, tasks: [caption]}, "
    "{name: c, format: builtin, tasks: [add_words, reverse_word]}]"
)


def test_a_prepare_stopped_halfway_prepares_only_the_tasks_it_had_not_finished(tmp_path, processor, monkeypatch):
    cfg = small_config(THREE_ENTRIES)
    whole = prepare_data(cfg, tmp_path / "whole", processor)
    prepare, prepared = prepare_module.prepare_task, []

    def stopping(task, *args):
        if len(prepared) == 2:
            raise KeyboardInterrupt  # stopped while the third entry is read
        prepared.append(task.label)
        return prepare(task, *args)

    monkeypatch.setattr(prepare_module, "prepare_task", stopping)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, tmp_path / "run", processor)
    store = tmp_path / "run" / "data" / "store"
    assert sorted(p.name for p in store.glob("*") if p.name != "tasks") == ["add_digits", "caption"]
    assert not (tmp_path / "run" / "data" / "manifest.json").exists()
    stamps = {p: p.stat().st_mtime_ns for p in store.rglob("*.arrow")}
    prepared.clear()
    monkeypatch.setattr(
        prepare_module, "prepare_task", lambda task, *args: prepared.append(task.label) or prepare(task, *args)
    )
    assert prepare_data(cfg, tmp_path / "run", processor) == whole  # the same manifest as one whole prepare
    assert prepared == ["c"] and {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_prepare_in_processes_writes_what_one_process_writes(tmp_path, processor):
    """Tasks prepared side by side in spawned processes: the same manifest and the same rows."""
    from conftest import llava_record, write_json

    records = [llava_record(None, str(i)) for i in range(5)]
    entries = [f"{{name: f{k}, format: llava, path: {write_json(tmp_path / f'f{k}.json', records)}}}" for k in range(3)]
    both = f"data.sources=[{', '.join(entries)}, {{name: b, format: builtin, tasks: [caption]}}]"
    serial = prepare_data(small_config(both), tmp_path / "one", processor)
    parallel = prepare_data(small_config(both, "data.prepare_processes=2"), tmp_path / "two", processor)
    assert parallel == serial
    for name in serial["sources"]:
        one, two = (load_split(small_config(both), tmp_path / run, "train", [name])[name] for run in ("one", "two"))
        assert [ex.messages for ex in one] == [ex.messages for ex in two]
        assert all(torch.equal(a.token_ids, b.token_ids) for a, b in zip(one, two, strict=True))


def test_a_bad_record_met_in_a_worker_stops_prepare_named_as_in_one_process(tmp_path, processor):
    from conftest import llava_record, write_json

    path = write_json(tmp_path / "bad.json", [llava_record(None, "1"), {"conversations": "nope"}])
    bad = f"{{name: bad, format: llava, path: {path}}}"  # the first task: the worker's (this process takes the next)
    cfg = small_config(THREE_ENTRIES.replace("data.sources=[", f"data.sources=[{bad}, "), "data.prepare_processes=2")
    with pytest.raises(DataError, match=r"bad\.json record 1: conversation must be a list of turns"):
        prepare_data(cfg, tmp_path / "run", processor)


def test_heldout_indices_are_seeded_and_bounded():
    assert heldout_indices(100, 0.1, 0, "a") == heldout_indices(100, 0.1, 0, "a")
    assert heldout_indices(100, 0.1, 0, "a") != heldout_indices(100, 0.1, 0, "b")
    assert len(heldout_indices(5, 0.01, 0, "a")) == 1
    assert len(heldout_indices(2, 0.9, 0, "a")) == 1
    assert heldout_indices(100, 0.0, 0, "a") == [] and heldout_indices(1, 0.5, 0, "a") == []


def test_rows_of_a_file_changed_since_prepare_are_refused(tmp_path, processor):
    import json

    from conftest import llava_record, write_json

    from pipeline.data import DataError

    path = write_json(tmp_path / "d.json", [llava_record(None, str(i)) for i in range(4)])
    cfg = small_config(f"data.sources={json.dumps([{'name': 'd', 'format': 'llava', 'path': str(path)}])}")
    prepare_data(cfg, tmp_path / "run", processor)
    write_json(path, [llava_record(None, str(i)) for i in (0, 1, 9, 3)])  # record 2 edited in place
    with pytest.raises(DataError, match=r"d\.json: changed since `merit prepare` \(source 'd'\)"):
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


FINETUNE = ["colour_name", "colour_complement", "add_digits", "add_words"]
WARMUP = ["skill_colour", "skill_add"]
ROLES = (
    f"data.sources=[{{name: ft, format: builtin, tasks: [{', '.join(FINETUNE)}]}}]",
    f"warmup.sources=[{{name: w, format: builtin, suite: warmup, tasks: [{', '.join(WARMUP)}]}}]",
    "eval.sources=[{name: u, format: builtin, suite: unseen}, {name: r, format: builtin, tasks: [skill_count], "
    "role: retention}]",
)


@pytest.fixture(scope="module")
def roles_run(tiny_run, tmp_path_factory):
    """A run with fine-tuning, warm-up and eval sources, prepared and calibrated at θ0."""
    cfg = small_config(*ROLES, "calibration.n_per_source=4", "calibration.dim=64")
    run_dir = tmp_path_factory.mktemp("roles")
    shutil.copytree(tiny_run[1] / "init", run_dir / "init")  # θ0 of the same model and run sections
    prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    calibrate(cfg, run_dir)
    return cfg, run_dir


def test_manifest_roles_and_eval_sources_held_out_whole(roles_run):
    cfg, run_dir = roles_run
    sources = read_manifest(run_dir)["sources"]
    roles = {name: info["role"] for name, info in sources.items()}
    expected = dict.fromkeys(FINETUNE, "finetune") | dict.fromkeys(WARMUP, "warmup")
    assert roles == expected | dict.fromkeys(UNSEEN, "unseen") | {"skill_count": "retention"}
    for name, info in sources.items():
        evaluated = roles[name] in ("unseen", "retention")
        assert info["heldout_indices"] == (list(range(12)) if evaluated else heldout_indices(12, 0.1, 0, name))
        assert (info["train_examples"], info["train_tokens"] == 0) == ((0, True) if evaluated else (11, False))
    assert list(active_sources(read_manifest(run_dir))) == FINETUNE
    assert list(active_sources(read_manifest(run_dir), "warmup")) == WARMUP
    assert len(active_sources(read_manifest(run_dir), None)) == len(sources)
    assert list(load_split(cfg, run_dir, "train")) == FINETUNE  # by default, the fine-tuning sources
    named = ["unseen_read_sentence", "skill_add"]
    assert [len(v) for v in load_split(cfg, run_dir, "heldout", named).values()] == [12, 1]
    assert [len(v) for v in load_split(cfg, run_dir, "train", ["unseen_read_sentence"]).values()] == [0]


def test_only_the_fine_tuning_sources_reach_calibration_branches_and_shards(roles_run, processor):
    """Eval sources never train and warm-up sources only make θ0: neither is in calibration's
    sample, the split, any branch's or the joint baseline's data order, or a DiLoCo shard."""
    cfg, run_dir = roles_run
    gradients = json.loads((run_dir / "calibration" / "gradients.json").read_text())
    assert list(gradients["examples"]) == FINETUNE and gradients["examples"] == dict.fromkeys(FINETUNE, 4)
    specs = [*group_specs(cfg, run_dir), joint_spec(cfg, run_dir)]
    assert sorted(s for spec in specs[:-1] for s in spec.sources) == sorted(FINETUNE) == sorted(specs[-1].sources)
    for spec in specs:
        data = BranchData.for_branch(spec, processor)
        t = spec.train
        drawn = {(ex.source, ex.index) for step in range(t.steps) for batch in data.micro_batches(step) for ex in batch}
        assert {source for source, _ in drawn} == set(spec.sources), spec.name
        assert drawn == {(ex.source, ex.index) for ex in data.examples}  # an epoch: every training example
        assert [store.source for store in data.examples.stores] == spec.sources  # no other group's rows opened
    assert all(sorted(sources) == sorted(FINETUNE) for sources, _ in shards(cfg, run_dir))


def test_warmup_trains_on_warmup_sources_when_given(roles_run, processor, tmp_path):
    cfg, run_dir = roles_run
    spec = warmup_spec(cfg, run_dir)
    assert spec.sources == WARMUP
    assert {ex.source for ex in BranchData.for_branch(spec, processor).examples} == set(WARMUP)
    plain = small_config(ROLES[0])  # no warmup.sources: the warm-up trains on the fine-tuning data
    prepare_data(plain, tmp_path, processor)
    assert warmup_spec(plain, tmp_path).sources == FINETUNE


def test_warmup_and_eval_sources_are_in_the_prepare_digest():
    base = small_config(*ROLES)
    assert data_digest(base) == data_digest(small_config(*ROLES, "warmup.steps=5", "eval.batch_size=2"))
    assert data_digest(base) != data_digest(small_config(*ROLES, "warmup.sources.0.max_examples=5"))
    assert data_digest(base) != data_digest(small_config(*ROLES, "eval.sources.1.role=unseen"))
    assert data_digest(base) != data_digest(small_config(ROLES[0]))
