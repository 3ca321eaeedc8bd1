"""θ0 named by a hub id or a plain folder, and the checks a flow runs before anything trains."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import hub_snapshot

from merit.cli import main as merit
from pipeline.checkpoint import checkpoint_id
from pipeline.config import ConfigError, load_config
from pipeline.hub import ModelNotFoundError, resolve_model
from pipeline.layout import base_path, start_run
from pipeline.preflight import PreflightError, check_run

ROOT = Path(__file__).parent.parent
REPO = "Qwen/Qwen2.5-VL-3B-Instruct"


@pytest.fixture
def hf_home(tiny_run, tmp_path, monkeypatch):
    """A Hugging Face cache holding the tiny model as a downloaded snapshot of REPO, offline."""
    _, run_dir = tiny_run
    home = tmp_path / "hf"
    snapshot = hub_snapshot(home, REPO, run_dir / "init")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home, snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot_with_a_machine_independent_identity(hf_home):
    _, snapshot = hf_home
    assert resolve_model(REPO) == snapshot
    assert resolve_model(REPO, revision=snapshot.name) == snapshot == resolve_model(REPO, revision="main")
    with pytest.raises(ModelNotFoundError, match=f"model {REPO}: revision v2 of it is not in the Hugging Face cache"):
        resolve_model(REPO, revision="v2")
    assert checkpoint_id(snapshot) == f"{REPO}@{snapshot.name}"  # the same on every machine's cache
    cfg = load_config(ROOT / "configs" / "qwen2_5_vl_3b.yaml")
    assert base_path(cfg, "unused") == str(snapshot)
    pinned, _ = start_run(ROOT / "configs" / "qwen2_5_vl_3b.yaml", [], hf_home[0] / "run")
    assert pinned.model.revision == snapshot.name  # the run reads this commit, wherever main moves
    with pytest.raises(
        ModelNotFoundError, match=r"Qwen/Qwen2.5-VL-7B-Instruct: .*not in the Hugging Face cache.*hf download"
    ):
        resolve_model("Qwen/Qwen2.5-VL-7B-Instruct")
    with pytest.raises(ModelNotFoundError, match="no such folder, and not a Hugging Face id"):
        resolve_model("/no/such/model")


def test_a_plain_folder_without_manifest_is_a_model_and_pickles_are_not(tiny_run, tmp_path):
    _, run_dir = tiny_run
    plain = tmp_path / "downloaded"
    shutil.copytree(run_dir / "init", plain, ignore=shutil.ignore_patterns("manifest.json", ".*"))
    assert resolve_model(str(plain)) == plain.resolve() and checkpoint_id(plain) == str(plain)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (plain / "model.safetensors.index.json").write_text(json.dumps(index))  # a download cut short
    with pytest.raises(ModelNotFoundError, match=r"shards \['model-00001-of-00002.safetensors', 'model-00002"):
        resolve_model(str(plain))
    (plain / "model.safetensors.index.json").unlink()
    (plain / "model.safetensors").rename(plain / "pytorch_model.bin")
    with pytest.raises(ModelNotFoundError, match="no safetensors weights"):
        resolve_model(str(plain))


def overrides(*more: str) -> list[str]:
    return ["--set", f"model.name_or_path={REPO}", *[a for m in more for a in ("--set", m)]]


def test_check_reports_every_late_failure_at_once(hf_home, tmp_path, capsys):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}))
    run = ["check", str(ROOT / "configs/demo.yaml"), "--run-dir", str(tmp_path / "run")]
    assert merit([*run, *overrides(f"train.deepspeed={good}")]) == 0
    assert "θ0         ok: " + str(hf_home[1]) in capsys.readouterr().out

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 7}, "optimizer": {"type": "Adam"}}))
    stage7 = tmp_path / "stage7.json"
    stage7.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    cfg = load_config(
        ROOT / "configs/demo.yaml",
        [
            "model.name_or_path=Org/Missing",
            f"data.sources=[{{name: flan, format: vision_flan, path: {tmp_path}/none.json}}]",
            f"train.deepspeed={bad}",
            "merge.device=cuda",
            "train.liger_kernel=on",
        ],
    )
    with pytest.raises(PreflightError) as err:
        check_run(cfg, tmp_path / "run")
    lines = str(err.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["θ0", "data", "deepspeed", "devices"]
    assert "Org/Missing" in lines[0] and "hf download Org/Missing" in lines[0]
    assert "none.json does not exist" in lines[1] and "['optimizer'] come from the train section" in lines[2]
    assert "merge.device is cuda, but this machine has 0 GPU(s)" in lines[3]
    fa4 = load_config(ROOT / "configs/demo.yaml", ["train.packed_attention=flash_attention_4"])
    with pytest.raises(PreflightError, match="flash_attention_4, but the flash-attn-4 package is not installed"):
        check_run(fa4, tmp_path / "run")
    flex = load_config(ROOT / "configs/demo.yaml", ["train.packed_attention=flex_attention"])
    with pytest.raises(PreflightError, match="flex_attention, which transformers does not support for qwen2_5_vl"):
        check_run(flex, tmp_path / "run")
    liger = load_config(ROOT / "configs/demo.yaml", ["train.liger_kernel=on", "merge.device=cpu"])
    with pytest.raises(PreflightError, match="train.liger_kernel is true, but there is no GPU"):
        check_run(liger, tmp_path / "run")
    cfg = load_config(ROOT / "configs/demo.yaml", [f"train.deepspeed={stage7}"])
    with pytest.raises(PreflightError, match="DeepSpeed refuses it.*stage"):
        check_run(cfg, tmp_path / "run")


AVG = "diloco.methods=[{name: avg, method: weighted_average}]"


def test_the_diloco_check_names_what_would_stop_its_workers(tmp_path):
    settings = ["train.deepspeed=zero3", "diloco.shards=random", "diloco.workers=3"]
    cfg = load_config(ROOT / "configs/demo.yaml", [s.replace("configs/", f"{ROOT}/configs/") for s in settings])
    with pytest.raises(PreflightError) as err:
        check_run(cfg, tmp_path / "run", diloco=True)
    (line,) = str(err.value).splitlines()[1:]
    assert line.strip().startswith("diloco: ") and "uses ZeRO-3" in line and "3 workers is not a power of 2" in line
    replay = load_config(ROOT / "configs/demo.yaml", ["diloco.sync=async", AVG, "diloco.replay=/no/arrivals.json"])
    with pytest.raises(PreflightError, match="diloco.replay: /no/arrivals.json does not exist"):
        check_run(replay, tmp_path / "run", diloco=True)
    assert "diloco" not in check_run(load_config(ROOT / "configs/demo.yaml"), tmp_path / "run")  # merit flow
    for bad, message in [
        (["diloco.shards=merit", "diloco.workers=4"], "merit shards are the split's K = 2 groups"),
        (["diloco.shards=given"], "diloco.groups is required"),
        (["diloco.min_workers=3"], "exceeds the 2 workers"),
        (["diloco.quorum=1"], "are for diloco.sync: quorum"),
        (["diloco.sync=quorum", "diloco.quorum=3"], r"quorum \(3\) is between diloco.min_workers \(1\) and the 2"),
        (["diloco.slow_workers={2: 3}"], r"no worker \[2\] among the 2"),
        (["diloco.slow_workers={0: 0.5}"], "factors are ≥ 1"),
        (["diloco.sync=async"], "'isoloco': iso_c combines several payloads at once"),
        (["diloco.sync=async", f"{AVG}", "diloco.aggregators=2"], "diloco.sync: async applies one"),
        (["diloco.replay=arrivals.json"], "replays the arrivals of diloco.sync: async"),
        (["diloco.aggregator_deployment=diloco-part/x"], "runs the parts of diloco.aggregators > 1"),
        (["diloco.methods=[{name: a, method: iso_c, outer_momentum: 1.0}]"], "outer_momentum"),
        (["diloco.methods=[{name: a, method: fisher}]"], "the fisher merge needs Fisher estimates"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(ROOT / "configs/demo.yaml", bad)


class HubStandIn(ThreadingHTTPServer):
    """The hub's two answers ``merit check`` asks for, on 127.0.0.1: a repository's info (gated or
    not) and, for a gated one, the token's access check, refused as the hub refuses it."""

    def __init__(self, gated: set[str]):
        self.gated = gated

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                asked = re.fullmatch(
                    r"/api/(?:models|datasets)/([^/]+/[^/]+)(/auth-check)?(?:/.*)?", self.path.split("?")[0]
                )
                if asked is None:  # anything else huggingface_hub asks for
                    self.send_response(404)
                    self.end_headers()
                    return
                repo, check = asked.groups()
                closed = repo in gated
                if check and closed:
                    self.send_response(403)
                    self.send_header("X-Error-Code", "GatedRepo")
                    self.send_header("X-Error-Message", f"Access to {repo} is restricted")
                    self.end_headers()
                    return
                body = json.dumps(
                    {"id": repo, "sha": "0" * 40, "gated": "manual" if closed else False, "private": False}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_check_from_any_folder_names_the_same_missing_data_online_and_offline(tmp_path, monkeypatch, capsys):
    """``merit check`` of the shipped 3B config from a folder outside the repository: its DeepSpeed
    config found, the run directory named, and the same data sets missing with HF_HUB_OFFLINE (here)
    and without it (a process of its own: huggingface_hub reads it once); online the hub's word is
    added: which of them is gated, and that the token here lacks access."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    assert merit(["check", str(ROOT / "configs/qwen2_5_vl_3b.yaml")]) == 2
    offline = capsys.readouterr()
    hub = HubStandIn(gated={"AI4Math/MathVista"})
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    run = subprocess.run(
        [sys.executable, "-m", "merit", "check", str(ROOT / "configs/qwen2_5_vl_3b.yaml")],
        cwd=tmp_path,
        env=env | {"HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}"},
        capture_output=True,
        text=True,
    )
    hub.shutdown()
    assert run.returncode == 2, run.stderr
    for out in (offline.out, run.stdout):
        assert f"run directory: {tmp_path / 'runs' / 'qwen2.5-vl-3b'}" in out
    missing = [
        set(re.findall(r"its data (\S+) is not in the Hugging Face cache", e)) for e in (offline.err, run.stderr)
    ]
    assert len(missing[0]) == 8 and missing[0] == missing[1]
    for err in (offline.err, run.stderr):
        assert "deepspeed" not in err and "hf download Qwen/Qwen2.5-VL-3B-Instruct" in err  # zero2 found from here
    gated = "MathVista --repo-type dataset` (gated: accept its terms at https://huggingface.co/datasets/AI4Math/"
    assert gated in run.stderr and run.stderr.count("(gated") == 1 and "the token here has no access" in run.stderr
    assert "gated" not in offline.err
