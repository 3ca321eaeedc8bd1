"""Benchmark jobs through lmms-eval on the tiny θ0: each job's score against a hand count of
lmms-eval's own samples, a group without an aggregate, the recorded command redoing the job,
current jobs reused, data-parallel ranks answering as one process does, a job past its time limit
named while the others keep their scores, the constant-answer baseline, preflight's refusals,
and the headline metrics read from results shaped as lmms-eval writes them. (The paper's eight
tasks on hub-shaped caches: tests/test_paper_benchmarks.py; the toy suite: tests/test_toy_suite.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import small_config
from judge_server import JudgeServer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.checkpoint import sha256_file
from pipeline.data.benchmark import CONSTANTS, TASKS_DIR, write_tasks
from pipeline.eval.benchmarks import (
    CONSTANT,
    SCORE,
    JobSettings,
    Slot,
    benchmark_dir,
    check_benchmarks,
    constant_answers,
    job_settings,
    kill_tree,
    lmms_arguments,
    lmms_results,
    log_tail,
    read_scores,
    run_benchmark,
    scoring_code,
)
from pipeline.eval.lmms_run import parse, task_manager
from pipeline.eval.lmms_tasks import Headline, TaskPlan, detected_scale, plan_tasks, score
from pipeline.eval.scoring import score as score_answer
from pipeline.report.benchmarks import notes

TASKS = ["toy_perception", "toy_reading", "toy_reasoning"]
PARTS = ["toy_reasoning_direct", "toy_reasoning_steps"]


def scored(record: dict) -> dict:
    """``record`` when its job scored; otherwise a failure naming the job's error and log tail."""
    assert "score" in record, f"{record['model']}/{record['task']}: {record.get('error')}\n{record.get('log_tail')}"
    return record


def samples_of(folder: Path, task: str) -> list[dict]:
    (file,) = folder.rglob(f"*_samples_{task}.jsonl")
    return [json.loads(line) for line in file.read_text().splitlines()]


@pytest.fixture(scope="module")
def jobs(tiny_run):
    """lmms-eval's qwen2_5_vl on the tiny θ0: two toy tasks and the toy group, 12 questions each."""
    _, run_dir = tiny_run
    cfg = small_config(f"eval.benchmarks=[{', '.join(TASKS)}]", "data.builtin.benchmark_examples=12")
    write_tasks(cfg, run_dir)
    theta0 = str(run_dir / "init")
    return cfg, run_dir, {task: scored(run_benchmark(cfg, run_dir, "theta0", theta0, task)) for task in TASKS}


def hand_count(run_dir: Path, folder: Path, task: str) -> float:
    answers = {s["doc_id"]: s["filtered_resps"] for s in samples_of(folder, task)}
    docs = [json.loads(line) for line in (run_dir / TASKS_DIR / f"{task}.jsonl").read_text().splitlines()]
    assert len(answers) == len(docs) == 12
    return sum(score_answer(d["scoring"], answers[i], d["answer"], d["options"]) for i, d in enumerate(docs)) / 12


def test_each_job_scores_its_task_as_a_hand_count_of_lmms_evals_samples(jobs):
    cfg, run_dir, records = jobs
    for task in ("toy_perception", "toy_reading"):
        folder = benchmark_dir(run_dir, "theta0") / task
        lmms = json.loads(lmms_results(folder).read_text())  # lmms-eval's own, as it wrote it
        hand = hand_count(run_dir, folder, task)
        assert lmms["results"][task]["accuracy,none"] == pytest.approx(hand)
        expected = {"metric": "accuracy,none", "value": hand, "scale": 100.0, "score": 100 * hand, "examples": 12}
        assert records[task]["score"] == expected
    scores = read_scores(cfg, run_dir, "theta0", str(run_dir / "init"))
    assert scores["average"] == pytest.approx(sum(s["score"] for s in scores["tasks"].values()) / 3)
    events = EventAccumulator(str(run_dir / "eval" / "tensorboard" / "theta0" / "benchmarks")).Reload()
    assert events.Scalars("benchmarks/average")[-1].value == pytest.approx(scores["average"])
    assert events.Scalars("benchmarks/toy_reading")[-1].value == pytest.approx(records["toy_reading"]["score"]["score"])


