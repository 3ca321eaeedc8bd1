"""``merit bench diloco``'s building blocks: the stdlib corpus and its file-level split, and one
round of plain averaging, checked against the workers' weights averaged by hand; ``merit bench
aggregators``' bytes against their arithmetic; ``merit bench diloco --slow``'s sync modes with a
really slow worker process."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.diloco import (
    CLIP,
    CONTEXT,
    EOD,
    MAX_FILE_BYTES,
    Learner,
    lm_loss,
    load_corpus,
    run_diloco,
    shard_batches,
    tiny_qwen2,
)


def test_corpus_is_deterministic_with_disjoint_files_and_byte_windows():
    corpus, again = load_corpus(), load_corpus()
    assert corpus.train_files == again.train_files and corpus.heldout_files == again.heldout_files
    assert torch.equal(corpus.heldout, again.heldout)
    assert corpus.heldout_files and not set(corpus.train_files) & set(corpus.heldout_files)
    assert max(len(f) for f in corpus.train_files + corpus.heldout_files) < 100  # names, not paths
    sizes = [(corpus.root / f).stat().st_size for f in corpus.train_files + corpus.heldout_files]
    assert max(sizes) <= MAX_FILE_BYTES and sum(sizes) == corpus.train_bytes + corpus.heldout_bytes
    assert 0.02 < corpus.heldout_bytes / (corpus.train_bytes + corpus.heldout_bytes) < 0.15
    for windows in (corpus.train, corpus.heldout):
        assert windows.shape[1] == CONTEXT + 1 and windows.min() >= 0 and windows.max() == EOD
        assert torch.equal(windows[:-1, -1], windows[1:, 0])  # consecutive windows share one id


def test_averaging_sets_the_global_weights_to_the_workers_mean():
    torch.manual_seed(1)
    train, heldout = torch.randint(0, EOD + 1, (40, CONTEXT + 1)), torch.randint(0, EOD + 1, (4, CONTEXT + 1))
    model0 = tiny_qwen2()
    run = run_diloco(model0, train, heldout, workers=2, inner_steps=2, rounds=1, method="average")

    learners = [Learner(tiny_qwen2(), steps=2) for _ in range(2)]
    for learner, stream in zip(learners, shard_batches(len(train), 2, seed=0)):
        learner.train(train[next(stream)] for _ in range(2))
    trained = [learner.model.state_dict() for learner in learners]
    for name, theta in run.model.state_dict().items():
        torch.testing.assert_close(theta, (trained[0][name] + trained[1][name]) / 2, rtol=0, atol=1e-6)
        assert not torch.equal(trained[0][name], trained[1][name])  # the shards differ
    params = sum(p.numel() for p in model0.parameters())
    assert run.curve[0]["bytes_sent"] == 2 * 4 * params


def test_lora_workers_move_only_their_adapted_tensors_by_a_low_rank_step_and_send_the_factors():
    """R = 2 LoRA workers of rank 2, plain averaging, two rounds: each round a fresh adapter (B = 0:
    the worker starts as the global, its AdamW moments at zero, the step count going on); the
    global moves by at most R · r = 4 directions a round on each adapted tensor and nowhere else;
    each worker sends 4·r(m + n) bytes per adapted m × n tensor."""
    from benchmarks.diloco import LoraLearner

    torch.manual_seed(1)
    train, heldout = torch.randint(0, EOD + 1, (40, CONTEXT + 1)), torch.randint(0, EOD + 1, (4, CONTEXT + 1))
    model0 = tiny_qwen2()
    theta0 = {n: t.clone() for n, t in model0.state_dict().items()}
    run = run_diloco(model0, train, heldout, workers=2, inner_steps=2, rounds=1, method="average", lora_rank=2)
    linears = {n: m for n, m in model0.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert run.curve[0]["bytes_sent"] == 2 * 4 * sum(2 * (m.in_features + m.out_features) for m in linears.values())
    for name, theta in run.model.state_dict().items():
        if name.removesuffix(".weight") in linears:
            assert 0 < torch.linalg.matrix_rank(theta - theta0[name]) <= 4, name
        else:
            assert torch.equal(theta, theta0[name]), name  # embeddings, norms, biases, lm_head: θ0's

    learner, global_model = LoraLearner(model0, steps=4, rank=2), run.model
    learner.start_round(global_model.state_dict(), seed=0)
    learner.train([train[:2], train[2:4]])
    learner.start_round(global_model.state_dict(), seed=1)
    batch = heldout[:2]
    assert torch.allclose(lm_loss(learner.model, batch), lm_loss(global_model, batch), atol=1e-6)  # B = 0
    states = [learner.optimizer.state[p] for p in learner.optimizer.param_groups[0]["params"]]
    assert all(int(s["step"]) == 2 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in states)


def test_a_learner_clips_its_gradients_before_each_step():
    """The bench trains as the trainer does: gradient norm clipped to 1.0 before AdamW's step."""
    model = tiny_qwen2()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # gradients far above the clip
    learner, seen = Learner(model, steps=2), []

    def before_step(optimizer, args, kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    learner.optimizer.register_step_pre_hook(before_step)
    batch = torch.randint(0, EOD + 1, (2, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    norms = learner.train([batch, batch])
    assert min(norms) > 10 * CLIP and seen == pytest.approx([CLIP, CLIP], rel=1e-4)


def test_bench_aggregators_measures_a_share_of_every_payload_per_aggregator(tmp_path, capsys):
    """One aggregator reads every payload twice, θ and the momentum: (2R + 2) payloads' bytes
    (fp32, every tensor trained); S aggregators each about 1/S of it."""
    from benchmarks.aggregators import main

    main(SimpleNamespace(workers=[2], size="small", compression="none", method="iso_c", workdir=str(tmp_path)))
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    read = {int(row[1]): float(row[3]) for row in rows}
    payload = float(rows[0][2])
    assert sorted(read) == [1, 2] and payload > 1
    assert read[1] == pytest.approx(6 * payload, rel=0.02)
    printed = 0.1  # MB: both figures are rounded to it, so an even split can print below half
    assert 0.5 * read[1] - printed <= read[2] <= 0.6 * read[1] + printed
    assert not any(tmp_path.iterdir())  # θ0 and the payloads went with the bench


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A few kB of stdlib code in files named so that one is held out: a bench in seconds."""
    import sysconfig
    import zlib

    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / name).read_bytes() for name in ["bisect.py", "colorsys.py", "keyword.py"])
    names = [f"m{i}.py" for i in range(200)]
    held = next(n for n in names if zlib.crc32(n.encode()) % 20 == 0)
    for name in [n for n in names if zlib.crc32(n.encode()) % 20][:4]:
        (root / name).write_bytes(text[:6000])
    (root / held).write_bytes(text[6000:8500])
    return load_corpus(root)


def test_straggler_bench_compares_the_sync_modes_with_a_really_slow_worker_process(small_corpus):
    """R = 2 worker processes, worker 1 3× slower in wall time (it sleeps twice each step's time).
    The margins are by construction. Quorum of 1, H = 1, T = 8: sync waits for 8 slowed steps; a
    quorum round for worker 0 alone, one fast step and the round's messages and outer step, so the
    slow worker's first payload (one slowed step, about 3 such rounds: measured at round 3 of 8 on
    2 busy cores) arrives late. Async, H = 3, T = 3: its slow worker trains H + T − 1 = 5 slowed
    steps (DyLU: 1 a payload after its first) against sync's T·H = 9."""
    from benchmarks.stragglers import Pool, Setting, run_bench

    R, T = 2, 8
    with Pool(small_corpus.train, small_corpus.heldout, R) as pool:
        quorum = Setting(workers=R, inner_steps=1, rounds=T, slow={1: 3.0}, quorum=1)
        modes = run_bench(small_corpus, quorum, ["quorum-discount", "sync", "quorum-drop"], pool)["modes"]
        H, T_async = 3, 3
        dylu = Setting(workers=R, inner_steps=H, rounds=T_async, slow={1: 3.0}, quorum=1)
        timed = run_bench(small_corpus, dylu, ["async", "sync"], pool)["modes"]
    assert list(modes) == ["sync", "quorum-drop", "quorum-discount"] and list(timed) == ["sync", "async"]
    for mode, r in [*modes.items(), *timed.items()]:
        assert math.isfinite(r["final_loss"]), mode
        assert r["curve"][0]["seconds"] == 0 and r["curve"][-1]["seconds"] == r["wall_seconds"]
    for runs in (modes, timed):
        for r in runs.values():
            at_sync = [c["loss"] for c in r["curve"] if c["seconds"] <= runs["sync"]["wall_seconds"]][-1]
            assert r["loss_at_sync_wall"] == at_sync
    payload = 4 * sum(p.numel() for p in tiny_qwen2().parameters())

    sync = modes["sync"]
    assert [(r["aggregated"], r["stragglers"]) for r in sync["rounds"]] == [([0, 1], [])] * T
    assert [w["applied"] for w in sync["workers"]] == [T, T] and sync["bytes_sent"] == R * T * payload

    for mode in ("quorum-drop", "quorum-discount"):
        rounds = modes[mode]["rounds"]
        assert [(r["aggregated"], r["stragglers"]) for r in rounds] == [([0], [1])] * T, mode
        assert modes[mode]["workers"][1]["payloads"] >= 1, mode  # late, but it came
        assert modes[mode]["wall_seconds"] < sync["wall_seconds"], mode

    drop = modes["quorum-drop"]
    assert not any(r["late_applied"] for r in drop["rounds"])
    assert drop["workers"][1]["applied"] == 0 and drop["workers"][1]["dropped"] >= 1
    assert sum(len(r["late_dropped"]) for r in drop["rounds"]) >= 1
    assert drop["workers"][1]["bytes_sent"] == 0  # it saw the global move on and sent no Δ

    discount = modes["quorum-discount"]
    late = [(r, x) for r in discount["rounds"] for x in r["late_applied"]]
    assert late and discount["workers"][1]["applied"] == len(late)
    for r, x in late:
        assert x["worker"] == 1 and x["staleness"] >= 1 and x["factor"] == pytest.approx(1 / (1 + x["staleness"]))
        f = x["factor"]  # the payloads have equal tokens: weights 1 and f, renormalised
        assert r["weights"] == pytest.approx([1 / (1 + f), f / (1 + f)])

    asynchronous = timed["async"]
    assert len(asynchronous["arrivals"]) == R * T_async
    assert [w["applied"] for w in asynchronous["workers"]] == [T_async, T_async]
    fast, slow = (w["steps_per_payload"] for w in asynchronous["workers"])
    assert fast[0] == slow[0] == H and sum(slow[1:]) < sum(fast[1:])  # DyLU
    assert asynchronous["wall_seconds"] < timed["sync"]["wall_seconds"]


def test_dylu_steps_follow_the_measured_speeds():
    from benchmarks.stragglers import dylu_steps

    assert dylu_steps(30, {}, 0) == 30  # not measured yet
    speeds = {0: 10.0, 1: 10 / 3, 2: 0.1}
    assert [dylu_steps(30, speeds, k) for k in (0, 1, 2, 3)] == [30, 10, 1, 30]


def test_a_worker_failure_surfaces_with_its_traceback_and_no_process_outlives_the_pool(small_corpus):
    from benchmarks.stragglers import Pool, WorkerFailed

    with (
        pytest.raises(WorkerFailed, match="unknown message 'nonsense'") as failure,
        Pool(small_corpus.train, small_corpus.heldout, 2) as pool,
    ):
        pool.send(1, "nonsense")
        pool.receive()
    assert "worker 1 failed" in str(failure.value) and "Traceback" in str(failure.value)
    assert not any(p.is_alive() for p in pool.processes)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "isoloco"], "Iso-C aggregates several payloads at once"),
        (["--workers", "4", "--slow", "4:3"], "worker 4 is not one of the 4 workers"),
        (["--quorum", "5"], "--quorum 5"),
    ],
)
def test_the_straggler_bench_refuses_what_it_cannot_run(argv, message):
    from merit.cli import main

    argv = ["bench", "diloco", "--slow", "1:3", *argv] if "--slow" not in argv else ["bench", "diloco", *argv]
    with pytest.raises(SystemExit, match=message):
        main(argv)
