"""The demo's flows at the smallest settings that run every stage, on every family beside Qwen2.5-VL
(whose flows are tests/test_flow.py's): MERIT on a tiny Qwen3.5-MoE (linear attention, experts fused
in memory and stored one by one, a shared expert: calibration over the experts and routers, K = 2
branches, merges, lmms-eval through this project's ``merit_qwen3_vl``), DiLoCo on a tiny Qwen3-VL-MoE
stored as the hub's (fused experts, each expert (in, out) on disk, merged expert by expert), MERIT on
a tiny InternVL3.5 (image tiles, no 3-D rope, lmms-eval through ``merit_internvl``), and MERIT then
DiLoCo in one run directory on each dense Qwen3 family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hub_layout, small_config
from transformers import AutoModelForImageTextToText

from flows.diloco import diloco
from flows.merit import merit
from pipeline.merge import CheckpointReader, MergeSpec
from pipeline.models import init_model

ROOT = Path(__file__).parent.parent
DEMO = str(ROOT / "configs/demo.yaml")
TASKS = "[colour_name, colour_complement, count_digits, count_words]"
SMALL = [
    f"data.sources=[{{name: builtin, format: builtin, tasks: {TASKS}}}]",
    "data.builtin.examples_per_source=8",
    "warmup.steps=0",
    "train.micro_batch=4",
    "train.max_tokens=256",  # about 4 of the built-in examples a packed micro batch
    f"train.deepspeed={ROOT}/configs/deepspeed/zero2.json",
    "flow.joint_baseline=false",
    "flow.retry_delay_s=0",
    "eval.max_examples_per_source=2",
    "eval.benchmarks=[toy_perception]",
    "eval.benchmark_limit=2",
]


def completes(flow, run_dir: Path, settings: list[str]) -> None:
    """Run a flow on the demo config with ``settings``; it must complete."""
    state = flow(config=DEMO, overrides=settings, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message


def same_tensors(folder: Path, theta0: CheckpointReader) -> None:
    out = CheckpointReader(folder)
    assert {n: i.shape for n, i in out.info.items()} == {n: i.shape for n, i in theta0.info.items()}


def test_merit_on_a_tiny_qwen3_5_moe_runs_every_stage(prefect_api, tmp_path):
    run_dir = tmp_path / "run"
    settings = [
        *SMALL,
        "model.name_or_path=tiny:qwen3_5_moe",
        "calibration.n_per_source=4",
        "calibration.batch_size=4",
        "train.steps=4",
        "train.checkpoint_every=4",
        "merge.methods=[{name: token_average, method: weighted_average}, {name: iso_c, method: iso_c}]",
    ]
    completes(merit, run_dir, settings)
    theta0 = CheckpointReader(run_dir / "init")
    sketched = json.loads((run_dir / "calibration" / "gradients.json").read_text())["parameters"]
    blocks = {n: i for n, i in theta0.info.items() if n.startswith("model.language_model.layers.")}
    matrices = [i.shape for n, i in blocks.items() if len(i.shape) == 2]  # experts stored one by one
    assert sketched == sum(torch.Size(s).numel() for s in matrices)  # the experts and routers included
    branches = [CheckpointReader(run_dir / "branches" / str(k) / "final") for k in range(2)]
    for name in ("token_average", "iso_c"):
        same_tensors(run_dir / "merged" / name, theta0)
        model = AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / name)
        assert model.config.model_type == "qwen3_5_moe"
    spec = json.loads((run_dir / "merged" / "token_average" / "manifest.json").read_text())["spec"]
    w = MergeSpec.model_validate(spec).normalized_weights()  # n_k / Σ n_j, the groups' tokens
    expert = "model.language_model.layers.0.mlp.experts.1.down_proj.weight"
    expected = w[0] * branches[0].get(expert) + w[1] * branches[1].get(expert)
    assert torch.allclose(CheckpointReader(run_dir / "merged" / "token_average").get(expert), expected, atol=1e-6)
    job = run_dir / "eval" / "benchmarks" / "merged-token_average" / "toy_perception"
    score = json.loads((job / "score.json").read_text())
    assert score["identity"]["model"] == "merit_qwen3_vl" and score["score"] is not None, score


def test_diloco_from_a_hub_shaped_qwen3_vl_moe_keeps_every_tensor(prefect_api, tmp_path):
    """θ0 a folder with its experts stored (in, out), as the hub's Qwen3-VL-MoE: the workers' Δ and
    the aggregation read it in transformers' (out, in), which the globals are written in."""
    built = init_model(small_config("model.name_or_path=tiny:qwen3_vl_moe"), tmp_path / "built")["path"]
    hub = hub_layout(built, tmp_path / "hub")
    run_dir = tmp_path / "run"
    settings = [
        *SMALL,
        f"model.name_or_path={hub}",
        "diloco.inner_steps=2",
        "diloco.rounds=2",
        "diloco.eval_every=0",
        "diloco.methods=[{name: iso, method: iso_c, outer_lr: 1.0, outer_momentum: 0.0}]",
    ]
    completes(diloco, run_dir, settings)
    theta0 = CheckpointReader(built)  # transformers' layout, which the globals are written in
    final = run_dir / "diloco" / "iso-iid" / "global" / "2"  # variant: the method and the shards
    same_tensors(final, theta0)
    fused = "model.language_model.layers.0.mlp.experts.down_proj"
    assert 0 < (CheckpointReader(final).get(fused) - theta0.get(fused)).abs().max() < 0.1  # θ0 read right
    assert json.loads((final / "round.json").read_text())["tensors"] == len(theta0.info)
    assert AutoModelForImageTextToText.from_pretrained(final).config.model_type == "qwen3_vl_moe"