def test_a_group_without_an_aggregate_is_scored_from_its_tasks_by_their_sizes(jobs):
    _, run_dir, records = jobs
    folder = benchmark_dir(run_dir, "theta0") / "toy_reasoning"
    lmms = json.loads(lmms_results(folder).read_text())
    assert "toy_reasoning" not in lmms.get("groups", {})  # lmms-eval reports no figure for the group
    assert not any("," in key for key in lmms["results"]["toy_reasoning"])
    group = records["toy_reasoning"]["score"]
    for part in PARTS:
        assert group["parts"][part]["value"] == pytest.approx(hand_count(run_dir, folder, part))
    assert group["score"] == pytest.approx(sum(group["parts"][p]["score"] for p in PARTS) / 2)  # 12 questions each
    assert group["examples"] == 24


def test_a_group_with_an_aggregate_is_scored_by_lmms_evals_own(jobs, tmp_path):
    """A group of one's own over the toy variants, with lmms-eval's size-weighted mean as its aggregate."""
    _, run_dir, _ = jobs
    (tmp_path / "mean.yaml").write_text(
        "group: toy_reasoning_mean\ntask: [toy_reasoning_direct, toy_reasoning_steps]\n"
        "aggregate_metric_list:\n  - {metric: accuracy, aggregation: mean, weight_by_size: true}\n"
    )
    cfg = small_config("eval.benchmarks=[toy_reasoning, toy_reasoning_mean]", f"eval.include_path=[{tmp_path}]")
    record = run_benchmark(cfg, run_dir, "theta0", str(run_dir / "init"), "toy_reasoning_mean")
    lmms = json.loads(lmms_results(benchmark_dir(run_dir, "theta0") / "toy_reasoning_mean").read_text())
    aggregate = lmms["groups"]["toy_reasoning_mean"]["accuracy,none"]
    expected = {"metric": "accuracy,none", "value": aggregate, "scale": 100.0, "score": 100 * aggregate, "examples": 24}
    assert record["score"] == expected


def test_the_recorded_command_run_as_written_redoes_the_job(jobs):
    _, run_dir, records = jobs
    record, folder = records["toy_reading"], benchmark_dir(run_dir, "theta0") / "toy_reading"
    environment = "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 USE_HUB_KERNELS=NO OMP_NUM_THREADS=1"
    assert record["command"].startswith(f"cd {folder} && {environment} python -m")
    assert "--seed 0" in record["command"] and record["command"].count("--include_path=") == 1
    first, answers = lmms_results(folder), [s["filtered_resps"] for s in samples_of(folder, "toy_reading")]
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # `python`: this one
    subprocess.run(["bash", "-c", record["command"]], env=env, check=True, capture_output=True, timeout=300)
    again = lmms_results(folder)
    assert again != first
    redone = json.loads(again.read_text())["results"]["toy_reading"]["accuracy,none"]
    assert redone == record["score"]["value"]
    (newest,) = [f for f in folder.rglob("*_samples_toy_reading.jsonl") if f.name.startswith(again.name[:15])]
    assert [json.loads(line)["filtered_resps"] for line in newest.read_text().splitlines()] == answers


def test_a_current_job_is_not_run_again_and_a_changed_one_is(jobs, tiny_run):
    cfg, run_dir, records = jobs
    stamps = {t: (benchmark_dir(run_dir, "theta0") / t / SCORE).stat().st_mtime_ns for t in TASKS}
    for task in TASKS:
        assert run_benchmark(cfg, run_dir, "theta0", str(run_dir / "init"), task) == records[task]
    assert {t: (benchmark_dir(run_dir, "theta0") / t / SCORE).stat().st_mtime_ns for t in TASKS} == stamps
    capped = small_config(f"eval.benchmarks=[{', '.join(TASKS)}]", "eval.benchmark_gen_kwargs={max_new_tokens: 4}")
    record = run_benchmark(capped, run_dir, "theta0", str(run_dir / "init"), "toy_reading")
    assert (
        record["identity"]["gen_kwargs"] == {"max_new_tokens": 4}
        and "--gen_kwargs max_new_tokens=4" in record["command"]
    )
    # What else a score depends on: this project's scoring code, the prompts' model, the judge (none here).
    assert record["identity"]["code"] == scoring_code() and record["identity"]["prompts"] == "qwen2_5_vl"
    assert record["identity"]["judge"] is None
    run_benchmark(cfg, run_dir, "theta0", str(run_dir / "init"), "toy_reading")  # back to the fixture's


