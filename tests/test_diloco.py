"""DiLoCo: the outer step, compression and aggregation against reference formulas, and the flow
with real DeepSpeed workers: one worker with plain averaging is plain training, a killed flow
resumes to the same weights, a worker that fails for good is left out and recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import prefect.settings
import pytest
import torch
from conftest import prepared_run
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from flows.diloco import diloco
from merit.bench.aggregators import fabricate_round
from pipeline.config import DilocoMethod, load_config
from pipeline.diloco import OuterSGD, aggregate, compress, compress_with_feedback, decompress, payload_bytes
from pipeline.diloco.aggregate import AsyncOuter
from pipeline.diloco.compress import INT4_BLOCK, payload_infos
from pipeline.diloco.loop import run_rounds
from pipeline.diloco.payload import delta_reader
from pipeline.diloco.plan import diloco_plan, plan_of, shards
from pipeline.diloco.rounds import (
    abort,
    aggregate_round,
    global_dir,
    parts_dir,
    recover,
)
from pipeline.diloco.rounds import records as round_records
from pipeline.diloco.worker import _keep, wait_for_global
from pipeline.merge import CheckpointReader, Rule
from pipeline.merge.linalg import iso
from pipeline.report.collect import diloco_runs, inner_optimizer
from pipeline.report.diloco import summary_row
from pipeline.train import train_branch

ROOT = Path(__file__).parent.parent
DEMO = str(ROOT / "configs/demo.yaml")
AVERAGE = "diloco.methods=[{name: avg, method: weighted_average, outer_lr: 1.0, outer_momentum: 0.0}]"
OVERRIDES = [
    "data.builtin.examples_per_source=12",
    "warmup.steps=0",
    "train.micro_batch=4",
    "train.max_tokens=256",  # about 4 of the built-in examples a packed micro batch
    "train.deepspeed=zero2",
    "flow.joint_baseline=false",
    "flow.retry_delay_s=0",
    "diloco.inner_steps=2",
    "diloco.rounds=3",
    "diloco.eval_every=0",
    "eval.max_examples_per_source=2",
    "eval.benchmarks=[]",  # one test below runs them on a DiLoCo final
]


def test_the_outer_step_is_nesterov_sgd():
    # fp32 values of order 1 through a few operations in another order than the formula's: a few
    # ulps (1.2e-7 each) apart.
    close = {"atol": 1e-6, "rtol": 0}
    theta, g1, g2 = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0]), torch.tensor([-1.0, 0.25])
    outer = OuterSGD(lr=0.7, momentum=0.9)
    b = outer.step(theta, g1, None)  # b = g1; u = g1 + 0.9 g1
    assert torch.allclose(theta, torch.tensor([1.0, -2.0]) - 0.7 * 1.9 * g1, **close)
    expected = theta - 0.7 * (g2 + 0.9 * (0.9 * g1 + g2))  # b = 0.9 g1 + g2; u = g2 + 0.9 b
    b = outer.step(theta, g2, b)
    assert torch.allclose(theta, expected, **close) and torch.allclose(b, 0.9 * g1 + g2, **close)
    plain = torch.tensor([1.0, 1.0])
    assert OuterSGD(lr=1.0, momentum=0.0).step(plain, g1, None) is None and torch.equal(plain, 1 - g1)


@pytest.mark.parametrize("outer", [OuterSGD(lr=0.7, momentum=0.9), OuterSGD(lr=0.7, momentum=0.9, nesterov=False)])
def test_async_arrivals_of_one_global_in_turn_are_a_synchronous_round(outer):
    """Delayed Nesterov: R payloads taken from the same global and applied one at a time (a plain
    step each, the momentum once per R) move θ as one synchronous round of their average, up to
    rounding: the same sum added in another order, θ of order 1 after 3 rounds, a few fp32 ulps
    (1.2e-7) apart."""
    torch.manual_seed(0)
    theta = {"w": torch.randn(4, 3), "b": torch.randn(5)}
    sync, arrivals = {n: t.clone() for n, t in theta.items()}, {n: t.clone() for n, t in theta.items()}
    momentum, applied = {}, AsyncOuter(arrivals, outer, window=3)
    for _ in range(3):
        workers = [{n: t + 0.1 * torch.randn_like(t) for n, t in sync.items()} for _ in range(3)]
        deltas = [{n: sync[n] - w for n, w in worker.items()} for worker in workers]
        aggregate(sync, workers, [1, 1, 1], [Rule(pattern="*", method="weighted_average")], outer, momentum)
        assert [applied.apply(d, tokens=5.0) for d in deltas] == pytest.approx([1 / 3] * 3, rel=1e-12, abs=0)
        for name in theta:
            assert torch.allclose(arrivals[name], sync[name], atol=1e-6, rtol=0), name
    assert applied.momentum.keys() == momentum.keys()


def test_async_payloads_weigh_alike_by_default_or_their_tokens_against_the_mean_payload():
    """Equal (Liu et al.'s, the default): 1 / R each whatever their tokens; tokens: a payload's
    tokens over R times the mean payload's. The weights are exact fractions of small integers:
    within an ulp of the formula."""
    equal = AsyncOuter({"w": torch.zeros(2)}, OuterSGD(lr=1.0, momentum=0.0), window=2)
    assert [equal.apply({"w": torch.ones(2)}, tokens=t) for t in (100, 50)] == [0.5, 0.5]
    outer = AsyncOuter({"w": torch.zeros(2)}, OuterSGD(lr=1.0, momentum=0.0), window=2, weighting="tokens")
    assert outer.apply({"w": torch.ones(2)}, tokens=100) == 0.5
    assert outer.apply({"w": torch.ones(2)}, tokens=50) == pytest.approx(50 * 2 / (2 * 150), rel=1e-15, abs=0)
    assert torch.allclose(outer.theta["w"], torch.full((2,), -(0.5 + 1 / 3)), atol=0, rtol=1e-7)


def test_the_round_policy_closes_rounds_tells_late_payloads_weighs_and_scales_async_steps():
    """``RoundPolicy``, what the flow's rounds and the straggler bench decide by: a round closes once
    every worker has sent or failed, or at the quorum; a payload is late once its round's global is
    past or its members leave the worker out; weights by tokens or equal, summing to 1; async steps
    H scaled by speed against the fastest, at least 1, H unmeasured or with dynamic steps off."""
    from pipeline.diloco.policy import RoundPolicy, default_weighting

    sync, quorum = RoundPolicy(size=3, inner_steps=30), RoundPolicy(size=3, inner_steps=30, quorum=2)
    assert not sync.round_closes([0, 2], failed={}) and sync.round_closes([0, 2], failed={1: "exit code 1"})
    assert sync.round_closes([0, 1, 2], failed=()) and quorum.round_closes([2, 0], failed=())
    assert not quorum.round_closes([1], failed=()) and quorum.round_closes([1], failed={0: "", 2: ""})
    assert quorum.stragglers([0, 2], failed=()) == [1] and sync.stragglers([0], failed={1: ""}) == [2]
    assert RoundPolicy.closed_to(r=1, k=0, newest=2, members=None)  # its global is past
    assert RoundPolicy.closed_to(r=1, k=0, newest=1, members=[1, 2]) and not RoundPolicy.closed_to(1, 0, 1, [0, 1])
    assert not RoundPolicy.closed_to(r=1, k=0, newest=1, members=None)  # still open
    assert sync.weights([100, 300]).tolist() == [0.25, 0.75]
    assert RoundPolicy(2, 30, weighting="equal").weights([100, 300]).tolist() == [0.5, 0.5]
    assert [default_weighting(s) for s in ("sync", "quorum", "async")] == ["tokens", "tokens", "equal"]
    speeds = {0: 10.0, 1: 10 / 3, 2: 0.1}
    assert [sync.local_steps(speeds, k) for k in (0, 1, 2, 3)] == [30, 10, 1, 30]  # 3: not measured yet
    assert RoundPolicy(3, 30, dynamic_steps=False).local_steps(speeds, 1) == 30


@pytest.mark.parametrize("shape", [(5, 7), (13,), (3, 4, 2), ()])
def test_int8_round_trips_within_half_a_step_per_row_and_counts_its_bytes(shape):
    x = torch.randn(shape) * torch.logspace(-3, 1, shape[0] if shape else 1).reshape(-1, *[1] * (len(shape) - 1))
    payload = compress("w", x, "int8")
    rows = x.reshape(shape[0], -1) if len(shape) >= 2 else x.reshape(1, -1)
    bound = rows.abs().amax(1, keepdim=True) / 254
    error = (decompress(payload, "w").reshape(rows.shape) - rows).abs()
    assert (error <= bound * (1 + 1e-5) + 1e-12).all()
    assert payload_bytes(payload) == x.numel() + 4 * rows.shape[0]
    assert payload_bytes(compress("w", x, "bf16")) == 2 * x.numel()
    assert payload_bytes(compress("w", x, "none")) == 4 * x.numel()


@pytest.mark.parametrize("shape", [(5, 300), (3, 7), (257,), (2, 3, 45), ()])
def test_int4_round_trips_within_half_a_step_per_block_in_half_a_byte_an_entry(shape):
    x = torch.randn(shape) * torch.logspace(-3, 1, shape[0] if shape else 1).reshape(-1, *[1] * (len(shape) - 1))
    if len(shape) == 2 and shape[1] > INT4_BLOCK:
        x[0, 5] = 1e4  # one outlier: only its block's scale grows
    payload = compress("w", x, "int4")
    rows = x.reshape(shape[0], -1) if len(shape) >= 2 else x.reshape(1, -1)
    n, cols = rows.shape
    padded = torch.nn.functional.pad(rows, (0, -cols % INT4_BLOCK)).reshape(n, -1, INT4_BLOCK)
    bound = (padded.abs().amax(2, keepdim=True) / 14).expand_as(padded).reshape(n, -1)[:, :cols]
    restored = decompress(payload, "w", x.shape)
    assert restored.shape == x.shape
    assert ((restored.reshape(n, cols) - rows).abs() <= bound * (1 + 1e-5) + 1e-12).all()
    packed_bytes, scale_bytes = -(-cols // 2), 4 * -(-cols // INT4_BLOCK)
    assert payload["w"].dtype == torch.uint8 and payload_bytes(payload) == n * (packed_bytes + scale_bytes)
    planned = {k: (i.shape, i.dtype) for k, i in payload_infos("w", tuple(x.shape), "int4").items()}
    assert {k: (tuple(t.shape), t.dtype) for k, t in payload.items()} == planned  # what a worker plans to write
    if len(shape) == 2 and shape[1] > INT4_BLOCK:
        assert (restored[0, INT4_BLOCK:] - x[0, INT4_BLOCK:]).abs().max() < 1e-2  # the outlier's block only


def half_step(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Per entry, the most that one round trip of ``kind`` may change x (8 × 16: one int4 block a row)."""
    return x.abs().amax(1, keepdim=True).expand_as(x) / (254 if kind == "int8" else 14)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_error_feedback_keeps_what_compression_dropped_small_and_sends_it_later(kind):
    """The residual stays within one round trip's error of what was to send (a compressor that
    sent nothing would keep all of Δ); what is sent plus the residual is what was to send, up to
    the fp32 rounding of 5 sums of entries of order 1 (1e-5 absolute, 0 relative, is 80 ulps)."""
    generator = torch.Generator().manual_seed(0)
    deltas = [torch.randn(8, 16, generator=generator) for _ in range(5)]
    residual, sent = torch.zeros(8, 16), torch.zeros(8, 16)
    for delta in deltas:
        corrected = delta + residual
        payload, residual = compress_with_feedback("w", delta, kind, residual)
        sent += decompress(payload, "w", delta.shape)
        assert (residual.abs() <= half_step(corrected, kind) * (1 + 1e-6)).all()  # 1e-6: the scale's rounding
    assert torch.allclose(sent + residual, sum(deltas), atol=1e-5, rtol=0)  # nothing is lost, only delayed
    # Entry [0, 1] is below half an int8 step of its row every round: compression alone never sends
    # it; with feedback it builds up until sent, so the total sent is within half a step of 5 × 0.003.
    delta = torch.zeros(8, 16)
    delta[:, 0], delta[0, 1] = 1.0, 0.003
    alone, fed, residual = torch.zeros(8, 16), torch.zeros(8, 16), torch.zeros(8, 16)
    for _ in range(5):
        alone += decompress(compress_with_feedback("w", delta, "int8", None)[0], "w", delta.shape)
        payload, residual = compress_with_feedback("w", delta, "int8", residual)
        fed += decompress(payload, "w", delta.shape)
    assert alone[0, 1] == 0 and fed[0, 1] > 0 and abs(fed[0, 1] - 0.015) <= 0.5 / 127  # the residual's bound


def test_error_feedback_without_compression_changes_nothing():
    """Without compression the residual is exactly 0 (x − x), so the aggregate is the same bits."""
    theta = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    workers = [{n: t + 0.1 * torch.randn_like(t) for n, t in theta.items()} for _ in range(2)]
    rules, outer = [Rule(pattern="*", method="weighted_average")], OuterSGD(lr=0.7, momentum=0.9)
    plain, fed = {n: t.clone() for n, t in theta.items()}, {n: t.clone() for n, t in theta.items()}
    aggregate(plain, workers, [1, 1], rules, outer, {})
    aggregate(fed, workers, [1, 1], rules, outer, {}, residuals=[{}, {}])
    for name in theta:
        assert torch.equal(fed[name], plain[name]) and not torch.equal(fed[name], theta[name]), name


def test_isoloco_aggregate_is_iso_c_of_the_mean_pseudo_gradient():
    theta = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    workers = [{n: t + 0.1 * torch.randn_like(t) for n, t in theta.items()} for _ in range(3)]
    before = {n: t.clone() for n, t in theta.items()}
    stats = aggregate(theta, workers, [1, 1, 1], [Rule(pattern="*", method="iso_c")], OuterSGD(lr=1, momentum=0), {})
    mean = {n: sum(before[n] - w[n] for w in workers) / 3 for n in theta}
    # θ of order 1 minus an update of order 0.1 computed in another order (the SVD of the mean):
    # a few fp32 ulps of θ (1.2e-7 each) apart.
    assert torch.allclose(theta["w"], before["w"] - iso(mean["w"]), atol=1e-6, rtol=0)
    assert torch.allclose(theta["b"], before["b"] - mean["b"], atol=1e-6, rtol=0)  # vectors: the mean
    assert stats.bytes_sent == 3 * 4 * (24 + 4) and len(stats.norms) == 3


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantised_payload_on_disk_reads_back_row_block_by_row_block(tmp_path, kind):
    tensors = {"m": torch.randn(10, 3), "v": torch.randn(7), "c": torch.randn(6, 2, 131)}
    save_file({k: v for n, t in tensors.items() for k, v in compress(n, t, kind).items()}, tmp_path / "d.safetensors")
    reader = CheckpointReader(tmp_path / "d.safetensors")
    for name, t in tensors.items():
        read = delta_reader(reader, name, tuple(t.shape))
        expected = decompress(compress(name, t, kind), name, t.shape)
        assert torch.equal(torch.cat([read(0, 4), read(4, len(t))]), expected), name


def run_flow(run_dir: Path, *extra: str):
    return diloco(config=DEMO, overrides=[*OVERRIDES, *extra], run_dir=str(run_dir), return_state=True)


def global_weights(run_dir: Path, variant: str, r: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "diloco" / variant / "global" / str(r) / "model.safetensors")


NESTEROV_INT4 = ["diloco.compression=int4", "diloco.error_feedback=true", "diloco.methods.0.outer_momentum=0.9"]
PARTS = ["diloco.aggregators=2"]  # aggregated by two tasks at once


def kill_flow_when(path: Path, run_dir: Path, settings: list[str], timeout_s: float = 300) -> None:
    """``merit run --flow diloco`` with ``settings`` on ``run_dir``, in a process group of its own
    (against the tests' Prefect API), SIGKILLed with everything it started once ``path`` exists
    (looked for every 5 ms: the kill lands then or a little later; tests/test_diloco_kills.py
    kills at each boundary exactly)."""
    env = {**os.environ, "PREFECT_API_URL": prefect.settings.PREFECT_API_URL.value()}
    cli = [sys.executable, "-m", "merit", "run", DEMO, "--run-dir", str(run_dir), "--flow", "diloco"]
    proc = subprocess.Popen(
        [*cli, *[a for s in settings for a in ("--set", s)]],
        env=env,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "the flow ended before it could be killed"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.release  # a whole flow killed; every boundary in-process: test_diloco_kills
def test_a_flow_killed_while_a_rounds_parts_are_written_resumes_to_the_same_global_weights(prefect_api, tmp_path):
    """Nesterov momentum and int4 compression with error feedback: the outer state and every
    worker's inner state (AdamW moments, data position, residual) must survive the kill. The
    killed run aggregates each round in two parts at once, and is killed as round 0's parts are
    written, then again as round 1's are: the same bits as an undisturbed run in one part."""
    two_rounds = "diloco.rounds=2"
    settings = [*OVERRIDES, AVERAGE, *NESTEROV_INT4, *PARTS, two_rounds]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    folder = killed / "diloco" / "avg-iid"
    assert run_flow(whole, AVERAGE, *NESTEROV_INT4, two_rounds).is_completed()
    for r in (0, 1):
        kill_flow_when(folder / "global" / f".{r + 1}.parts" / "0" / "manifest.json", killed, settings)
        assert not (folder / "global" / "2").exists()
    assert run_flow(killed, AVERAGE, *NESTEROV_INT4, *PARTS, two_rounds).is_completed()
    expected = global_weights(whole, "avg-iid", 2)
    final = CheckpointReader(folder / "global" / "2")
    assert final.info.keys() == expected.keys() and len(final.files) == 2  # two parts, one index
    for name, tensor in expected.items():
        assert torch.equal(final.get(name), tensor), name
    momentum = CheckpointReader(folder / "global" / "2" / "outer")
    assert momentum.info.keys() == {n for n in expected if n in momentum.info} and momentum.info
    recorded = [json.loads((d / "diloco" / "avg-iid" / "rounds.json").read_text()) for d in (whole, killed)]
    assert [(r.keys(), r["seconds"].keys()) for r in recorded[1]] == [
        (r.keys(), r["seconds"].keys()) for r in recorded[0]
    ]
    decided = json.loads((folder / "members.json").read_text())
    assert [(m["workers"], m["digests"]) for m in decided] == [(r["workers"], r["digests"]) for r in recorded[1]]
    assert [r["digests"] for r in recorded[1]] == [r["digests"] for r in recorded[0]]  # the same payloads


@pytest.mark.release  # a failing worker through the whole flow; quorum's stragglers: below
def test_a_worker_that_fails_for_good_is_left_out_and_one_worker_with_plain_averaging_is_plain_training(
    prefect_api, tmp_path
):
    """Worker 0 has two ranks (ZeRO-2 over gloo): its fp32 masters are gathered collectively."""
    run_dir = tmp_path / "run"
    # Worker 1's checkpoint pointer names a checkpoint that does not exist: every launch fails.
    latest = run_dir / "diloco" / "avg-iid" / "workers" / "1" / "checkpoints" / "latest.json"
    latest.parent.mkdir(parents=True)
    latest.write_text(json.dumps({"tag": "step99", "step": 99}))
    benchmarks = ["eval.benchmarks=[toy_reading]", "data.builtin.benchmark_examples=4"]
    settings = ["diloco.rounds=2", "flow.branch_retries=0", "train.processes=2", "train.micro_batch=2"]
    state = run_flow(run_dir, AVERAGE, *settings, *benchmarks)
    assert state.is_completed(), state.message
    rows = json.loads((run_dir / "report" / "report.json").read_text())["benchmarks"]["rows"]
    kinds = [("constant", "baseline"), ("theta0", "theta0"), ("avg-iid", "diloco")]  # the final too
    assert [(r["model"], r["kind"]) for r in rows] == kinds
    job = run_dir / "eval" / "benchmarks" / "avg-iid" / "toy_reading" / "score.json"
    assert "score" in json.loads(job.read_text())
    records = json.loads((run_dir / "diloco" / "avg-iid" / "rounds.json").read_text())
    assert [(r["workers"], r["dropped"]) for r in records] == [([0], [1])] * 2
    assert all("avg-iid/1: training exit code 1" in r["failures"]["1"] for r in records)
    assert records[-1]["heldout_loss"] > 0 and "left out" in (run_dir / "report" / "report.md").read_text()

    # So every round aggregated worker 0 alone: R = 1, η = 1, μ = 0, which is plain training of
    # its shard for T·H steps with the same batches and lr schedule.
    worker = plan_of(load_config(run_dir / "config.yaml"), run_dir, "avg-iid").workers[0]
    plain = worker.model_copy(update={"name": "plain", "out_dir": str(tmp_path / "plain")})
    final = load_file(Path(train_branch(plain, echo=False).final) / "model.safetensors")
    merged = global_weights(run_dir, "avg-iid", 2)
    # θ − (θ − θ_k) is θ_k up to rounding; Adam turns that rounding into lr-sized steps only where
    # a gradient is pure rounding noise (the key biases, to which softmax is blind): 3e-6 there.
    for name, tensor in final.items():
        assert torch.allclose(merged[name], tensor, atol=1e-7 if "k_proj.bias" not in name else 1e-5, rtol=0), name


def test_in_quorum_mode_a_slow_worker_does_not_hold_the_rounds(prefect_api, tmp_path):
    """Worker 1 runs 30× slower (a 1/30 share of the CPU); with a quorum of 1 every round
    aggregates worker 0 alone as soon as it sends, and names worker 1 a straggler, not a failure."""
    run_dir = tmp_path / "run"
    settings = ["diloco.rounds=2", "diloco.sync=quorum", "diloco.quorum=1", "diloco.slow_workers={1: 30}"]
    state = run_flow(run_dir, AVERAGE, *settings)
    assert state.is_completed(), state.message
    records = json.loads((run_dir / "diloco" / "avg-iid" / "rounds.json").read_text())
    assert [(r["workers"], r["stragglers"], r["failures"]) for r in records] == [([0], [1], {})] * 2
    # One fp32 payload, read twice, and θ's trained tensors in fp32 (as large); no momentum (μ = 0).
    assert all(r["bytes"]["aggregator_read"] == 3 * r["bytes"]["sent"] > 0 for r in records)
    AutoModelForImageTextToText.from_pretrained(run_dir / "diloco" / "avg-iid" / "global" / "2")
    steps = (run_dir / "diloco" / "avg-iid" / "workers" / "1" / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2  # it trained its round 0, found the run over and stopped
    report = (run_dir / "report" / "report.md").read_text()
    assert "stragglers [1] left out by the quorum" in report and "| quorum |" in report


@pytest.mark.release  # a whole flow killed; every boundary in-process: test_diloco_kills
def test_a_quorum_flow_killed_while_a_rounds_parts_are_written_aggregates_the_recorded_members(prefect_api, tmp_path):
    """Which workers a quorum round aggregates depends on timing, so its weights are not compared
    with another run's. Killed as round 0's two parts are written (its members decided: worker 0,
    worker 1 a straggler) and re-run, the run completes; every round aggregated exactly the members
    recorded for it before its parts, named by their payloads' digests."""
    run_dir, folder = tmp_path / "run", tmp_path / "run" / "diloco" / "avg-iid"
    settings = ["diloco.rounds=2", "diloco.sync=quorum", "diloco.quorum=1", "diloco.slow_workers={1: 30}", *PARTS]
    kill_flow_when(folder / "global" / ".1.parts" / "0" / "manifest.json", run_dir, [*OVERRIDES, AVERAGE, *settings])
    assert [(m["workers"], m["stragglers"]) for m in json.loads((folder / "members.json").read_text())] == [([0], [1])]
    state = run_flow(run_dir, AVERAGE, *settings)
    assert state.is_completed(), state.message
    records = json.loads((folder / "rounds.json").read_text())
    decided = json.loads((folder / "members.json").read_text())
    assert [(r["workers"], r["digests"], r["stragglers"]) for r in records] == [
        (m["workers"], m["digests"], m["stragglers"]) for m in decided
    ]
    assert [r["workers"] for r in records] == [[0], [0]] and all(r["aggregators"] == 2 for r in records)
    AutoModelForImageTextToText.from_pretrained(folder / "global" / "2")


ASYNC = ["diloco.sync=async", "diloco.slow_workers={1: 8}", "diloco.inner_steps=4", "diloco.rounds=3"]


def test_in_async_mode_payloads_apply_as_they_arrive_and_a_slow_worker_trains_fewer_steps(prefect_api, tmp_path):
    """Worker 1 runs 8× slower: neither waits for the other, worker 1's payloads after its first
    are shorter (dynamic local steps) and older (staleness), and the momentum steps once every R
    arrivals. A second run given the first's arrivals (diloco.replay), killed after its second
    global and re-run, ends with the same weights."""
    whole = tmp_path / "whole"
    state = run_flow(whole, AVERAGE, *NESTEROV_INT4, *ASYNC)
    assert state.is_completed(), state.message
    folder = whole / "diloco" / "avg-iid"
    records = json.loads((folder / "rounds.json").read_text())
    order = json.loads((folder / "arrivals.json").read_text())
    assert [(r["workers"][0], r["payload"], r["base"]) for r in records] == [
        (a["worker"], a["payload"], a["base"]) for a in order
    ]
    assert sorted((a["worker"], a["payload"]) for a in order) == [(k, n) for k in range(2) for n in range(3)]
    assert [r["window_closed"] for r in records] == [False, True] * 3
    slow = [a for a in order if a["worker"] == 1]
    assert slow[0]["steps"] == 4 and all(a["steps"] < 4 for a in slow[1:])  # measured 8× slower
    assert all(a["steps"] == 4 for a in order if a["worker"] == 0)
    assert all(r["staleness"] == r["round"] - r["base"] >= 0 for r in records)
    assert not any((folder / "deltas").rglob("manifest.json"))  # every window closed: payloads retired
    AutoModelForImageTextToText.from_pretrained(folder / "global" / "6")
    report = (whole / "report" / "report.md").read_text()
    assert "| async |" in report and "6/6 arrivals" in report

    replay, cfg = tmp_path / "replay", [*OVERRIDES, AVERAGE, *NESTEROV_INT4, *ASYNC]
    settings = [*cfg, f"diloco.replay={folder / 'arrivals.json'}"]
    kill_flow_when(replay / "diloco" / "avg-iid" / "global" / "2" / "manifest.json", replay, settings)
    assert not (replay / "diloco" / "avg-iid" / "global" / "6").exists()
    assert run_flow(replay, AVERAGE, *NESTEROV_INT4, *ASYNC, settings[-1]).is_completed()
    replayed = json.loads((replay / "diloco" / "avg-iid" / "arrivals.json").read_text())
    # The same order; the digests, of the payloads the whole run trained, not carried over
    assert replayed == [a | {"digest": None} for a in order] and all(a["digest"] for a in order)
    records = json.loads((replay / "diloco" / "avg-iid" / "rounds.json").read_text())
    assert all(len(r["digests"]) == 1 and None not in r["digests"].values() for r in records)
    expected = global_weights(whole, "avg-iid", 6)
    for name, tensor in global_weights(replay, "avg-iid", 6).items():
        assert torch.equal(tensor, expected[name]), name


def test_the_report_row_of_a_variant_states_overhead_bytes_and_left_out_workers():
    def record(r, wall, inner, dropped=(), stragglers=()):
        seconds = {"wall": wall, "inner": inner, "aggregate": 0.5, "merge": 0.1, "launch": 9.0 if r == 0 else 0.0}
        return {
            "round": r,
            "dropped": [*dropped, *stragglers],
            "stragglers": list(stragglers),
            "workers": [k for k in range(2) if k not in (*dropped, *stragglers)],
            "bytes": {"sent": 100, "received": 300, "data_parallel": 1000, "aggregator_read": 250},
            "seconds": seconds,
        }

    run = {"variant": "isoloco-iid", "method": "iso_c", "outer": "", "workers": 2, "inner_steps": 5, "rounds": 3}
    run |= {"sync": "quorum"}
    run["records"] = [record(0, 20.0, 4.0), record(1, 5.0, 4.0, dropped=[1]), record(2, 5.0, 4.5, stragglers=[0])]
    models = {"isoloco-iid": {"loss": 1.2, "kind": "diloco"}, "joint": {"loss": 1.0, "kind": "joint"}}
    models["merged-a"] = {"loss": 1.5, "kind": "merged"}
    row = summary_row(run, models)
    assert row["overhead_pct"] == pytest.approx(100 * (1 - 8.5 / 10.0))  # rounds after the first
    assert row["aggregation_pct"] == pytest.approx(10.0) and row["merge_pct"] == pytest.approx(2.0)
    assert row["launch_s"] == 9.0
    assert row["bytes_sent"] == 300 and row["bytes_vs_data_parallel"] == pytest.approx(1200 / 6000)
    assert row["vs_joint"] == pytest.approx(0.2) and row["vs_best_merge"] == pytest.approx(-0.3)
    assert row["left_out"] == {1: [1]} and row["rounds"] == "3/3"
    assert row["stragglers"] == {2: [0]} and row["sync"] == "quorum" and row["payload"] == "dense"
    assert summary_row(run | {"compression": "int4"}, models)["payload"] == "dense int4"
    assert summary_row(run | {"lora_rank": 8, "compression": "bf16"}, models)["payload"] == "LoRA r8 bf16"
    assert row["sent_per_worker_round"] == round(300 / 4) and row["read_per_aggregator_round"] == 250
    assert row["inner"] == "AdamW"
    muon = {"optimizer": "muon", "muon_lr": 0.02, "muon_momentum": 0.95, "lr": 1e-3}
    assert inner_optimizer(muon) == "Muon lr 0.02, μ 0.95 + AdamW lr 0.001"
    assert summary_row(run | {"inner": inner_optimizer(muon)}, models)["inner"].startswith("Muon lr 0.02")


def test_shards_are_iid_slices_the_split_groups_random_groups_or_given_ones(tmp_path):
    sources = {f"s{i}": {"train_examples": 10, "train_tokens": 100 * (i + 1)} for i in range(4)}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"sources": sources}))
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "split.json").write_text(json.dumps({"groups": [["s0", "s3"], ["s1", "s2"]]}))

    def of(*settings):
        return shards(load_config(DEMO, list(settings)), tmp_path)

    assert of("diloco.shards=iid", "diloco.workers=3") == [(list(sources), (k, 3)) for k in range(3)]
    assert of("diloco.shards=merit") == [(["s0", "s3"], None), (["s1", "s2"], None)]
    assert of("diloco.shards=given", "diloco.groups=[[s0], [s1, s2, s3]]") == [
        (["s0"], None),
        (["s1", "s2", "s3"], None),
    ]
    random = of("diloco.shards=random", "diloco.workers=2")
    assert sorted(s for group, _ in random for s in group) == list(sources) and len(random) == 2
    assert random == of("diloco.shards=random", "diloco.workers=2")  # seeded


