"""The MERIT flow end to end on a temporary Prefect API: real DeepSpeed branches, merges,
evaluation, report and artifacts; re-runs that redo nothing; a branch that fails for good; which
failures a retry is for. (A branch SIGKILLed inside a flow and resumed by the task's retry:
tests/test_shipped_3b.py; a lost machine: tests/test_prefect_server.py.)"""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from judge_server import JudgeServer
from peft import PeftModel
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForImageTextToText

from flows.merit import joint, merit
from pipeline.checkpoint import is_complete, read_manifest
from pipeline.eval.benchmarks import lmms_results
from pipeline.merge import CheckpointReader

ROOT = Path(__file__).parent.parent
OVERRIDES = [
    "data.builtin.examples_per_source=24",
    "calibration.n_per_source=4",
    "warmup.steps=4",
    "train.steps=16",
    "train.micro_batch=4",
    "train.max_tokens=256",  # about 4 of the built-in examples a packed micro batch
    "train.checkpoint_every=4",
    "train.deepspeed=zero2",
    "flow.retry_delay_s=0",
    "flow.parallel_branches=2",  # on 2 cores: a tiny branch is mostly its processes' start-up
    "merge.fisher_examples=4",  # the Fisher merge: the LoRA flow below and tests/test_shipped_3b.py
    "merge.methods=[{name: token_average, method: weighted_average}, {name: iso_c, method: iso_c}]",
    "eval.benchmarks=[toy_perception, toy_reasoning, toy_chat]",  # toy_chat: with a judge only
    "data.builtin.benchmark_examples=8",
    "eval.max_examples_per_source=3",  # held-out evaluation at test size: 18 models
    "eval.max_new_tokens=8",
    "eval.barrier_points=1",
    "merge.search.enabled=true",  # the token average's weights searched: its chosen merge is a model too
    "merge.search.trials=2",
    "merge.search.max_examples_per_source=1",  # of the 2 held-out examples a source: 1 for the report
]
NO_BENCHMARKS = "eval.benchmarks=[]"  # for flows whose evaluation another test checks
MERGES = ["token_average", "iso_c"]
TUNED = "merged-token_average-tuned"
PARTS = ["toy_reasoning_direct", "toy_reasoning_steps"]  # the toy_reasoning group's


def run_flow(run_dir: Path, *extra: str):
    return merit(
        config=str(ROOT / "configs/demo.yaml"), overrides=[*OVERRIDES, *extra], run_dir=str(run_dir), return_state=True
    )


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def copy_prepared(source: Path, dest: Path, branch: int) -> Path:
    """A run whose stages are done (data, θ0, split, joint baseline, every other branch) except
    ``branch`` and everything after the branches."""
    left_out = {(source, "merged"), (source, "eval"), (source, "report"), (source / "branches", str(branch))}
    shutil.copytree(  # links kept: a control reads the run's data and θ0 through relative links
        source, dest, symlinks=True, ignore=lambda folder, names: [n for n in names if (Path(folder), n) in left_out]
    )
    return dest


@pytest.fixture(scope="module")
def judge():
    """A judge that answers preflight's request, then fails every call until its mode is changed."""
    with JudgeServer("fail", answered=1) as server, pytest.MonkeyPatch.context() as env:
        env.setenv("JUDGE_KEY", "secret")
        yield server


def judged_by(judge: JudgeServer) -> str:
    return f"eval.judge={{base_url: '{judge.base_url}', model: {judge.model}, api_key_env: JUDGE_KEY}}"


@pytest.fixture(scope="module")
def judge_down(prefect_api, judge, tmp_path_factory) -> tuple[Path, object, dict, dict]:
    """The flow with its judge down after preflight: the models train, merge and are evaluated,
    every job but toy_chat's scores; the report is written, then the flow fails naming the jobs.
    Returns the run, its state, its report and θ0's toy_chat job as they were then."""
    run_dir = tmp_path_factory.mktemp("flow") / "run"
    state = run_flow(run_dir, judged_by(judge))
    job = run_dir / "eval" / "benchmarks" / "theta0" / "toy_chat.failed"
    assert (job / "lmms_eval.log").is_file()  # the failed job's folder is kept, whole, beside the task's
    report = json.loads((run_dir / "report" / "report.json").read_text())
    return run_dir, state, report, json.loads((job / "score.json").read_text())