@pytest.mark.release  # the same job again on 2 ranks
def test_data_parallel_ranks_answer_every_question_as_one_process_does(jobs):
    """lmms-eval's torchrun mode on 2 CPU ranks (gloo): each rank answers half the questions, rank 0
    gathers them. One question a batch, so that no answer depends on what it is batched with."""
    _, run_dir, _ = jobs
    tasks = "eval.benchmarks=[toy_perception, toy_reasoning]"
    cfg = small_config(tasks, "data.builtin.benchmark_examples=12", "eval.benchmark_batch_size=1")
    theta0 = str(run_dir / "init")
    for task in ("toy_perception", "toy_reasoning"):
        one = scored(run_benchmark(cfg, run_dir, "ranks-1", theta0, task, Slot(processes=1)))
        two = scored(run_benchmark(cfg, run_dir, "ranks-2", theta0, task, Slot(processes=2)))
        assert "torch.distributed.run --standalone --nproc_per_node=2" in two["command"]
        assert one["score"] == two["score"] and one["identity"] == two["identity"]
        for part in PARTS if task == "toy_reasoning" else [task]:
            answers = [samples_of(benchmark_dir(run_dir, m) / task, part) for m in ("ranks-1", "ranks-2")]
            assert [(s["doc_id"], s["filtered_resps"]) for s in answers[0]] == sorted(
                (s["doc_id"], s["filtered_resps"]) for s in answers[1]
            )


def test_a_job_past_its_time_limit_is_named_with_its_log_and_the_others_keep_their_scores(jobs):
    cfg, run_dir, _ = jobs
    late = small_config(f"eval.benchmarks=[{', '.join(TASKS)}]", "eval.benchmark_timeout_s=1")
    folder = benchmark_dir(run_dir, "late")
    for task in TASKS[:2]:  # the first one scored in time, the second killed at 1 s
        settings = cfg if task == TASKS[0] else late
        run_benchmark(settings, run_dir, "late", str(run_dir / "init"), task)
    failed = folder / f"{TASKS[1]}.failed"  # beside the task's folder, which only a score replaces
    record = json.loads((failed / SCORE).read_text())
    assert record["error"] == "ran past eval.benchmark_timeout_s (1 s)" and "score" not in record
    assert (failed / "lmms_eval.log").is_file() and not (folder / TASKS[1]).exists()  # the attempt is kept, whole
    scores = read_scores(
        late.model_copy(update={"eval": late.eval.model_copy(update={"benchmarks": TASKS[:2]})}), run_dir, "late"
    )
    assert set(scores["tasks"]) == {TASKS[0]} and scores["failed"][TASKS[1]]["error"] == record["error"]
    assert scores["average"] is None  # an average over some of the tasks compares nothing
    assert run_benchmark(cfg, run_dir, "late", str(run_dir / "init"), TASKS[1])["score"]  # a re-run retries it


def test_a_failed_jobs_log_tail_leads_with_the_error_a_rank_raised(tmp_path):
    """torchrun reports a rank's exit after the rank's own traceback: the error is kept in front."""
    error = "[rank1]: AttributeError: 'ConstantAnswers' object has no attribute 'device'"
    report = [f"  rank      : 1 (local_rank: {i})" for i in range(20)]
    log = tmp_path / "lmms_eval.log"
    log.write_text("\n".join(["[rank1]: Traceback (most recent call last):", error, *report, "ChildFailedError: "]))
    assert log_tail(log) == [error, "…", *report[-14:], "ChildFailedError: "]
    log.write_text("\n".join(["loading", "ValueError: no such task"]))
    assert log_tail(log) == ["loading", "ValueError: no such task"]  # already in the tail


def test_the_constant_baseline_scores_each_toy_task_at_its_best_single_answer(jobs):
    cfg, run_dir, _ = jobs
    constants = json.loads((run_dir / TASKS_DIR / CONSTANTS).read_text())
    for task in ("toy_perception", "toy_reading"):
        record = run_benchmark(cfg, run_dir, CONSTANT, constant_answers(run_dir), task)
        assert "error" not in record and "--model merit_constant" in record["command"]
        answer = constants[task]["answer"]
        assert all(s["filtered_resps"] == answer for s in samples_of(benchmark_dir(run_dir, CONSTANT) / task, task))
        docs = [json.loads(line) for line in (run_dir / TASKS_DIR / f"{task}.jsonl").read_text().splitlines()]
        expected = sum(score_answer(d["scoring"], answer, d["answer"], d["options"]) for d in docs) / len(docs)
        assert record["score"]["value"] == pytest.approx(expected) == constants[task]["value"]  # prepare's figure


# --- preflight ---------------------------------------------------------------------------------