def test_merit_on_a_tiny_internvl_runs_every_stage_and_lmms_eval_scores_it(prefect_api, tmp_path):
    run_dir = tmp_path / "run"
    settings = [*SMALL, "model.name_or_path=tiny:internvl", "calibration.n_per_source=4", "train.steps=2"]
    completes(merit, run_dir, settings)
    theta0 = CheckpointReader(run_dir / "init")
    assert any(n.startswith("vision_tower.") for n in theta0.info)  # the hub's layout, as transformers saves it
    for folder in (run_dir / "merged").iterdir():
        same_tensors(folder, theta0)
        assert AutoModelForImageTextToText.from_pretrained(folder).config.model_type == "internvl"
    trained = CheckpointReader(run_dir / "branches" / "0" / "final")
    projector = "multi_modal_projector.linear_1.weight"  # the image tiles reached the projector
    assert not torch.equal(trained.get(projector), theta0.get(projector))
    job = run_dir / "eval" / "benchmarks" / "merged-token_average" / "toy_perception"
    score = json.loads((job / "score.json").read_text())
    assert score["identity"]["model"] == "merit_internvl" and score["score"] is not None, score


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_merit_then_diloco_on_a_dense_qwen3_family_runs_every_stage(prefect_api, tmp_path, family):
    """The dense Qwen3 families through both flows in one run directory (DiLoCo reuses θ0 and the
    prepared data): calibration, K = 2 branches, merges, lmms-eval through ``merit_qwen3_vl``, then
    2 DiLoCo workers for 2 rounds aggregated by Iso-C."""
    run_dir = tmp_path / "run"
    settings = [
        *SMALL,
        f"model.name_or_path=tiny:{family}",
        "calibration.n_per_source=4",
        "train.steps=2",
        "merge.methods=[{name: token_average, method: weighted_average}]",
        "diloco.inner_steps=2",
        "diloco.rounds=2",
        "diloco.eval_every=0",
        "diloco.methods=[{name: iso, method: iso_c, outer_lr: 1.0, outer_momentum: 0.0}]",
    ]
    completes(merit, run_dir, settings)
    theta0 = CheckpointReader(run_dir / "init")
    merged = run_dir / "merged" / "token_average"
    same_tensors(merged, theta0)
    assert AutoModelForImageTextToText.from_pretrained(merged).config.model_type == family
    score = json.loads((run_dir / "eval/benchmarks/merged-token_average/toy_perception/score.json").read_text())
    assert score["identity"]["model"] == "merit_qwen3_vl" and score["score"] is not None, score

    completes(diloco, run_dir, settings)
    final = run_dir / "diloco" / "iso-iid" / "global" / "2"
    same_tensors(final, theta0)
    assert json.loads((final / "round.json").read_text())["tensors"] == len(theta0.info)
    assert AutoModelForImageTextToText.from_pretrained(final).config.model_type == family