def test_workers_weigh_their_tokens_in_rounds_and_alike_as_async_arrivals_unless_set(tmp_path):
    """The weighting's default is settled in the plan (plan.json and its digest name the one used):
    tokens for sync and quorum rounds (MERIT's weights), equal for async arrivals (Liu et al.)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"sources": {"s": {"train_examples": 8}}}))

    def weighting(*settings):
        cfg = load_config(DEMO, ["diloco.rounds=2", "diloco.methods=[{name: a, method: weighted_average}]", *settings])
        return diloco_plan(cfg, tmp_path, cfg.diloco.methods[0]).method.weighting

    assert weighting() == weighting("diloco.sync=quorum") == "tokens"
    assert weighting("diloco.sync=async") == "equal"
    tokens = "diloco.methods=[{name: a, method: weighted_average, weighting: tokens}]"
    assert weighting("diloco.sync=async", tokens) == "tokens"


def test_waiting_workers_stop_on_the_aggregators_abort_note_and_a_round_saved_twice_replaces_its_payload(tmp_path):
    plan = SimpleNamespace(folder=str(tmp_path), variant="v")
    abort(plan, "RuntimeError: round 3: 0 of 2 workers sent their pseudo-gradients")
    with pytest.raises(RuntimeError, match="the aggregator stopped the run: RuntimeError: round 3"):
        wait_for_global(plan, 1, timeout_s=60)
    abort(plan, None)
    with pytest.raises(TimeoutError, match="no global weights of round 1"):
        wait_for_global(plan, 1, timeout_s=0)
    # A kill after the payload moved into its checkpoint, before the checkpoint became the latest:
    # the round is trained again into the same tag.
    tag, pending = tmp_path / "step4", tmp_path / ".round1"
    tag.mkdir()  # DeepSpeed has written the engine state
    for payload in ("old", "new"):
        (pending / "delta").mkdir(parents=True)
        (pending / "delta" / "x").write_text(payload)
        _keep(pending, tag / "diloco")
    assert (tag / "diloco" / "delta" / "x").read_text() == "new" and not pending.exists()


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory):
    run_dir = prepared_run(tmp_path_factory.mktemp("parts") / "run")
    cfg = load_config(run_dir / "config.yaml", ["diloco.workers=3", "diloco.rounds=2", "diloco.compression=int8"])
    return cfg, run_dir


METHODS = ["weighted_average", "task_arithmetic", "iso_c", "iso_cts", "tsv", "ties", "dare"]


@pytest.mark.parametrize("method", METHODS)
def test_aggregators_splitting_a_round_by_tensors_give_the_weights_of_one(diloco_run, tmp_path, method):
    """Two rounds (the second reads the first's momentum, in parts too) with S = 1 and S = 3: the
    same bits (a tensor's merge and outer step read that tensor only, whichever part holds it)."""
    cfg, run_dir = diloco_run
    entry = DilocoMethod(name="m", method=method, outer_lr=0.7, outer_momentum=0.9)
    one = diloco_plan(cfg, run_dir, entry).model_copy(update={"folder": str(tmp_path / "one")})
    three = one.model_copy(update={"folder": str(tmp_path / "three"), "aggregators": 3})
    records = {}
    for plan in (one, three):
        for r in range(2):
            fabricate_round(plan, r, seed=r)
            records[plan.aggregators, r] = aggregate_round(plan, r, [0, 1, 2])
    for sub in ("", "outer"):
        a, b = CheckpointReader(global_dir(one, 2) / sub), CheckpointReader(global_dir(three, 2) / sub)
        assert a.info.keys() == b.info.keys()
        for name in a.info:
            assert torch.equal(a.get(name), b.get(name)), (sub, name)
    assert (global_dir(three, 2) / "model.safetensors.index.json").is_file()  # three files, one index
    AutoModelForImageTextToText.from_pretrained(global_dir(three, 2))
    first, split = records[1, 1], records[3, 1]
    # The Gram matrix summed over the parts: float64 sums of the 56 tensors' products in another
    # order, within 56 ulps (6e-15 relative) of each other; cosines (at most 1) to the same.
    assert split["delta_norms"] == pytest.approx(first["delta_norms"], rel=1e-12, abs=0)
    assert split["mean_cosine"] == pytest.approx(first["mean_cosine"], rel=0, abs=1e-12)
    # Each aggregator reads about a third of what one reads (the parts are balanced by bytes).
    assert split["bytes"]["aggregator_read"] < 0.6 * first["bytes"]["aggregator_read"]
    assert not parts_dir(three, 1).exists()


def test_the_round_loop_runs_from_python_without_prefect(diloco_run):
    """``pipeline.diloco.loop.run_rounds`` alone: the workers processes of this machine, a round's
    two parts threads of this one; the global loads with transformers."""
    _, run_dir = diloco_run
    deepspeed = "train.deepspeed=zero2"
    settings = ["diloco.workers=2", "diloco.rounds=1", "diloco.inner_steps=1", "diloco.aggregators=2", deepspeed]
    cfg = load_config(run_dir / "config.yaml", [*settings, "diloco.eval_every=0", "train.micro_batch=4"])
    entry = DilocoMethod(name="loop", method="iso_c", outer_lr=1.0, outer_momentum=0.0)
    plan = diloco_plan(cfg, run_dir, entry)
    run_rounds(cfg, str(run_dir), plan)
    (record,) = round_records(plan)
    assert record["workers"] == [0, 1] and record["aggregators"] == 2 and record["failures"] == {}
    AutoModelForImageTextToText.from_pretrained(global_dir(plan, 1))


@pytest.mark.release  # a second inner optimizer through the whole flow
def test_muon_workers_keep_their_optimizer_state_across_rounds(diloco_run):
    """MuLoCo: DiLoCo with Muon inside (``train.optimizer: muon``), two rounds of two workers; the
    report's row names the inner optimizer."""
    _, run_dir = diloco_run
    settings = ["diloco.workers=2", "diloco.rounds=2", "diloco.inner_steps=2", "diloco.eval_every=0"]
    cfg = load_config(run_dir / "config.yaml", [*settings, "train.micro_batch=4", "train.optimizer=muon"])
    entry = DilocoMethod(name="muloco", method="weighted_average", outer_lr=0.7, outer_momentum=0.9)
    plan = diloco_plan(cfg, run_dir, entry)
    run_rounds(cfg, str(run_dir), plan)
    assert [r["workers"] for r in round_records(plan)] == [[0, 1], [0, 1]]
    worker = Path(plan.workers[0].out_dir)
    assert "Muon on " in (worker / "train.log").read_text()
    # the second round resumed the worker's Muon momenta (its checkpoint), not fresh ones
    steps = [json.loads(line)["step"] for line in (worker / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    theta0, final = CheckpointReader(plan.init), CheckpointReader(global_dir(plan, 2))
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(theta0.get(name), final.get(name))
    (run,) = [r for r in diloco_runs(run_dir) if r["variant"] == plan.variant]
    assert run["inner"] == f"Muon lr 0.02, μ 0.95 + AdamW lr {cfg.train.lr:g}"


def test_a_round_recovered_after_a_kill_is_recorded_as_the_flow_records_it(diloco_run, tmp_path):
    """Killed between writing global 1 and adding its record to rounds.json: the re-run's record
    is the one the flow would have saved, notes and wall time included (the report reads them)."""
    cfg, run_dir = diloco_run
    entry = DilocoMethod(name="m", method="weighted_average", outer_lr=1.0, outer_momentum=0.0)
    plan = diloco_plan(cfg, run_dir, entry).model_copy(update={"folder": str(tmp_path / "plan")})
    fabricate_round(plan, 0, seed=0)
    notes = {"failures": {"2": "exit code 1"}, "stragglers": [1]}
    record = aggregate_round(plan, 0, [0], notes=notes, began=time.perf_counter() - 5.0)
    assert record["failures"] == notes["failures"] and record["stragglers"] == [1]
    assert record["seconds"]["wall"] >= 5.0
    assert round_records(plan) == []
    recover(plan, 0)
    assert round_records(plan) == [record]