@pytest.fixture(scope="module")
def finished_run(judge_down, judge) -> tuple[Path, object]:
    """The same flow re-run with the judge up again: only toy_chat's jobs run."""
    run_dir = judge_down[0]
    judge.mode = "good"
    state = run_flow(run_dir, judged_by(judge))
    assert state.is_completed(), state.message
    return run_dir, state


def test_the_flow_trains_merges_evaluates_and_reports(finished_run):
    run_dir, state = finished_run
    assert state.result() == str(run_dir / "report" / "report.md")
    theta0 = run_dir / "warmup" / "final"  # the joint warm-up is θ0
    assert read_manifest(theta0)["step"] == 4
    finals = [run_dir / "branches" / str(k) / "final" for k in range(2)]
    groups = json.loads((run_dir / "calibration" / "split.json").read_text())["groups"]
    for final, group in zip(finals, groups):
        manifest = read_manifest(final)
        assert manifest["parent"] == str(theta0) and manifest["sources"] == group and manifest["step"] == 16
    assert read_manifest(run_dir / "joint" / "final")["step"] == 32  # K x steps: the same budget

    # The branches trained on packed micro batches (every position a token of an example), and MERIT's
    # merge of them is the average of the branches weighted by their groups' training tokens.
    for k in range(2):
        records = [json.loads(r) for r in (run_dir / "branches" / str(k) / "metrics.jsonl").read_text().splitlines()]
        assert [r["positions"] for r in records] == [
            b["tokens"] - a for a, b in zip([0] + [r["tokens"] for r in records], records)
        ]
    sources = json.loads((run_dir / "data" / "manifest.json").read_text())["sources"]
    tokens = torch.tensor([sum(sources[s]["train_tokens"] for s in g) for g in groups], dtype=torch.float64)
    w = tokens / tokens.sum()
    branches, merged = [weights(f) for f in finals], weights(run_dir / "merged" / "token_average")
    for name, value in merged.items():
        expected = sum(wk * b[name].double() for wk, b in zip(w, branches))
        assert torch.allclose(value.double(), expected, atol=1e-6), name
    AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / "iso_c")

    report = json.loads((run_dir / "report" / "report.json").read_text())
    expected = {"theta0", "branch-0", "branch-1", "joint", *(f"merged-{m}" for m in MERGES), TUNED}
    assert {m["name"] for m in report["models"]} == expected
    for model in report["models"]:
        evaluated = json.loads((run_dir / "eval" / f"{model['name']}.json").read_text())
        assert model["loss"] == pytest.approx(evaluated["loss"]) and 0 < evaluated["loss"] < 20
    joint_loss = next(m["loss"] for m in report["models"] if m["name"] == "joint")
    theta0_loss = next(m["loss"] for m in report["models"] if m["name"] == "theta0")
    assert joint_loss < theta0_loss  # training helps on held-out data
    assert report["costs"]["calibration_share_pct"] > 0
    for plot in ("heldout_loss.png", "per_source.png", "training_curves.png"):
        assert (run_dir / "report" / plot).stat().st_size > 5_000

    with get_client(sync_client=True) as client:
        run_id = state.state_details.flow_run_id
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
    by_key = {a.key: a for a in artifacts if a.key}
    assert by_key["demo-report"].type == "markdown" and "## Models" in by_key["demo-report"].data
    assert by_key["demo-models"].type == "table" and "merged-token_average" in json.dumps(by_key["demo-models"].data)
    for key in ("demo-warmup", "demo-training"):  # the warm-up's and the branches' progress, finished
        assert by_key[key].type == "progress" and float(by_key[key].data) == 100.0
    report_md = by_key["demo-report"].data  # every plot inline: the UI cannot open the run's files
    assert "file://" not in report_md and not re.search(r"\]\((?!data:)[^)]*\.png\)", report_md)
    plots = {key: a.data for key, a in by_key.items() if key.startswith("demo-plot-")}
    assert {"demo-plot-report-heldout-loss", "demo-plot-branches-1-loss"} <= set(plots)
    for markdown in [report_md, *plots.values()]:
        for uri in re.findall(r"\(data:image/png;base64,([^)]+)\)", markdown):
            assert base64.b64decode(uri).startswith(b"\x89PNG")
    assert all(len(markdown) < 100_000 for markdown in plots.values())
    assert (run_dir / "report" / "report.md").read_text().count("](heldout_loss.png)") == 1  # the file keeps its links


