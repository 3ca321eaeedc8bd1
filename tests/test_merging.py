"""The run's merge stage and GPU slots: merges follow their inputs, branches get disjoint GPUs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import small_config
from safetensors.torch import load_file

from flows.merit import branch_slots
from pipeline.checkpoint import is_complete, read_manifest, save_pretrained_checkpoint
from pipeline.layout import branch_dir, merged_dir
from pipeline.merging import merge_run
from pipeline.models import load_model, load_processor

MERGES = "merge.methods=[{name: avg, method: weighted_average}, {name: iso, method: iso_c}]"


def save_branch(cfg, run_dir, k: int, shift: float, tokens_seen: int) -> None:
    model = load_model(run_dir / "init", cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
    save_pretrained_checkpoint(
        branch_dir(run_dir, k) / "final",
        model,
        load_processor(run_dir / "init", cfg.model),
        step=1,
        tokens_seen=tokens_seen,
        parent=str(run_dir / "init"),
        sources=[["a"], ["b"]][k],
    )


@pytest.fixture
def run(tiny_run, tmp_path):
    cfg, built = tiny_run
    run_dir = tmp_path / "run"
    shutil.copytree(built / "init", run_dir / "init")
    (run_dir / "calibration").mkdir()
    (run_dir / "calibration" / "split.json").write_text(json.dumps({"groups": [["a"], ["b"]]}))
    sources = {"a": {"train_tokens": 300}, "b": {"train_tokens": 100}}  # the groups' data: n_k
    (run_dir / "data").mkdir()
    (run_dir / "data" / "manifest.json").write_text(json.dumps({"sources": sources}))
    cfg = small_config(MERGES, "warmup.steps=0")
    save_branch(cfg, run_dir, 0, 0.1, tokens_seen=100)  # what the branches saw does not weight them
    save_branch(cfg, run_dir, 1, -0.2, tokens_seen=300)
    return cfg, run_dir


def test_a_merge_is_token_weighted_and_redone_only_when_its_inputs_change(run):
    cfg, run_dir = run
    merge_run(cfg, run_dir, "avg")
    out = merged_dir(run_dir, "avg")
    base = load_file(run_dir / "init" / "model.safetensors")
    merged = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.allclose(merged[name], base[name] + 0.75 * 0.1 + 0.25 * -0.2, atol=1e-6)  # n_k = 300 and 100 tokens
    stamp, inputs = (out / "manifest.json").stat().st_mtime_ns, read_manifest(out)["inputs"]
    merge_run(cfg, run_dir, "avg")
    assert (out / "manifest.json").stat().st_mtime_ns == stamp  # same spec, same weights: kept
    save_branch(cfg, run_dir, 1, -0.2 + 1e-3, tokens_seen=300)  # retrained: same data, other weights
    merge_run(cfg, run_dir, "avg")
    branch_1 = str(branch_dir(run_dir, 1) / "final")
    assert read_manifest(out)["inputs"][branch_1] != inputs[branch_1]
    assert not torch.equal(load_file(out / "model.safetensors")[name], merged[name])
    with pytest.raises(ValueError, match="no merge named 'ties'"):
        merge_run(cfg, run_dir, "ties")
    weights = branch_dir(run_dir, 0) / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # corrupt: named as such
    shutil.rmtree(branch_dir(run_dir, 1) / "final")  # missing
    with pytest.raises(FileNotFoundError, match=r"branch 0: .*model.safetensors: sha256 does not match.*; branch 1: "):
        merge_run(cfg, run_dir, "iso")
    assert not is_complete(merged_dir(run_dir, "iso"))


def test_branches_get_disjoint_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert branch_slots(small_config("train.processes=2"), 3) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert branch_slots(small_config("train.processes=3", "flow.parallel_branches=5"), 3) == [[0, 1, 2], [3, 4, 5]]
    assert branch_slots(small_config("train.processes=16"), 3) == [None]  # the launcher reports the shortage
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert branch_slots(small_config(), 3) == [None]
    assert branch_slots(small_config("flow.branch_deployment=merit-branch/gpu"), 3) == [None] * 3  # a machine each


def test_a_mergekit_entry_merges_the_branches_with_mergekits_meanings(run):
    """mergekit's task arithmetic over the branches: each weighted by its token share unless the
    parameters give a weight; normalize: false sums the raw weights (here 1 each: τ_1 + τ_2)."""
    cfg, run_dir = run
    entries = (
        "merge.methods=[{name: shares, merge_method: task_arithmetic},"
        " {name: sums, merge_method: task_arithmetic, parameters: {weight: 1.0, normalize: false}}]"
    )
    cfg = small_config(entries, "warmup.steps=0")
    base = load_file(run_dir / "init" / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    for entry, shift in (("shares", 0.75 * 0.1 + 0.25 * -0.2), ("sums", 0.1 - 0.2)):
        merge_run(cfg, run_dir, entry)
        merged = load_file(merged_dir(run_dir, entry) / "model.safetensors")
        assert torch.allclose(merged[name], base[name] + shift, atol=1e-6)
        assert read_manifest(merged_dir(run_dir, entry))["mergekit"]["merge_method"] == "task_arithmetic"
    stamp = (merged_dir(run_dir, "sums") / "manifest.json").stat().st_mtime_ns
    merge_run(cfg, run_dir, "sums")
    assert (merged_dir(run_dir, "sums") / "manifest.json").stat().st_mtime_ns == stamp  # unchanged: kept
    with pytest.raises(ValueError, match=r"task_arithmetic takes no parameter \['t'\]"):
        small_config("merge.methods=[{name: bad, merge_method: task_arithmetic, parameters: {t: 0.5}}]")
    with pytest.raises(ValueError, match="give one of 'method'"):
        small_config("merge.methods=[{name: both, method: ties, merge_method: ties}]")