def dataset_snapshot(hf_home: Path, repo_id: str) -> None:
    """A dataset as ``huggingface_hub`` caches a download (its files do not matter here)."""
    snapshot = hf_home / "hub" / f"datasets--{repo_id.replace('/', '--')}" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("cached")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("ab" * 20)


def test_preflight_refuses_a_judged_task_without_a_judge_and_a_task_without_data(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    tasks = "eval.benchmarks=[ai2d, mmvet, toy_perception, no_such_task, mathvista_testmini, llava_wilder_small]"
    with pytest.raises(ValueError) as refused:
        check_benchmarks(small_config(tasks))
    message = str(refused.value)
    assert "['mmvet', 'mathvista_testmini'] are scored by a judge model: set eval.judge" in message
    assert "fetch it first: `hf download lmms-lab-encoder/ai2d --repo-type dataset`" in message
    assert "task 'mmvet': its data lmms-lab-encoder/MMVet is not in the Hugging Face cache" in message
    assert "task 'mathvista_testmini': its data AI4Math/MathVista is not" in message  # read through its tasks
    assert "lmms-eval has no task 'no_such_task'" in message and "toy_perception" not in message
    # A task whose code calls a judge whose failures are not counted: lmms-eval would score them as numbers.
    assert "task 'llava_wilder_small' is scored by a judge model its code calls, and only the failed" in message
    assert "task 'mmvet' is scored by a judge model its code" not in message

    with JudgeServer("good") as judge:
        settings = f"eval.judge={{base_url: '{judge.base_url}', model: {judge.model}, api_key_env: JUDGE_KEY}}"
        with pytest.raises(ValueError, match=r"need the judge's key in \$JUDGE_KEY"):
            check_benchmarks(small_config(tasks, settings))
        for repo in ("lmms-lab-encoder/ai2d", "lmms-lab-encoder/MMVet"):
            dataset_snapshot(tmp_path / "hf", repo)
        monkeypatch.setenv("JUDGE_KEY", "secret")
        cfg = small_config("eval.benchmarks=[ai2d, mmvet, toy_perception]", settings)
        answered = f"judge {judge.model} at {judge.base_url} answered '10 5 Scored by token overlap.'"
        assert check_benchmarks(cfg) == f"ai2d, mmvet, toy_perception; {answered}" and judge.calls == 1  # one request
        wrong = small_config("eval.benchmarks=[ai2d]", settings, "eval.benchmark_metrics={ai2d: anls}")
        with pytest.raises(ValueError, match=r"task 'ai2d': no headline metric among its metrics \['exact_match'\]"):
            check_benchmarks(wrong)


def test_preflight_leaves_the_judged_toy_task_out_of_a_run_without_a_judge_in_one_line():
    cfg = small_config("eval.benchmarks=[toy_perception, toy_chat]")
    assert (
        check_benchmarks(cfg)
        == "toy_perception (toy_chat left out: scored by a judge model, and eval.judge is not set)"
    )


# --- headline metrics, from results shaped as lmms-eval writes them ----------------------------


def test_the_paper_tasks_are_planned_with_their_named_headline_metrics():
    shipped = ["seedbench", "mmbench_en_dev", "ai2d", "textvqa_val", "mmmu_val", "mathvista_testmini_format"]
    plans = plan_tasks([*shipped, "llava_in_the_wild", "mmvet", "mathvista_testmini"], [], {})
    assert plans["seedbench"].headline == Headline("seed_image", 100.0)  # not seed_video, not seed_all
    assert plans["llava_in_the_wild"].headline == Headline("gpt_eval_llava_all")
    assert plans["mathvista_testmini"].headline is None
    assert plans["mathvista_testmini"].tasks == [f"mathvista_testmini_{v}" for v in ("cot", "solution", "format")]
    assert plans["mathvista_testmini"].datasets == ("AI4Math/MathVista",)
    assert plan_tasks(["seedbench"], [], {"seedbench": "seed_all"})["seedbench"].headline.metric == "seed_all"


LLAVA = TaskPlan("llava_in_the_wild", (), (), Headline("gpt_eval_llava_all"))


def test_a_headline_without_a_value_is_an_error_naming_the_task_never_another_metric():
    results = {"results": {"llava_in_the_wild": {"gpt_eval_llava_all,none": None, "gpt_eval_llava_conv,none": 61.0}}}
    with pytest.raises(
        ValueError, match=r"task 'llava_in_the_wild': its headline metric 'gpt_eval_llava_all,none' has no"
    ):
        score(LLAVA, results, {})
    with pytest.raises(ValueError, match=r"lmms-eval reported no 'gpt_eval_llava_all' for task 'llava_in_the_wild'"):
        score(LLAVA, {"results": {"llava_in_the_wild": {"gpt_eval_llava_conv,none": 61.0}}}, {})


def test_mathvistas_none_at_zero_is_zero_only_when_every_sample_is_wrong():
    plan = TaskPlan("mathvista_testmini_format", (), (), Headline("llm_as_judge_eval", none_is_zero=True))
    results = {"results": {plan.name: {"llm_as_judge_eval,none": None}}, "n-samples": {plan.name: {"effective": 2}}}
    wrong = [{"llm_as_judge_eval": {"true_false": False}}] * 2
    assert score(plan, results, {plan.name: wrong})["score"] == 0.0
    with pytest.raises(ValueError, match="has no value"):
        score(plan, results, {plan.name: [*wrong[:1], {"llm_as_judge_eval": {"true_false": True}}]})


def files_of(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): sha256_file(f) for f in sorted(folder.rglob("*")) if f.is_file()}