def test_a_judge_down_costs_only_its_task_named_in_the_report_and_the_flow_fails_after_it(judge_down, judge):
    _, state, report, job = judge_down
    assert state.is_failed()
    assert (
        "benchmark job(s) got no score" in state.message
        and "toy_chat: 8 of 8 judgements by test-judge" in state.message
    )
    rows = {(r["model"], r["split"]): r for r in report["benchmarks"]["rows"]}
    assert len(rows) == 8  # the constant answer, θ0, joint, 2 merges × 2 splits, the searched merge: no branch
    assert all("toy_chat" not in row and row["average"] is None for row in rows.values())
    assert all(row["toy_perception"] is not None and "toy_reasoning" in row for row in rows.values())
    notes = "\n".join(report["benchmarks"]["notes"])
    for model in ("theta0", "joint", "merged-token_average", "random/merged-iso_c"):
        assert f"{model}, `toy_chat`: no score: 8 of 8 judgements by test-judge at {judge.base_url} failed" in notes
    assert job["judge_failures"] == 8 and "score" not in job and job["log_tail"]


def test_the_judge_back_up_judges_the_logged_answers_again_without_generating_them(finished_run):
    run_dir, _ = finished_run
    folder = run_dir / "eval" / "benchmarks" / "theta0"
    record = json.loads((folder / "toy_chat" / "score.json").read_text())
    assert record["answers_from"] == str(folder / "toy_chat.failed") and "score" in record
    assert "--model merit_stored_answers" in record["command"] and not (folder / "toy_chat.failed").exists()


def test_the_report_opens_with_the_benchmarks_lmms_eval_scored_on_every_model(finished_run):
    """θ0, the joint baseline and every merge on both splits (not the branches), each task scored by
    lmms-eval in a job of its own, its results file kept; the constant-answer baseline first; the
    report's first table."""
    run_dir, state = finished_run
    report = json.loads((run_dir / "report" / "report.json").read_text())
    rows = {(r["model"], r["split"]): r for r in report["benchmarks"]["rows"]}
    merges = [(f"merged-{m}", split) for m in MERGES for split in ("MERIT-2", "Random-2")]
    assert set(rows) == {("constant", "—"), ("theta0", "—"), ("joint", "—"), *merges, (TUNED, "MERIT-2")}
    assert rows[(TUNED, "MERIT-2")]["label"] == "token_average: weighted_average, weights searched"
    search = report["search"]  # the n_k weights are trial 0; the chosen ones at least as good on the dev split
    assert search["given"]["trial"] == 0 and search["best"]["value"] <= search["given"]["value"]
    assert report["benchmarks"]["rows"][0]["label"] == "constant answer"
    for (model, split), row in rows.items():
        folder = (run_dir / "controls" / "random" if split == "Random-2" else run_dir) / "eval" / "benchmarks" / model
        for task in ("toy_perception", "toy_chat"):
            lmms = json.loads(lmms_results(folder / task).read_text())["results"][task]  # lmms-eval's own
            metric = "accuracy" if task == "toy_perception" else "judge_score"
            assert row[task] == pytest.approx((100 if task == "toy_perception" else 1) * lmms[f"{metric},none"])
        parts = [
            json.loads(lmms_results(folder / "toy_reasoning").read_text())["results"][t]["accuracy,none"] for t in PARTS
        ]
        assert row["toy_reasoning"] == pytest.approx(100 * sum(parts) / 2)  # 8 questions each
        assert row["average"] == pytest.approx((row["toy_perception"] + row["toy_reasoning"] + row["toy_chat"]) / 3)
        if model not in ("joint", "constant"):
            assert row["vs_joint"] == pytest.approx(row["average"] - rows[("joint", "—")]["average"])
        if split == "MERIT-2" and model != TUNED:  # the controls keep their configured weights
            assert row["vs_control"] == pytest.approx(row["average"] - rows[(model, "Random-2")]["average"])
    markdown = (run_dir / "report" / "report.md").read_text()
    assert markdown.split("\n## ")[1].startswith("Benchmarks")  # the first section
    assert "sources: 18 fine-tuning, 22 warm-up (θ0), 5 unseen." in markdown  # by role, none dropped
    assert "`toy_chat` (LLaVA-in-the-Wild)" in markdown and "Best merge on MERIT-2: **" in markdown
    assert "`toy_reasoning` is a group lmms-eval reports no aggregate for" in markdown
    assert "no score" not in markdown  # the judge's failures of the first run: redone
    assert (run_dir / "report" / "benchmarks.png").stat().st_size > 5_000
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    table = next(a for a in artifacts if a.key == "demo-benchmarks")
    assert table.type == "table" and "toy_chat" in json.dumps(table.data)


