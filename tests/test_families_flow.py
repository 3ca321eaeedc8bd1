"""The demo's flows at the smallest settings that run every stage, on every family beside Qwen2.5-VL
(whose flows are tests/test_flow.py's): MERIT on a tiny Qwen3.5-MoE stored as the hub stores it (experts
fused, untied head, the mtp head, two shards) and on the same weights stored with the experts one by one
(linear attention, a shared expert: warm-up, calibration over the experts and routers, K = 2 branches,
merges, lmms-eval through this project's ``merit_qwen3_vl``), then full-weight DiLoCo on it; DiLoCo on a
tiny Qwen3-VL-MoE stored as the hub's (each expert (in, out) on disk), MERIT on a tiny InternVL3.5 (image
tiles, no 3-D rope, lmms-eval through ``merit_internvl``), and MERIT then DiLoCo in one run directory on
each dense Qwen3 family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import restyled_copy, small_config
from transformers import AutoModelForImageTextToText

from flows.diloco import diloco
from flows.merit import merit
from pipeline.checkpoint import read_manifest
from pipeline.merge import CheckpointReader, MergeSpec, ModelView
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
    "train.deepspeed=zero2",
    "flow.joint_baseline=false",
    "flow.controls=[]",  # the Random-K control's flow: tests/test_flow.py's
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


MOE_MERGES = "merge.methods=[{name: token_average, method: weighted_average}, {name: iso_c, method: iso_c}, "
MOE_MERGES += "{name: ties, method: ties, params: {density: 0.2}}]"


@pytest.fixture(scope="module")
def qwen3_5_moe(prefect_api, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """The demo's MERIT flow (a warm-up, K = 2 full fine-tuning branches, token average, Iso-C, TIES) on a tiny
    Qwen3.5-MoE θ0 as the hub stores it (experts fused, untied head, mtp head, two shards and an index) and on
    the same weights stored with the experts one matrix each: layout -> (source, run directory)."""
    root = tmp_path_factory.mktemp("qwen3_5_moe")
    built = init_model(small_config("model.name_or_path=tiny:qwen3_5_moe"), root / "built")["path"]
    sources = {"hub": restyled_copy(built, root / "hub", shards=2)}
    sources["per_expert"] = restyled_copy(built, root / "per_expert", "per_expert", shards=2)
    runs = {}
    for layout, source in sources.items():
        settings = [
            *SMALL,
            f"model.name_or_path={source}",
            "warmup.steps=2",
            "calibration.n_per_source=4",
            "calibration.batch_size=4",
            "train.steps=4",
            "train.checkpoint_every=4",
            MOE_MERGES,
            *(["eval.benchmarks=[]"] if layout == "per_expert" else []),  # lmms-eval: the hub layout's run
        ]
        completes(merit, root / f"run-{layout}", settings)
        runs[layout] = (source, root / f"run-{layout}")
    return runs


def same_as_source(folder: Path, source: Path) -> None:
    """``folder`` holds exactly ``source``'s stored tensors, the ones transformers does not load bit for bit."""
    out, files = CheckpointReader(folder), CheckpointReader(source)
    assert {n: i.shape for n, i in out.info.items()} == {n: i.shape for n, i in files.info.items()}, folder
    carried = ModelView.open(source).layout.carried
    assert carried and all(torch.equal(out.get(n), files.get(n)) for n in carried), folder
    assert read_manifest(folder)["carried"] == carried


@pytest.mark.parametrize("layout", ["hub", "per_expert"])
def test_merit_on_a_tiny_qwen3_5_moe_keeps_the_sources_tensors_in_every_checkpoint(qwen3_5_moe, layout):
    source, run_dir = qwen3_5_moe[layout]
    sketched = json.loads((run_dir / "calibration" / "gradients.json").read_text())["parameters"]
    theta0 = ModelView.open(run_dir / "warmup" / "final")  # the experts' matrices and the routers included:
    matrices = [
        i.shape for k, i in theta0.info.items() if k.startswith("model.language_model.layers.") and len(i.shape) == 2
    ]
    assert sketched == sum(torch.Size(s).numel() for s in matrices)
    finals = [run_dir / "warmup" / "final", *(run_dir / "branches" / str(k) / "final" for k in range(2))]
    for folder in [*finals, *(run_dir / "merged" / m for m in ("token_average", "iso_c", "ties"))]:
        same_as_source(folder, source)
        assert AutoModelForImageTextToText.from_pretrained(folder).config.model_type == "qwen3_5_moe"
    spec = read_manifest(run_dir / "merged" / "token_average")["spec"]
    w = MergeSpec.model_validate(spec).normalized_weights()  # n_k / Σ n_j, the groups' tokens
    branches = [ModelView.open(f) for f in finals[1:]]
    average = ModelView.open(run_dir / "merged" / "token_average")
    for name in average.loaded():
        expected = w[0] * branches[0].get_loaded(name) + w[1] * branches[1].get_loaded(name)
        torch.testing.assert_close(average.get_loaded(name), expected, rtol=0, atol=1e-6, msg=name)
    if layout == "hub":
        job = run_dir / "eval" / "benchmarks" / "merged-token_average" / "toy_perception"
        score = json.loads((job / "score.json").read_text())
        assert score["identity"]["model"] == "merit_qwen3_vl" and score["score"] is not None, score
    report = (run_dir / "report" / "report.md").read_text()
    assert "19 tensors transformers does not load (mtp.*)" in report


