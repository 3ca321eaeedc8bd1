"""``merit tune-merge``: Optuna over a merge's branch weights (and a method's parameters), each trial
a merge of the run's branches scored on the trained sources' held-out examples; resumable."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pytest
import torch
from conftest import prepared_run
from safetensors.torch import load_file

from merit.cli import main as merit
from pipeline.checkpoint import save_pretrained_checkpoint, verify_checkpoint
from pipeline.config import ConfigError, load_config
from pipeline.data import active_sources, load_split, read_manifest
from pipeline.eval import evaluate_model
from pipeline.layout import (
    SEARCH_PLOT,
    SEARCH_RESULT,
    branch_dir,
    run_config,
    run_models,
    search_dir,
    start_run,
    tuned_dir,
)
from pipeline.merge_search import STUDY, Search
from pipeline.merging import merge_run
from pipeline.models import load_model, load_processor


@pytest.fixture(scope="module")
def branches(tmp_path_factory):
    """The demo prepared at test size, its trained sources split in two groups, and two branches:
    θ0 moved by noise of different sizes (so their weights change the dev loss)."""
    run = prepared_run(tmp_path_factory.mktemp("search") / "run")
    cfg, _ = run_config(None, [], run)
    trained = sorted(s for s, info in active_sources(read_manifest(run)).items() if info["role"] == "finetune")
    groups = [trained[: len(trained) // 2], trained[len(trained) // 2 :]]
    (run / "calibration").mkdir(exist_ok=True)
    (run / "calibration" / "split.json").write_text(json.dumps({"groups": groups}))
    for k, size in enumerate((0.02, 0.2)):
        model = load_model(run / "init", cfg.model)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(size * torch.randn(p.shape, generator=g))
        processor = load_processor(run / "init", cfg.model)
        save_pretrained_checkpoint(
            branch_dir(run, k) / "final",
            model,
            processor,
            step=1,
            tokens_seen=1,
            parent=str(run / "init"),
            sources=groups[k],
        )
    return run


def search_args(run, *settings):
    """A search on held-out loss needs merge.search.enabled (the report then leaves its dev split out)."""
    settings = ("merge.search.enabled=true", *settings)
    return ["tune-merge", "--run-dir", str(run), *[a for s in settings for a in ("--set", s)]]


def test_the_search_starts_at_the_given_weights_keeps_the_best_and_resumes(branches, capsys):
    run = branches
    settings = ["merge.search.trials=4", "merge.search.max_examples_per_source=1"]
    assert merit(search_args(run, *settings)) == 0
    assert "dev: held-out loss" in capsys.readouterr().out
    folder = search_dir(run, "token_average")
    result = json.loads((folder / SEARCH_RESULT).read_text())
    groups = json.loads((run / "calibration" / "split.json").read_text())["groups"]
    tokens = [sum(active_sources(read_manifest(run))[s]["train_tokens"] for s in group) for group in groups]
    assert result["given"]["trial"] == 0 and len(result["trials"]) == 4
    assert result["given"]["weights"] == pytest.approx([t / sum(tokens) for t in tokens])  # MERIT's n_k
    assert result["metric"] == "held-out loss" and result["lower_is_better"]
    assert result["best"]["value"] == min(t["value"] for t in result["trials"]) <= result["given"]["value"]
    assert (folder / SEARCH_PLOT).stat().st_size > 0 and not list(folder.glob("trial-*"))
    # The chosen merge is the weighted average of the branches with the chosen weights.
    verify_checkpoint(folder / "best")
    w = result["best"]["weights"]
    finals = [load_file(branch_dir(run, k) / "final" / "model.safetensors") for k in range(2)]
    name = next(n for n in finals[0] if n.endswith("layers.0.mlp.up_proj.weight"))
    best = load_file(folder / "best" / "model.safetensors")[name]
    assert torch.allclose(best, w[0] * finals[0][name] + w[1] * finals[1][name], atol=1e-6)
    # Resumed: a finished search adds nothing; a larger budget adds only the missing trials.
    study = optuna.load_study(study_name="token_average", storage=f"sqlite:///{folder / STUDY}")
    first = [t.params for t in study.trials]
    assert merit(search_args(run, *settings)) == 0
    assert len(optuna.load_study(study_name="token_average", storage=f"sqlite:///{folder / STUDY}").trials) == 4
    assert merit(search_args(run, "merge.search.trials=6", "merge.search.max_examples_per_source=1")) == 0
    study = optuna.load_study(study_name="token_average", storage=f"sqlite:///{folder / STUDY}")
    assert len(study.trials) == 6 and [t.params for t in study.trials[:4]] == first
    points = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(set(points)) == 6  # the resumed sampler proposes new points, not its first ones again


def test_a_method_parameter_is_searched_within_its_range(branches):
    run = branches
    settings = [
        "merge.methods=[{name: ties, method: ties, params: {density: 0.5}}]",
        "merge.search.merge=ties",
        "merge.search.params={density: [0.2, 0.8]}",
        "merge.search.trials=3",
        "merge.search.max_examples_per_source=1",
        "merge.search.sampler=cmaes",
    ]
    assert merit(search_args(run, *settings)) == 0
    result = json.loads((search_dir(run, "ties") / SEARCH_RESULT).read_text())
    assert result["trials"][0]["params"] == {"density": 0.5}  # the configured value first
    assert all(0.2 <= t["params"]["density"] <= 0.8 for t in result["trials"])
    # The study is tied to its space: other ranges are refused, not mixed with its trials.
    cfg, _ = run_config(None, [*settings[:3], "merge.search.params={density: [0.3, 0.8]}"], run)
    with pytest.raises(ValueError, match=r"this study searched another space \(ranges"):
        Search(cfg, run)


def test_an_integer_parameter_is_searched_over_integers_from_the_merge_as_given(branches):
    run = branches
    settings = [
        "merge.methods=[{name: karcher, method: karcher, params: {max_iter: 3}}]",
        "merge.search.merge=karcher",
        "merge.search.params={max_iter: [1, 6]}",
        "merge.search.trials=3",
        "merge.search.max_examples_per_source=1",
    ]
    assert merit(search_args(run, *settings)) == 0
    trials = json.loads((search_dir(run, "karcher") / SEARCH_RESULT).read_text())["trials"]
    assert trials[0]["params"] == {"max_iter": 3}
    assert all(isinstance(t["params"]["max_iter"], int) and 1 <= t["params"]["max_iter"] <= 6 for t in trials)


def test_weights_per_layer_group_merge_each_group_with_its_own(branches):
    """layer_groups: 2 searches two weights per branch; the chosen merge averages the first half of
    the decoder layers with the first group's weights and the second half with the second's."""
    run = branches
    entry = ["merge.methods=[{name: grouped, method: weighted_average}]", "merge.search.merge=grouped"]
    entry += ["merge.search.params={}"]
    settings = [*entry, "merge.search.trials=3", "merge.search.max_examples_per_source=1"]
    try:
        assert merit(search_args(run, *settings, "merge.search.layer_groups=2")) == 0
    finally:  # the run's saved config back to one group: the module's other searches share the run
        start_run(None, ["merge.search.layer_groups=1"], run)
    result = json.loads((search_dir(run, "grouped") / SEARCH_RESULT).read_text())
    groups = result["best"]["layer_weights"]
    assert len(groups) == 2 and all(sum(g) == pytest.approx(1) for g in groups)
    best = load_file(search_dir(run, "grouped") / "best" / "model.safetensors")
    finals = [load_file(branch_dir(run, k) / "final" / "model.safetensors") for k in range(2)]
    layers = 1 + max(int(n.split("layers.")[1].split(".")[0]) for n in best if ".layers." in n and "visual" not in n)
    for layer in (0, layers - 1):
        name = next(n for n in best if n.endswith(f"layers.{layer}.mlp.up_proj.weight") and "visual" not in n)
        w = groups[layer * 2 // layers]
        assert torch.allclose(best[name], w[0] * finals[0][name] + w[1] * finals[1][name], atol=1e-6)
    cfg, _ = run_config(None, [*entry, "merge.search.enabled=true", "merge.search.layer_groups=1"], run)
    with pytest.raises(ValueError, match=r"another space \(layer_groups"):
        Search(cfg, run)
    cfg, _ = run_config(None, [*entry, "merge.search.enabled=true", f"merge.search.layer_groups={layers + 1}"], run)
    with pytest.raises(ValueError, match=f"{layers + 1} groups of {layers} decoder layers"):
        Search(cfg, run)


def test_a_fisher_merge_is_searched_with_its_branches_fisher(branches):
    run = branches
    settings = ["merge.methods=[{name: fish, method: fisher}]", "merge.search.merge=fish", "merge.search.params={}"]
    settings += ["merge.search.trials=2", "merge.search.max_examples_per_source=1", "merge.fisher_examples=2"]
    assert merit(search_args(run, *settings)) == 0
    assert len(json.loads((search_dir(run, "fish") / SEARCH_RESULT).read_text())["trials"]) == 2
    assert all((branch_dir(run, k) / "fisher").is_dir() for k in range(2))


@pytest.mark.parametrize(
    "setting, message",
    [
        ("merge.search.merge=nope", "no merge named 'nope'"),
        ("merge.search.params={nope: [0, 1]}", "has no parameters"),
        ("merge.search.params={scale: [2, 1]}", "low < high"),
        (
            ["merge.methods=[{name: t, method: ties, params: {density: 0.5}}]", "merge.search.merge=t"],
            r"merge 't' has density = 0.5, outside \[0.6, 0.8\]",
        ),
        (
            ["merge.methods=[{name: s, method: slerp}]", "merge.search.merge=s"],
            r"merge 's' gives t = None; a search varies one number from the merge's own: set its params.t",
        ),
    ],
)
def test_a_search_that_cannot_run_is_refused_with_the_config(setting, message):
    if isinstance(setting, list):  # a merge whose own value cannot be trial 0 of the ranges searched
        name = setting[0].split("method: ")[1].split("}")[0].split(",")[0]
        ranges = {"ties": "{density: [0.6, 0.8]}", "slerp": "{t: [0.2, 0.8]}"}[name]
        setting = [*setting, f"merge.search.params={ranges}"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, setting if isinstance(setting, list) else [setting])


def test_a_search_killed_mid_trial_resumes_and_fails_that_trial(branches, tmp_path):
    """Failure injection: SIGKILL the command while a trial's merge is on disk; the rerun marks the
    interrupted trial failed, runs the missing trials and leaves no trial checkpoint behind."""
    run = branches
    settings = [
        "merge.methods=[{name: avg2, method: weighted_average}]",
        "merge.search.merge=avg2",
        "merge.search.params={}",
    ]
    settings += ["merge.search.trials=3", "merge.search.max_examples_per_source=1"]
    folder = search_dir(run, "avg2")
    command = [sys.executable, "-m", "merit", *search_args(run, *settings)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (folder / STUDY).is_file() or not completed(folder) or not list(folder.glob("trial-*")):
            assert proc.poll() is None and time.monotonic() < deadline, "the search ended before a second trial"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    # What a kill during a trial's merge or its dev tasks leaves: a staging folder, a job folder.
    (folder / ".trial-9.tmp-0badf00d").mkdir()
    (run / "eval" / "benchmarks" / "search-avg2-trial-9").mkdir(parents=True)
    assert merit(search_args(run, *settings)) == 0
    study = optuna.load_study(study_name="avg2", storage=f"sqlite:///{folder / STUDY}")
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") == 3 and states.count("FAIL") == 1 and "RUNNING" not in states
    assert not list(folder.glob("trial-*")) and not list(folder.glob(".trial-*")) and verify_checkpoint(folder / "best")
    assert not list((run / "eval" / "benchmarks").glob("search-avg2-trial-*"))


def completed(folder) -> int:
    """Trials complete so far, read without touching the schema the command is creating."""
    try:
        with sqlite3.connect(f"file:{folder / STUDY}?mode=ro", uri=True) as db:
            return db.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    except sqlite3.OperationalError:  # no such table yet
        return 0


def test_the_chosen_merge_is_a_model_of_the_run_and_the_report_shows_the_search(branches):
    run = branches
    settings = ["merge.methods=[{name: token_average, method: weighted_average}]", "merge.search.merge=token_average"]
    settings += ["merge.search.params={}", "merge.search.enabled=true", "merge.search.trials=2"]
    assert merit(search_args(run, *settings, "merge.search.max_examples_per_source=1")) == 0
    cfg, _ = run_config(None, [], run)
    merge_run(cfg, run, "token_average")
    models = run_models(cfg, run)
    assert models["merged-token_average-tuned"] == str(tuned_dir(run, "token_average"))
    for name in ("merged-token_average", "merged-token_average-tuned"):
        evaluate_model(cfg, run, name, models[name])
    assert merit(["report", "--run-dir", str(run)]) == 0
    report = json.loads((run / "report" / "report.json").read_text())
    rows = {row["model"]: row for row in report["quality"]["rows"]}
    assert rows["token_average: weighted_average, weights searched"]["split"] == "MERIT-2"
    assert report["search"]["given"]["trial"] == 0 and report["search"]["trials"] >= 2
    # Never the best merged model by its own objective: named beside the headline, not as it.
    tuned = "merged-token_average-tuned"
    assert report["headline"]["model"] == "merged-token_average" and report["headline"]["searched"]["model"] == tuned
    assert f"{tuned} (" in (run / "report" / "report.md").read_text()
    assert f"../search/token_average/{SEARCH_PLOT}" in report["plots"]
    assert "## Merge weight search" in (run / "report" / "report.md").read_text()


def test_the_dev_split_is_held_out_examples_the_report_never_scores(branches):
    from pipeline.eval.heldout import Heldout, refuse_short_dev_share, source_roles
    from pipeline.merge_search import dev_split

    run = branches
    cfg, _ = run_config(None, ["merge.search.enabled=true", "merge.search.max_examples_per_source=1"], run)
    roles = source_roles(run)
    report, dev = Heldout.load(cfg, run, roles), dev_split(cfg, run)
    trained = sorted(s for s, role in roles.items() if role == "trained")
    assert sorted(dev.examples) == trained and all(len(items) == 1 for items in dev.examples.values())
    for source in trained:
        whole = load_split(cfg, run, "heldout", [source])[source]  # the report's part, then the dev split
        assert [ex.index for ex in report.examples[source] + dev.examples[source]] == [ex.index for ex in whole]
    off = cfg.merge.search.model_copy(update={"enabled": False})
    plain = cfg.model_copy(update={"merge": cfg.merge.model_copy(update={"search": off})})  # the whole split
    assert len(Heldout.load(plain, run, roles)) == len(report) + len(dev)
    short, _ = run_config(None, ["merge.search.enabled=true", "merge.search.max_examples_per_source=2"], run)
    for refused in (lambda: Heldout.load(short, run, roles), lambda: refuse_short_dev_share(short, run)):
        with pytest.raises(ValueError, match=r"merge.search.max_examples_per_source = 2 of each are its dev split"):
            refused()
    with pytest.raises(ValueError, match="merge.search on held-out loss needs merge.search.enabled: true"):
        dev_split(plain, run)


def test_preflight_refuses_a_search_without_held_out_examples(tmp_path):
    from pipeline.preflight import PreflightError, check_run

    cfg = load_config(None, ["merge.search.enabled=true", "data.heldout_fraction=0"])
    with pytest.raises(PreflightError, match="merges: merge.search scores its trials on the trained sources' held-out"):
        check_run(cfg, tmp_path)


def test_lmms_eval_dev_tasks_apart_from_the_benchmarks(branches):
    """Trials scored by lmms-eval on a dev task (its mean score, maximised), never a benchmark of the
    report: the config refuses a shared task, merit check a shared subtask of a group."""
    run = branches
    settings = ["eval.benchmarks=[toy_perception]", "merge.methods=[{name: avg3, method: weighted_average}]"]
    settings += ["merge.search.merge=avg3", "merge.search.params={}", "merge.search.tasks=[toy_reading]"]
    settings += ["merge.search.limit=4", "merge.search.trials=2"]
    assert merit(search_args(run, *settings)) == 0
    result = json.loads((search_dir(run, "avg3") / SEARCH_RESULT).read_text())
    assert result["metric"] == "mean score of toy_reading" and not result["lower_is_better"]
    assert result["dev"] == "toy_reading, 4 examples each"
    assert result["best"]["value"] == max(t["value"] for t in result["trials"]) >= result["given"]["value"]
    assert not list((run / "eval" / "benchmarks").glob("search-avg3-trial-*"))  # each trial's jobs, once scored
    held_out_study = [
        "merge.methods=[{name: token_average, method: weighted_average}]",
        "merge.search.merge=token_average",
    ]
    cfg, _ = run_config(None, [*settings[:2], *held_out_study, "merge.search.tasks=[toy_reading]"], run)
    with pytest.raises(ValueError, match="was minimized; merge.search now maximizes"):
        Search(cfg, run)
    with pytest.raises(ConfigError, match=r"merge.search.tasks \['toy_perception'\] are also eval.benchmarks"):
        load_config(None, ["merge.search.tasks=[toy_perception]", "eval.benchmarks=[toy_perception]"])
    from pipeline.preflight import PreflightError, check_run

    group = ["eval.benchmarks=[toy_reasoning]", "merge.search.tasks=[toy_reasoning_steps]", "merge.search.enabled=true"]
    with pytest.raises(PreflightError, match=r"share the tasks \['toy_reasoning_steps'\]"):
        check_run(load_config(None, group), run)


def test_the_flow_shares_the_trials_out_among_parallel_workers(branches, prefect_api):
    """merge.search.parallel: Prefect tasks on one study, each worker with its own sampler seed;
    together they run exactly the trials asked, the given weights among them."""
    from prefect import flow

    from flows.merit import tune_merge

    run = branches
    settings = ["merge.methods=[{name: par, method: weighted_average}]", "merge.search.merge=par"]
    settings += ["merge.search.params={}", "merge.search.tasks=[]", "eval.benchmarks=[]", "merge.search.parallel=2"]
    settings += ["merge.search.trials=5", "merge.search.max_examples_per_source=1", "merge.search.enabled=true"]
    cfg, _ = start_run(None, settings, run)  # saved: the tasks read the run's config

    @flow
    def search() -> dict:
        return tune_merge(cfg, str(run))

    result = search()
    study = optuna.load_study(study_name="par", storage=f"sqlite:///{search_dir(run, 'par') / STUDY}")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 5
    assert sum(bool(t.user_attrs.get("given")) for t in study.trials) == 1
    assert result["best"]["value"] <= result["given"]["value"]
    assert not list(search_dir(run, "par").glob("trial-*")) and verify_checkpoint(tuned_dir(run, "par"))