def test_the_random_control_trains_the_same_k_and_budget_from_the_same_theta0(finished_run):
    run_dir, _ = finished_run
    control = run_dir / "controls" / "random"
    split = json.loads((control / "calibration" / "split.json").read_text())
    merit_split = json.loads((run_dir / "calibration" / "split.json").read_text())
    assert split["method"] == "random" and len(split["groups"]) == len(merit_split["groups"]) == 2
    assert sorted(s for g in split["groups"] for s in g) == sorted(s for g in merit_split["groups"] for s in g)
    for k in range(2):
        manifest = read_manifest(control / "branches" / str(k) / "final")
        assert Path(manifest["parent"]).resolve() == (run_dir / "warmup" / "final").resolve()
        assert manifest["step"] == 16 and manifest["sources"] == split["groups"][k]
    assert not (control / "joint").exists()  # the run has the joint baseline
    assert not (control / "eval" / "theta0.json").exists()  # the same θ0: evaluated once, with the run

    report = json.loads((run_dir / "report" / "report.json").read_text())
    rows = {(r.get("merge", r["model"]), r["split"]): r for r in report["quality"]["rows"]}
    for merge in MERGES:
        evaluated = json.loads((control / "eval" / f"merged-{merge}.json").read_text())
        assert rows[(merge, "Random-2")]["loss"] == evaluated["loss"]
        assert (
            rows[(merge, "MERIT-2")]["loss"]
            == json.loads((run_dir / "eval" / f"merged-{merge}.json").read_text())["loss"]
        )
    assert "iso_c (scale 1.0)" in {r["model"] for r in report["quality"]["rows"]}  # the report says which scale
    for split, folder in (("MERIT-2", run_dir), ("Random-2", control)):  # 0 is a barrier too: none
        diagnostics = json.loads((folder / "eval" / "diagnostics.json").read_text())
        assert report["quality"]["barriers"][split] == diagnostics["barrier"]["barrier"] >= 0
    assert report["quality"]["verdict"].startswith("MERIT-2 beats Random-2 by held-out loss for ")
    markdown = (run_dir / "report" / "report.md").read_text()
    assert "## Did the split pay off?" in markdown and "MERIT-2 − Random-2: loss " in markdown
    assert (run_dir / "report" / "quality.png").stat().st_size > 5_000


def test_every_branch_and_model_has_its_tensorboard_run(finished_run):
    """One TensorBoard run per training folder (warm-up, joint, branches, the control's) holding
    the steps of its metrics.jsonl, and one per evaluated model: `tensorboard --logdir <run>`."""
    run_dir, _ = finished_run
    folders = ["warmup", "joint", "branches/0", "branches/1", "controls/random/branches/0"]
    for folder in folders:
        board = EventAccumulator(str(run_dir / folder / "tensorboard"))  # TensorBoard's own reader
        board.Reload()
        steps = [json.loads(line)["step"] for line in (run_dir / folder / "metrics.jsonl").read_text().splitlines()]
        assert [e.step for e in board.Scalars("train/loss")] == steps, folder
    for evaluation in (run_dir / "eval").glob("*.json"):
        if evaluation.stem == "diagnostics":
            continue
        board = EventAccumulator(str(run_dir / "eval" / "tensorboard" / evaluation.stem))
        board.Reload()
        loss = json.loads(evaluation.read_text())["loss"]
        assert [e.value for e in board.Scalars("heldout/loss")] == [pytest.approx(loss)], evaluation.stem


def test_the_report_rebuilds_from_the_run_directory_with_its_controls(finished_run, tmp_path):
    from pipeline.report import build_report

    run_dir = tmp_path / "run"
    shutil.copytree(
        finished_run[0], run_dir, symlinks=True, ignore=lambda folder, names: ["report"] * ("report" in names)
    )
    rebuilt = build_report(run_dir)
    original = json.loads((finished_run[0] / "report" / "report.json").read_text())
    assert rebuilt["quality"] == original["quality"] and rebuilt["tables"]["quality"] == original["tables"]["quality"]


