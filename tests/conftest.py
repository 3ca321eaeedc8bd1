"""Shared fixtures: a tiny offline Qwen2.5-VL on disk and helpers that write small data files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prefect keeps a database and result caches under PREFECT_HOME: a private one per test session,
# so nothing leaks between sessions, and no analytics calls leave the machine.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="merit-prefect-home-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

from pipeline.config import RunConfig, load_config
from pipeline.models import init_model, load_processor

GOLDEN = Path(__file__).parent / "golden"


# `make test` runs the modules on 2 workers (pytest-xdist, a module per worker at a time): the
# longest start first, so that neither worker is left with one of them while the other is idle.
LONGEST_FIRST = ["test_prefect_server", "test_families_flow", "test_diloco", "test_flow", "test_shipped_3b"]
LONGEST_FIRST += ["test_lora", "test_bench_quality", "test_train", "test_shipped_7b_lora", "test_shipped_30b_a3b_lora"]
LONGEST_FIRST += ["test_muon", "test_diagnostics"]
LONGEST_FIRST += ["test_diloco_lora", "test_bench_tools", "test_benchmarks", "test_paper_benchmarks"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/*.json from this run")


@pytest.fixture
def golden(request):
    """``golden(name, values)``: the values a refactor must reproduce (torchtitan's golden loss
    files). Compared to ``tests/golden/<name>.json``; ``pytest --update-golden`` rewrites it, for a
    change meant to alter the numbers (say which, and why, in the commit)."""

    def check(name: str, values: list[float], rtol: float = 1e-4) -> None:
        path = GOLDEN / f"{name}.json"
        if request.config.getoption("--update-golden"):
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(values, indent=1) + "\n")
        expected = json.loads(path.read_text())
        assert values == pytest.approx(expected, rel=rtol), f"{name} differs from {path}"

    return check


def small_config(*overrides: str) -> RunConfig:
    # Everything trains, as in configs/demo.yaml: the tiny θ0's vision tower is random.
    everything = ["model.freeze.freeze_vision_tower=false", "model.freeze.freeze_multi_modal_projector=false"]
    # One prepare process: a test's few sources take less than starting a worker would.
    serial = ["data.prepare_processes=1"]
    return load_config(None, ["data.builtin.examples_per_source=12", *everything, *serial, *overrides])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> tuple[RunConfig, Path]:
    """A run directory holding θ0 (the tiny model) built once per test session."""
    cfg = small_config()
    run_dir = tmp_path_factory.mktemp("run")
    init_model(cfg, run_dir)
    return cfg, run_dir


@pytest.fixture(scope="session")
def prefect_api():
    """One temporary Prefect API (SQLite in a temp dir) for every flow test of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def processor(tiny_run):
    cfg, run_dir = tiny_run
    return load_processor(run_dir / "init", cfg.model)


def hub_snapshot(hf_home: Path, repo_id: str, files: Path, revision: str = "0123456789abcdef" * 2 + "01234567") -> Path:
    """Files laid out as ``huggingface_hub`` caches a downloaded model (no manifest of ours):
    ``hub/models--ORG--NAME/snapshots/<revision>/`` and ``refs/main`` naming the revision."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in files.iterdir():
        if file.is_file() and not file.name.startswith(".") and file.name != "manifest.json":
            shutil.copy2(file, snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


SHIPPED_TASKS = ["colour_name", "colour_complement", "count_digits", "count_words"]


def run_shipped_lora(config: Path, root: Path, snapshot: Path, *sizes: str) -> tuple[Path, list[str]]:
    """A shipped LoRA config's merit flow with only sizes, paths and the device overridden: its θ0 the hub
    snapshot under ``root/hf``, Vision-FLAN of the built-in tasks as its data, K = 2, no benchmarks (their
    data is tests/test_shipped_3b.py's); ``sizes`` the config's own. Returns the run directory and the
    overrides."""
    from flows.merit import merit

    annotation, images = vision_flan_corpus(root / "vision-flan", SHIPPED_TASKS, per_task=12)
    settings = [
        f"data.sources.0.path={annotation}",  # paths
        f"data.sources.0.images_dir={images}",
        "train.deepspeed=zero2",
        "model.min_pixels=3136",  # sizes
        "calibration.n_per_source=4",
        "calibration.batch_size=2",
        "calibration.r=1",  # K = 2
        "train.grad_accum=2",
        "train.loader_workers=1",
        "eval.batch_size=4",
        "eval.max_examples_per_source=2",
        "eval.benchmarks=[]",
        "flow.retry_delay_s=0",
        *sizes,
        "merge.device=cpu",  # the device
    ]
    run_dir = root / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(root / "hf"))
        env.setenv("HF_HUB_OFFLINE", "1")
        state = merit(config=str(config), overrides=settings, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return run_dir, settings


def vision_flan_corpus(folder: Path, tasks: list[str], per_task: int, image_size: int = 56) -> tuple[Path, Path]:
    """Built-in image tasks written in Vision-FLAN's layout: one annotation JSON (``id``,
    ``task_name``, ``image`` under the images folder, ``conversations``) and the images as files."""
    from pipeline.config import BuiltinSection
    from pipeline.data import builtin

    images, records = folder / "images_191task_1k", []
    images.mkdir(parents=True)
    generated = builtin.generate(tasks, BuiltinSection(examples_per_source=per_task, image_size=image_size), 0)
    for task, examples in generated.items():
        for example in examples:
            name = f"{task}_{example.index}.png"
            example.load_images()[0].save(images / name)
            question = next(c["text"] for c in example.messages[0]["content"] if c["type"] == "text")
            conversation = [
                {"from": "human", "value": f"<image>\n{question}"},
                {"from": "gpt", "value": example.answer()},
            ]
            records.append(
                {"id": f"{task}-{example.index}", "task_name": task, "image": name, "conversations": conversation}
            )
    return write_json(folder / "annotation_191-task_1k.json", records), images


def write_image(path: Path, colour=(255, 0, 0), size=(64, 48)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def llava_record(image: str | None = "a.png", answer: str = "red") -> dict:
    prompt = "<image>\nWhat colour is it?" if image else "What is 1 + 1?"
    record = {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]}
    if image:
        record["image"] = image
    return record


BRANCH_SOURCES = ["colour_name", "add_digits", "caption"]


def prepared_run(run: Path) -> Path:
    """The demo at branch-test size, initialised and prepared by the CLI: θ0 and data for branches."""
    from merit.cli import main as merit

    demo = Path(__file__).parent.parent / "configs" / "demo.yaml"
    small = ["--set", "data.builtin.examples_per_source=24", "--set", "warmup.steps=0"]
    assert merit(["init", str(demo), "--run-dir", str(run), *small]) == 0
    assert merit(["prepare", "--run-dir", str(run)]) == 0
    return run


def golden_run(run: Path) -> Path:
    """A run on the inputs frozen in tests/golden (``freeze.py``): θ0 a folder, read as a downloaded
    model is, and one LLaVA-format source, ``golden``; no change to the built-in corpus or to the
    tiny model's builder moves what trains on it (the golden loss curve)."""
    from merit.cli import main as merit

    demo = Path(__file__).parent.parent / "configs" / "demo.yaml"
    source = f"{{name: golden, format: llava, path: {GOLDEN / 'data' / 'golden.json'}}}"
    settings = [f"model.name_or_path={GOLDEN / 'theta0'}", f"data.sources=[{source}]", "warmup.steps=0"]
    settings += ["warmup.sources=[]", "eval.sources=[]", "eval.benchmarks=[]"]
    assert merit(["init", str(demo), "--run-dir", str(run), *[a for s in settings for a in ("--set", s)]]) == 0
    assert merit(["prepare", "--run-dir", str(run)]) == 0
    return run


