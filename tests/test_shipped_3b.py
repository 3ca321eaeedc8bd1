"""The shipped ``configs/qwen2_5_vl_3b.yaml`` run end to end, as a user would start it, with what
:func:`overrides` lists changed (paths, sizes, the merge device, K = 2, ZeRO-3 on 2 ranks, a toy
benchmark for the eight; the config's header says the same): θ0 named by its hub id and found in a hub-shaped cache
(a random Qwen2.5-VL with the 3B model's structure at tiny widths, stored in bf16, no manifest),
data in Vision-FLAN's layout, bf16 training with ZeRO-3 on 2 ranks and 4 accumulated micro
batches, a branch SIGKILLed and resumed, Iso-C with Newton–Schulz, TIES and Fisher merges."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import hub_snapshot, processes_of, vision_flan_corpus
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from flows.merit import merit
from pipeline.checkpoint import is_complete, read_manifest
from pipeline.config import load_config
from pipeline.eval.benchmarks import CONSTANT
from pipeline.merge import CheckpointReader
from pipeline.models import build_tiny_model
from pipeline.preflight import PreflightError, check_run

ROOT = Path(__file__).parent.parent
CONFIG = ROOT / "configs" / "qwen2_5_vl_3b.yaml"
TASKS = ["colour_name", "colour_complement", "count_digits", "count_words"]


def overrides(annotation: Path, images: Path) -> list[str]:
    return [
        f"data.sources.0.path={annotation}",  # paths
        f"data.sources.0.images_dir={images}",
        "train.deepspeed=zero3",  # ZeRO-3, as a 7B run needs
        "model.min_pixels=3136",  # sizes: images of 56-112 px
        "model.max_pixels=12544",
        "calibration.n_per_source=4",
        "calibration.batch_size=2",
        "calibration.r=1",  # K = 2
        "train.max_tokens=128",  # two or three of these tiny examples a packed micro batch
        "train.processes=2",
        "train.checkpoint_every=2",
        "train.loader_workers=1",
        "merge.fisher_examples=4",
        "eval.batch_size=4",
        "eval.max_examples_per_source=2",
        "flow.retry_delay_s=0",
        "merge.device=cpu",  # the device
        # The paper's 8 benchmarks need their data and a judge (test_preflight_names_..., and scored on
        # hub-shaped caches in tests/test_paper_benchmarks.py): the same path on a toy stand-in, 8 questions.
        "eval.benchmarks=[toy_perception]",
        "data.builtin.benchmark_examples=8",
    ]


def theta0_snapshot(root: Path) -> Path:
    """A random Qwen2.5-VL with the 3B's structure (tied embeddings, GQA, windowed vision blocks
    with full attention every 8th, 112 px windows) at tiny widths, saved in bf16 as downloaded."""
    cfg = load_config(None, ["model.tiny.vision_depth=8", "model.tiny.vision_window=112"])
    model, processor = build_tiny_model(cfg.model, seed=0)
    folder = root / "download"
    model.to(torch.bfloat16).save_pretrained(folder)
    processor.save_pretrained(folder)
    return hub_snapshot(root / "hf", "Qwen/Qwen2.5-VL-3B-Instruct", folder)


def kill_after_first_checkpoint(branch: Path, killed: list[int], done: threading.Event) -> None:
    latest = branch / "checkpoints" / "latest.json"
    while not done.is_set() and not is_complete(branch / "final"):
        pids = processes_of(branch / "spec.json")
        if len(pids) >= 3 and latest.is_file():  # the launcher and both ranks
            for pid in pids:  # a machine lost: every process at once
                os.kill(pid, signal.SIGKILL)
            killed.append(json.loads(latest.read_text())["step"])
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def shipped(prefect_api, tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped-3b")
    snapshot = theta0_snapshot(root)
    annotation, images = vision_flan_corpus(root / "vision-flan", TASKS, per_task=12)
    run_dir, settings = root / "run", overrides(annotation, images)
    killed, done = [], threading.Event()
    killer = threading.Thread(target=kill_after_first_checkpoint, args=(run_dir / "branches" / "0", killed, done))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(root / "hf"))
        env.setenv("HF_HUB_OFFLINE", "1")
        killer.start()
        state = merit(config=str(CONFIG), overrides=settings, run_dir=str(run_dir), return_state=True)
        done.set()
        killer.join()
    assert state.is_completed(), state.message
    return run_dir, snapshot, settings, killed


def smoke_settings() -> list[str]:
    """The `--set` settings of docs/first-real-run.md's smoke run command."""
    page = (ROOT / "docs" / "first-real-run.md").read_text()
    command = page.split("## A smoke run on one GPU", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return re.findall(r"--set (\S+)", command)


@pytest.mark.release  # a second whole flow of the same config (the fixture's)
def test_the_smoke_run_of_the_first_real_run_page_runs(prefect_api, tmp_path):
    """docs/first-real-run.md's one-GPU smoke command, on a tiny model of the 3B's shape: the
    paths, image sizes, device and benchmarks are the test's, every other setting the page's."""
    smoke = smoke_settings()
    assert "train.processes=1" in smoke and "eval.benchmark_limit=10" in smoke
    snapshot = theta0_snapshot(tmp_path)
    annotation, images = vision_flan_corpus(tmp_path / "vision-flan", TASKS, per_task=12)
    local = [
        f"data.sources.0.path={annotation}",
        f"data.sources.0.images_dir={images}",
        "model.min_pixels=3136",
        "model.max_pixels=12544",
        "merge.device=cpu",
        "eval.benchmarks=[toy_perception]",
        "data.builtin.benchmark_examples=8",
    ]
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(tmp_path / "hf"))
        env.setenv("HF_HUB_OFFLINE", "1")
        state = merit(config=str(CONFIG), overrides=[*smoke, *local], run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert {m["name"] for m in report["models"]} >= {"theta0", "branch-0", "branch-1", "merged-token_average"}
    assert "joint" not in {m["name"] for m in report["models"]}
    steps = [
        json.loads((run_dir / "branches" / str(k) / "final" / "manifest.json").read_text())["step"] for k in (0, 1)
    ]
    assert steps == [10, 10] and str(snapshot).endswith(load_config(run_dir / "config.yaml").model.revision)
    jobs = list((run_dir / "eval" / "benchmarks").glob("*/toy_perception/score.json"))
    assert jobs and all(json.loads(j.read_text())["identity"]["limit"] == 10 for j in jobs)


PAPER_DATA = {  # the paper's 8 benchmarks and the data each reads, as lmms-eval's tasks name it
    "seedbench": "lmms-lab-encoder/SEED-Bench",
    "mmbench_en_dev": "lmms-lab-encoder/MMBench",
    "ai2d": "lmms-lab-encoder/ai2d",
    "textvqa_val": "lmms-lab-encoder/textvqa",
    "mmmu_val": "lmms-lab-encoder/MMMU",
    "mathvista_testmini_format": "AI4Math/MathVista",
    "llava_in_the_wild": "lmms-lab-encoder/llava-bench-in-the-wild",
    "mmvet": "lmms-lab-encoder/MMVet",
}


def test_preflight_names_every_benchmark_without_data_and_the_judge_without_its_key(tmp_path, monkeypatch):
    """The shipped benchmarks as they are: offline, none of their data in the cache, no judge key."""
    annotation, images = vision_flan_corpus(tmp_path / "vision-flan", TASKS[:2], per_task=2)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    settings = overrides(annotation, images)[:-2]  # the shipped eval.benchmarks
    cfg = load_config(CONFIG, settings)
    assert cfg.eval.benchmarks == list(PAPER_DATA) and cfg.eval.judge is not None
    with pytest.raises(PreflightError) as refused:
        check_run(cfg, tmp_path / "run")
    benchmarks = next(line for line in str(refused.value).splitlines() if "benchmarks:" in line)
    for task, dataset in PAPER_DATA.items():
        assert f"task '{task}': its data {dataset} is not in the Hugging Face cache" in benchmarks, task
        assert f"hf download {dataset} --repo-type dataset" in benchmarks
    judged = "['mmbench_en_dev', 'mathvista_testmini_format', 'llava_in_the_wild', 'mmvet']"
    assert f"{judged} need the judge's key in $OPENAI_API_KEY" in benchmarks
    with pytest.raises(PreflightError, match=re.escape(f"{judged} are scored by a judge model: set eval.judge")):
        check_run(load_config(CONFIG, [*settings, "eval.judge=null"]), tmp_path / "run")


def test_the_shipped_config_runs_from_the_hub_snapshot_in_bf16_and_survives_a_killed_branch(shipped):
    run_dir, snapshot, settings, killed = shipped
    ran = load_config(run_dir / "config.yaml")
    assert ran.model.revision == snapshot.name  # the hub commit the run started from, pinned
    shipped = load_config(CONFIG, [*settings, f"model.revision={snapshot.name}"])
    assert ran == shipped  # the shipped file itself, with the overrides only
    assert ran.model.name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct" and ran.train.packing
    assert not (snapshot / "manifest.json").exists()  # used in place, as downloaded

    finals = [run_dir / "branches" / str(k) / "final" for k in range(2)]
    for final in finals:
        manifest = read_manifest(final)
        assert manifest["parent"] == str(snapshot) and manifest["examples_seen"] >= 22
        assert {i.dtype for i in CheckpointReader(final).info.values() if i.dtype.is_floating_point} == {torch.bfloat16}
    assert killed, "branch 0 finished before it could be killed"
    assert f"branch 0: resumed from step{killed[0]}" in (run_dir / "branches" / "0" / "train.log").read_text()

    # MERIT's merge: the branches weighted by their groups' data tokens, in fp32, written in bf16.
    sources = json.loads((run_dir / "data" / "manifest.json").read_text())["sources"]
    n = [sum(sources[s]["train_tokens"] for s in read_manifest(f)["sources"]) for f in finals]
    branches, merged = (
        [load_file(f / "model.safetensors") for f in finals],
        load_file(run_dir / "merged" / "token_average" / "model.safetensors"),
    )
    for name, value in merged.items():
        expected = sum(nk / sum(n) * b[name].float() for nk, b in zip(n, branches))
        assert value.dtype == torch.bfloat16 and torch.allclose(value.float(), expected, rtol=1e-2, atol=1e-3), name
    for name in ("token_average", "iso_c", "ties", "fisher"):
        model = AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / name)
        assert model.model.language_model.embed_tokens.weight.dtype == torch.bfloat16
    assert read_manifest(run_dir / "merged" / "iso_c")["spec"]["params"]["orthogonaliser"] == "newton_schulz"
    fisher = CheckpointReader(run_dir / "branches" / "0" / "fisher")
    assert fisher.info and not any(t.startswith("visual.blocks.") for t in fisher.info)  # the frozen tower: none

    report = json.loads((run_dir / "report" / "report.json").read_text())
    expected = {
        "theta0",
        "branch-0",
        "branch-1",
        "joint",
        *(f"merged-{m}" for m in ("token_average", "iso_c", "ties", "fisher")),
    }
    assert {m["name"] for m in report["models"]} == expected and "problems" not in report
    benchmarked = {r["model"] for r in report["benchmarks"]["rows"]}  # lmms-eval on the bf16 models, branches aside
    assert benchmarked == expected - {"branch-0", "branch-1"} | {CONSTANT}  # and the toy task's constant answers
    assert report["budget"]["epochs"] == 1.0