def test_a_rerun_redoes_nothing(finished_run, judge):
    run_dir, _ = finished_run
    outputs = [
        *run_dir.glob("*/final/manifest.json"),
        *run_dir.glob("branches/*/final/manifest.json"),
        *run_dir.glob("merged/*/manifest.json"),
        *run_dir.glob("eval/*.json"),
        *run_dir.glob("controls/random/branches/*/final/manifest.json"),
        *run_dir.glob("controls/random/eval/*.json"),
        *run_dir.glob("**/eval/benchmarks/*/*/score.json"),
        *run_dir.glob("**/train.log"),
    ]
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in outputs}
    assert len(before) >= 15
    assert run_flow(run_dir, judged_by(judge)).is_completed()
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in outputs} == before


def test_a_failed_rerun_keeps_the_judged_results_byte_for_byte_and_the_report_names_it(finished_run, judge):
    """The finished run again with toy_chat's limit changed and its judge failing after preflight:
    toy_chat's jobs run again and fail; the earlier results stay as they were, and the report
    shows no toy_chat score, naming the failed re-run and the earlier score left out."""
    run_dir, _ = finished_run
    folder = run_dir / "eval" / "benchmarks" / "theta0"
    before = {f: f.read_bytes() for f in sorted((folder / "toy_chat").rglob("*")) if f.is_file()}
    judge.mode, judge.answered = "fail", judge.calls + 1  # preflight's request answered, then every call fails
    try:
        state = run_flow(run_dir, judged_by(judge), "eval.benchmark_tasks={toy_chat: {limit: 4}}")
    finally:
        judge.mode = "good"
    assert state.is_failed() and "theta0/toy_chat: 4 of 4 judgements by test-judge" in state.message
    assert {f: f.read_bytes() for f in sorted((folder / "toy_chat").rglob("*")) if f.is_file()} == before
    assert json.loads((folder / "toy_chat.failed" / "score.json").read_text())["identity"]["limit"] == 4
    report = json.loads((run_dir / "report" / "report.json").read_text())
    theta0 = next(r for r in report["benchmarks"]["rows"] if r["model"] == "theta0")
    assert "toy_chat" not in theta0 and theta0["average"] is None and theta0["toy_perception"] is not None
    notes = "\n".join(report["benchmarks"]["notes"])
    assert "theta0, `toy_chat`: no score: the re-run under this run's settings failed: 4 of 4 judgements" in notes
    assert "theta0, `toy_chat`: an earlier score" in notes and "scored with another limit than this run's" in notes


@pytest.mark.release  # the joint flow again over the module's run
def test_the_joint_flow_reuses_what_the_run_has_and_reports(finished_run, tmp_path):
    reference, _ = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir, ignore=lambda folder, names: [n for n in names if n in ("eval", "report")])
    stamp = (run_dir / "joint" / "final" / "manifest.json").stat().st_mtime_ns
    overrides = [*OVERRIDES, NO_BENCHMARKS]
    state = joint(config=str(ROOT / "configs/demo.yaml"), overrides=overrides, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    assert (run_dir / "joint" / "final" / "manifest.json").stat().st_mtime_ns == stamp  # trained once, by merit
    models = [m["name"] for m in json.loads((run_dir / "report" / "report.json").read_text())["models"]]
    assert models[0] == "theta0" and "joint" in models


@pytest.mark.release  # a failing branch through a second whole flow; retries: test_worth_retrying
def test_a_branch_failing_for_good_fails_the_flow_and_keeps_the_others(finished_run, tmp_path):
    run_dir = copy_prepared(finished_run[0], tmp_path / "run", branch=1)
    pointer = run_dir / "branches" / "1" / "checkpoints" / "latest.json"
    pointer.parent.mkdir(parents=True)
    pointer.write_text(json.dumps({"tag": "step999", "step": 999}))  # names a checkpoint that is not there
    state = run_flow(run_dir, "flow.branch_retries=1", NO_BENCHMARKS)
    assert state.is_failed() and "1 branch(es) failed for good: branch 1: training exit code 1" in state.message
    log = (run_dir / "branches" / "1" / "train.log").read_text()
    assert log.count("names step999, which cannot be loaded") == 2  # the first attempt and its retry
    finished = run_dir / "branches" / "0" / "final" / "manifest.json"  # done before: the flow skipped it
    assert is_complete(finished.parent) and not (run_dir / "merged").exists()

    stamp = finished.stat().st_mtime_ns
    pointer.unlink()  # the cause is fixed: a re-run trains branch 1 only
    assert run_flow(run_dir, NO_BENCHMARKS).is_completed()
    assert finished.stat().st_mtime_ns == stamp and is_complete(run_dir / "branches" / "1" / "final")


def test_worth_retrying_refuses_what_a_retry_cannot_fix(prefect_api, tmp_path):
    """A branch task's retries are for kills, crashes and timeouts (they resume); a spec the
    library refused before launching (ValueError, FileNotFoundError) would be refused again."""
    from prefect import flow, task

    from flows.tasks import worth_retrying
    from pipeline.train.launch import BranchFailed

    errors = {
        "refused spec": ValueError("branch 0: unknown sources ['x']"),
        "no data": FileNotFoundError("data/manifest.json"),
        "killed": BranchFailed("0", 137, tmp_path / "train.log"),
        "timed out": TimeoutError("branch 0: no result after 10 s"),
    }
    attempts = []

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=worth_retrying)
    def branch(kind: str) -> None:
        attempts.append(kind)
        raise errors[kind]

    @flow
    def run(kind: str):
        return branch(kind, return_state=True)

    for kind, expected in [("refused spec", 1), ("no data", 1), ("killed", 3), ("timed out", 3)]:
        attempts.clear()
        assert run(kind, return_state=True).is_failed()
        assert len(attempts) == expected, (kind, attempts)