def test_iso_c_and_ties_merge_the_same_model_from_either_layout(qwen3_5_moe):
    """The two runs train the same weights (the layouts are read as the same model): their merges, written
    in each source's layout, are the same model as transformers loads it."""
    (_, hub), (_, per_expert) = qwen3_5_moe["hub"], qwen3_5_moe["per_expert"]
    for merge in ("iso_c", "ties"):
        a, b = ModelView.open(hub / "merged" / merge), ModelView.open(per_expert / "merged" / merge)
        assert a.layout.experts == "fused" and b.layout.experts == "per_expert"
        for name in a.loaded():
            torch.testing.assert_close(a.get_loaded(name), b.get_loaded(name), rtol=0, atol=1e-5, msg=name)


@pytest.mark.release  # the DiLoCo flow again, on a family whose MERIT flow runs here
def test_full_weight_diloco_on_a_tiny_qwen3_5_moe_keeps_the_sources_layout(qwen3_5_moe):
    """Full-weight workers send Δ of the experts as they hold them (fused); the globals are written with the
    experts one by one, as the run's source stores them, the mtp head carried."""
    source, run_dir = qwen3_5_moe["per_expert"]
    settings = [
        *SMALL,
        f"model.name_or_path={source}",
        "diloco.inner_steps=2",
        "diloco.rounds=2",
        "diloco.eval_every=0",
        "diloco.methods=[{name: iso, method: iso_c, outer_lr: 1.0, outer_momentum: 0.0}]",
    ]
    completes(diloco, run_dir.with_name("diloco-per_expert"), settings)
    final = run_dir.with_name("diloco-per_expert") / "diloco" / "iso-iid" / "global" / "2"
    same_as_source(final, source)
    expert = "model.language_model.layers.0.mlp.experts.1.down_proj.weight"
    assert 0 < (ModelView.open(final).get(expert) - ModelView.open(source).get(expert)).abs().max() < 0.1
    assert json.loads((final / "round.json").read_text())["tensors"] == len(CheckpointReader(source).info)


def test_diloco_from_a_hub_shaped_qwen3_vl_moe_keeps_every_tensor(prefect_api, tmp_path):
    """θ0 as the hub's Qwen3-VL-MoE, each expert (in, out) on disk (the tiny model's own layout): the workers'
    Δ (as they hold the experts, (out, in)) are merged expert by expert and the globals written (in, out)."""
    run_dir = tmp_path / "run"
    settings = [
        *SMALL,
        "model.name_or_path=tiny:qwen3_vl_moe",
        "diloco.inner_steps=2",
        "diloco.rounds=2",
        "diloco.eval_every=0",
        "diloco.methods=[{name: iso, method: iso_c, outer_lr: 1.0, outer_momentum: 0.0}]",
    ]
    completes(diloco, run_dir, settings)
    theta0 = CheckpointReader(run_dir / "init")
    final = run_dir / "diloco" / "iso-iid" / "global" / "2"  # variant: the method and the shards
    same_tensors(final, theta0)
    fused = "model.language_model.layers.0.mlp.experts.down_proj"
    assert theta0.info[fused].shape == (4, 24, 64)  # (experts, in, out)
    delta = ModelView.open(final).get_loaded(fused) - ModelView.open(run_dir / "init").get_loaded(fused)
    assert 0 < delta.abs().max() < 0.1  # θ0 read as loaded
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


@pytest.mark.release  # both flows again, on the dense families
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