def test_a_failed_rerun_leaves_the_last_good_result_byte_for_byte_and_never_shows_it_as_current(jobs):
    cfg, run_dir, records = jobs
    theta0, folder = str(run_dir / "init"), benchmark_dir(run_dir, "theta0")
    before = files_of(folder / "toy_reading")
    changed = small_config(
        f"eval.benchmarks=[{', '.join(TASKS)}]",
        "eval.benchmark_tasks={toy_reading: {limit: 4}}",
        "eval.benchmark_timeout_s=1",
    )
    record = run_benchmark(changed, run_dir, "theta0", theta0, "toy_reading")
    assert record["error"] == "ran past eval.benchmark_timeout_s (1 s)" and record["identity"]["limit"] == 4
    assert files_of(folder / "toy_reading") == before  # the earlier score, results and samples, untouched
    assert json.loads((folder / "toy_reading.failed" / SCORE).read_text()) == record

    scores = read_scores(changed, run_dir, "theta0", theta0)
    assert "toy_reading" not in scores["tasks"] and scores["average"] is None
    assert scores["failed"]["toy_reading"]["error"] == record["error"]
    assert scores["stale"] == {"toy_reading": {"score": records["toy_reading"]["score"]["score"], "differs": ["limit"]}}
    said = [line for line in notes({"theta0": scores}) if "toy_reading" in line]
    assert said[0].startswith("theta0, `toy_reading`: no score: the re-run under this run's settings failed: ran past")
    assert said[1].startswith("theta0, `toy_reading`: an earlier score") and "with another limit than" in said[1]
    assert read_scores(cfg, run_dir, "theta0", theta0)["tasks"]["toy_reading"] == {
        **records["toy_reading"]["score"],
        "checkpoint_id": records["toy_reading"]["identity"]["checkpoint_id"],
    }  # under the settings it was scored with, it is current again