LORA = [
    "train.finetuning_type=lora",
    "train.lr=1.0e-2",
    "merge.methods=[{name: token_average, method: weighted_average}, {name: fisher, method: fisher}, "
    "{name: as_adapter, method: weighted_average, out_format: adapter}]",
    "eval.benchmarks=[toy_perception]",
    "flow.controls=[]",  # the Random-K control's flow: the first test of this module
]


@pytest.fixture(scope="module")
def lora_run(prefect_api, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora-flow") / "run"
    state = run_flow(run_dir, *LORA)
    assert state.is_completed(), state.message
    return run_dir


@pytest.mark.release  # LoRA through a second whole flow (adapters: test_lora, merges: test_merge_adapters)
def test_the_lora_flow_trains_adapters_merges_their_delta_w_and_benchmarks_them(lora_run):
    """LoRA branches and LoRA joint baseline; merges on ΔW (one written as an adapter); the Fisher
    merge on the adapted tensors; lmms-eval on adapters; the report says so."""
    run_dir = lora_run
    theta0 = run_dir / "warmup" / "final"
    assert (theta0 / "model.safetensors").is_file()  # the warm-up stays a full fine-tune: θ0 is a model
    for folder in ["branches/0", "branches/1", "joint"]:
        final = run_dir / folder / "final"
        base = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert Path(base).resolve() == theta0.resolve(), folder
        assert not (final / "model.safetensors").exists(), folder

    # MERIT's merge on ΔW: θ0 + Σ w_k ΔW_k, each ΔW_k as PEFT forms it.
    groups = json.loads((run_dir / "calibration" / "split.json").read_text())["groups"]
    sources = json.loads((run_dir / "data" / "manifest.json").read_text())["sources"]
    tokens = torch.tensor([sum(sources[s]["train_tokens"] for s in g) for g in groups], dtype=torch.float64)
    w = (tokens / tokens.sum()).tolist()
    base = AutoModelForImageTextToText.from_pretrained(theta0).state_dict()
    deltas = [
        {
            n: t - base[n]
            for n, t in PeftModel.from_pretrained(
                AutoModelForImageTextToText.from_pretrained(theta0), run_dir / "branches" / str(k) / "final"
            )
            .merge_and_unload()
            .state_dict()
            .items()
        }
        for k in range(2)
    ]
    merged = AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / "token_average").state_dict()
    for name, value in merged.items():
        assert torch.allclose(value, base[name] + w[0] * deltas[0][name] + w[1] * deltas[1][name], atol=1e-6), name
    assert read_manifest(run_dir / "merged" / "as_adapter")["format"] == "adapter"
    fisher = CheckpointReader(run_dir / "branches" / "0" / "fisher")
    assert fisher.info and all(n.endswith(".weight") and "norm" not in n for n in fisher.info)  # the adapted only

    report = json.loads((run_dir / "report" / "report.json").read_text())
    rows = {(r["model"], r["split"]) for r in report["benchmarks"]["rows"]}
    assert {("theta0", "—"), ("joint", "—"), ("merged-as_adapter", "MERIT-2"), ("merged-fisher", "MERIT-2")} <= rows
    job = json.loads((run_dir / "eval" / "benchmarks" / "joint" / "toy_perception" / "score.json").read_text())
    assert "--model merit_qwen2_5_vl" in job["command"]  # lmms-eval over θ0 + the joint adapter
    assert "Merged on ΔW" in (run_dir / "report" / "report.md").read_text()