def branch_spec(run_dir: Path, out: Path, *overrides: str, sources: list[str] = BRANCH_SOURCES):
    """A 12-step ZeRO-2 branch from the run's θ0 on ``sources`` (checkpoints every 4 steps)."""
    from pipeline.layout import init_path
    from pipeline.train import BranchSpec

    settings = ["train.steps=12", "train.micro_batch=4", "train.max_tokens=256", "train.checkpoint_every=4"]
    settings.append("train.deepspeed=zero2")
    cfg = load_config(run_dir / "config.yaml", [*settings, *overrides])
    return BranchSpec(
        name=out.name, run_dir=str(run_dir), init=init_path(cfg, run_dir), sources=sources, out_dir=str(out), config=cfg
    )


def sigkill_after_checkpoint(spec_path: Path, processes: int, step: int) -> None:
    """Launch a branch's ranks as the trainer does and SIGKILL the launcher's process group once a
    whole checkpoint of ``step`` or later exists; returns when every rank has died with it."""
    import time

    from pipeline.train.launch import command

    argv, env = command(spec_path, processes)
    root = Path(__file__).parent.parent
    proc = subprocess.Popen(
        argv,
        cwd=root,
        env=os.environ | env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latest, deadline = spec_path.parent / "checkpoints" / "latest.json", time.monotonic() + 300
    while not (latest.is_file() and json.loads(latest.read_text())["step"] >= step):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group; torchrun put the ranks in sessions of their own
    proc.wait()
    deadline = time.monotonic() + 30
    while processes_of(spec_path):  # the ranks die with their launcher (PR_SET_PDEATHSIG)
        assert time.monotonic() < deadline, "a rank outlived its killed launcher"
        time.sleep(0.1)


def processes_of(spec_path: Path) -> list[int]:
    """Pids of a branch's processes: its torchrun launcher and every rank (their command lines
    name the branch's spec file)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if str(spec_path) in args:
            pids.append(int(pid))
    return pids


def stop_process_group(proc: subprocess.Popen) -> None:
    """A process started with ``start_new_session`` and all it started: TERM, then KILL if it lingers
    (a Prefect worker told to stop was seen to keep taking flow runs for over a minute on a busy
    server; left alive it would run the next test's runs)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def restyled_copy(source: str | Path, dst: Path, experts: str | None = None, shards: int = 1) -> Path:
    """A copy of checkpoint ``source`` in another layout, as another tool would have written the same weights:
    its experts stored as ``experts`` says ("fused", "fused_in_out", "per_expert"; default: as its family's
    hub stores them), its tensors cut into ``shards`` files with an index; its carried tensors (``mtp.*``)
    and aux files as they are, no manifest (a hub snapshot's folder)."""
    from pipeline.merge.io import copy_aux_files, stream_checkpoint
    from pipeline.merge.layout import ModelView, assemble, layout_of, restyled

    view = ModelView.open(source)
    stored = restyled(view.loaded(), view.config(), experts).stored
    stored |= {name: view.files.info[name] for name in view.layout.carried}
    layout = layout_of(stored, view.config())

    def produce(name: str):
        pieces = layout.in_stored(name)
        return assemble(pieces, stored[name], lambda p: view.get(p.key)) if pieces else view.files.get(name)

    dst.mkdir(parents=True)
    stream_checkpoint(dst, stored, produce, sum(i.nbytes for i in stored.values()) // shards + 1)
    copy_aux_files(view.aux_files(), dst)
    return dst