def test_a_killed_flow_leaves_no_process_of_its_benchmark_job(jobs):
    """The flow's process killed while a data-parallel job's ranks run (torchrun, each rank in a
    session of its own): none of them outlives it."""
    _, run_dir, _ = jobs
    script = (
        "from pipeline.config import load_config; from pipeline.eval.benchmarks import Slot, run_benchmark\n"
        "cfg = load_config(None, ['data.builtin.examples_per_source=12', 'eval.benchmarks=[toy_perception]',"
        " 'data.builtin.benchmark_examples=12', 'eval.benchmark_batch_size=1'])\n"
        f"run_benchmark(cfg, '{run_dir}', 'killed', '{run_dir / 'init'}', 'toy_perception', Slot(processes=2))\n"
    )
    flow = psutil.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, job = time.monotonic() + 120, []
    while time.monotonic() < deadline and len([p for p in job if "lmms_run" in " ".join(_cmdline(p))]) < 3:
        time.sleep(0.2)  # torchrun and its 2 ranks (lmms_run each) under the lifetime wrapper
        job = flow.children(recursive=True)
    assert len(job) >= 3, [_cmdline(p) for p in job]
    flow.kill()
    flow.wait()
    survivors = job
    while survivors and time.monotonic() < deadline:
        time.sleep(0.2)
        survivors = [p for p in survivors if _alive(p)]
    assert survivors == [], [_cmdline(p) for p in survivors]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill_tree_reaches_processes_in_sessions_of_their_own():
    """A process group kill reaches one level of torchrun's tree; kill_tree every level."""
    grandchild = "import subprocess, time; subprocess.Popen(['sleep', '60'], start_new_session=True); time.sleep(60)"
    parent = psutil.Popen([sys.executable, "-c", grandchild], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(parent.children(recursive=True)) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    (sleeper,) = parent.children(recursive=True)
    assert os.getsid(sleeper.pid) != os.getsid(parent.pid)
    kill_tree(parent.pid)
    parent.wait(10)
    sleeper.wait(10)
    assert not _alive(sleeper)


def test_each_task_has_its_own_limit_seed_and_generation_caps_and_sampling_tasks_answer_greedily():
    plan = TaskPlan("mathvista_like", (), (), None, max_new_tokens=16384, sampled=True)
    short = TaskPlan("short", (), (), None, max_new_tokens=16)
    cfg = small_config("eval.benchmarks=[mathvista_like, short]", "eval.benchmark_limit=50", "run.seed=3")
    assert job_settings(cfg, plan) == JobSettings(50, 3, {"temperature": 0, "max_new_tokens": 2048})
    assert job_settings(cfg, short) == JobSettings(50, 3, {})  # its own cap is lower: kept
    own = "eval.benchmark_tasks={mathvista_like: {limit: 200, max_new_tokens: 1024, seed: 7, gen_kwargs: {top_p: 0.9}}}"
    tuned = small_config("eval.benchmarks=[mathvista_like, short]", own, "eval.benchmark_greedy=false")
    assert job_settings(tuned, plan) == JobSettings(200, 7, {"max_new_tokens": 1024, "top_p": 0.9})
    argv = lmms_arguments(tuned, "qwen2_5_vl", {}, plan, "cpu", Path("out"), Slot(processes=2))
    assert argv[argv.index("--limit") + 1] == "200" and argv[argv.index("--seed") + 1] == "7"
    assert argv[argv.index("--gen_kwargs") + 1] == "max_new_tokens=1024,top_p=0.9"
    assert argv[argv.index("--process_group_timeout_s") + 1] == str(6 * 3600)  # the job's own limit, not 10 min
    with pytest.raises(ValueError, match=r"eval.benchmark_tasks names \['mmvet'\], which eval.benchmarks does not run"):
        small_config("eval.benchmarks=[short]", "eval.benchmark_tasks={mmvet: {limit: 1}}")


def test_qwen3_vl_models_get_a_tasks_qwen3_vl_prompts(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": "Q?", "answer": "A"}) + "\n")
    (tmp_path / "prompted.yaml").write_text(
        f"task: prompted\ndataset_path: json\ndataset_kwargs: {{data_files: {tmp_path / 'data.jsonl'}}}\n"
        "test_split: train\noutput_type: generate_until\ndoc_to_text: question\ndoc_to_target: answer\n"
        "metric_list: [{metric: exact_match}]\n"
        "lmms_eval_specific_kwargs: {default: {pre_prompt: 'plain '}, qwen3_vl: {pre_prompt: 'qwen3 '}}\n"
    )
    from lmms_eval.evaluator import get_task_dict

    for model, prompt in [("merit_qwen3_vl", "qwen3 "), ("merit_qwen2_5_vl", "plain "), ("qwen2_5_vl", "plain ")]:
        manager = task_manager(
            parse(["--model", model, "--tasks", "prompted", f"--include_path={tmp_path}", "--output_path", "x"])
        )
        (task,) = get_task_dict(["prompted"], manager).values()
        assert task.lmms_eval_specific_kwargs["pre_prompt"] == prompt, model


def test_a_metrics_scale_is_read_from_its_own_aggregation_of_single_answers(tmp_path):
    (tmp_path / "utils.py").write_text("def percent(items):\n    return 100 * sum(items) / len(items)\n")
    (tmp_path / "scaled.yaml").write_text(
        "task: scaled\ndataset_path: json\noutput_type: generate_until\ndoc_to_text: question\n"
        "metric_list:\n  - {metric: right, aggregation: mean}\n"
        "  - {metric: percent, aggregation: !function utils.percent}\n"
    )
    samples = [{"right": 0.0, "percent": 0.0}, {"right": 1.0, "percent": 1.0}]
    assert detected_scale(str(tmp_path / "scaled.yaml"), "right", samples) == 100.0  # a fraction: ×100
    assert detected_scale(str(tmp_path / "scaled.yaml"), "percent", samples) == 1.0  # already in percent
    assert detected_scale(str(tmp_path / "scaled.yaml"), "percent", samples[:1]) == 100.0  # all 0: 0 either way
