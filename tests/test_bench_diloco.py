"""``merit bench diloco``'s building blocks: the stdlib corpus and its file-level split, and one
round of plain averaging, checked against the workers' weights averaged by hand; ``merit bench
aggregators``' bytes against their arithmetic; ``merit bench diloco --slow``'s sync modes with a
really slow worker process, and its servers against the library's rounds."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from merit.bench.diloco import (
    CLIP,
    CONTEXT,
    EOD,
    MAX_FILE_BYTES,
    METHODS,
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
    from merit.bench.diloco import LoraLearner

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
    optimizer = learner.optimizers[0]
    states = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
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

    learner.optimizers[0].register_step_pre_hook(before_step)
    batch = torch.randint(0, EOD + 1, (2, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    norms = learner.train([batch, batch])
    assert min(norms) > 10 * CLIP and seen == pytest.approx([CLIP, CLIP], rel=1e-4)


def test_a_muon_learner_steps_the_hidden_matrices_with_torchs_muon_and_the_rest_with_adamw():
    """MuLoCo's workers: torch's Muon on the tensors the trainer gives DeepSpeed's Muon, AdamW on the
    embeddings, lm_head and norms; no clipping (the step of a Muon matrix is its lr, whatever the
    gradient's norm), every tensor moved by a step."""
    model = tiny_qwen2(size="0.13M")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner = Learner(model, steps=4, inner="muon")
    muon, adamw = learner.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    took = sorted(names[id(p)] for p in muon.param_groups[0]["params"])
    assert took == sorted(n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("model.layers."))
    assert {names[id(p)] for p in adamw.param_groups[0]["params"]} >= {"model.embed_tokens.weight", "lm_head.weight"}
    batch = torch.randint(0, EOD + 1, (2, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # gradients far above the trainer's clip
    before["lm_head.weight"] = model.lm_head.weight.detach().clone()
    assert learner.train([batch])[0] > 10 * CLIP
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    # Muon's step on a matrix: lr × √max(1, rows/cols) × an orthogonal matrix, after weight decay
    weight = model.get_parameter(took[0])
    step = (before[took[0]] * (1 - muon.param_groups[0]["lr"] * 0.1) - weight.detach()) / muon.param_groups[0]["lr"]
    singular = torch.linalg.svdvals(step / math.sqrt(max(1, step.shape[0] / step.shape[1])))
    assert singular.min() > 0.5 and singular.max() < 1.5  # Newton–Schulz's approximate orthogonality


def test_a_global_batch_is_split_among_the_workers_whatever_r():
    """Every method sees the same windows in the same steps: worker k of R takes the k-th, (k + R)-th,
    … of the step's G windows, so the R shares of a step are the data-parallel step's batch."""
    from merit.bench.diloco_scale import global_batches, worker_batches

    G, n = 16, 100
    steps = [b for _, b in zip(range(9), global_batches(n, G, seed=0))]  # past one epoch (6 steps)
    assert all(len(set(b.tolist())) == G for b in steps)
    for R in (1, 4, 16):
        shares = [list(zip(range(9), worker_batches(n, G, R, k, seed=0))) for k in range(R)]
        for step, batch in enumerate(steps):
            parts = [shares[k][step][1] for k in range(R)]
            assert all(len(p) == G // R for p in parts)
            assert sorted(torch.cat(parts).tolist()) == sorted(batch.tolist())


def test_the_hybrid_averages_the_embeddings_and_isoc_merges_the_rest():
    from merit.bench.diloco import HYBRID
    from pipeline.merge import merge_state_dicts
    from pipeline.merge.linalg import iso

    model = tiny_qwen2(size="0.13M")
    g = torch.Generator().manual_seed(0)
    deltas = [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(3)]
    merged = merge_state_dicts(deltas, [1.0] * 3, list(HYBRID))
    mean = {n: sum(d[n] for d in deltas) / 3 for n in deltas[0]}
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        torch.testing.assert_close(merged[name], mean[name], rtol=1e-6, atol=1e-6)
    name = "model.layers.0.self_attn.q_proj.weight"
    exact = iso(mean[name], "svd")
    assert torch.linalg.norm(merged[name] - exact) <= 1e-5 * torch.linalg.norm(exact)  # fp32 SVD's rounding
    assert not torch.allclose(merged[name], mean[name], atol=1e-3)


def test_scale_cells_are_saved_skipped_when_rerun_and_a_folder_of_another_setting_is_refused(small_corpus, tmp_path):
    from merit.bench.diloco_scale import check_folder, run_cells, setting, write_results

    args = SimpleNamespace(model="0.13M", global_batch=4, steps=2)
    model0 = tiny_qwen2(size="0.13M")
    wanted = setting(args, small_corpus, sum(p.numel() for p in model0.parameters()))
    check_folder(tmp_path, wanted)
    todo = [("dp", 1, 1), ("dp-muon", 1, 1), ("diloco", 2, 1), ("hybrid", 2, 2), ("muloco", 2, 1)]
    cells = run_cells(tmp_path, todo, model0, small_corpus, args)
    assert sorted(cells) == ["diloco-R2-H1", "dp", "dp-muon", "hybrid-R2-H2", "muloco-R2-H1"]
    assert [len(cells[n]["curve"]) for n in ("diloco-R2-H1", "hybrid-R2-H2")] == [2, 1]  # T = steps / H
    saved = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").iterdir()}
    again = run_cells(tmp_path, [*todo, ("isoloco", 2, 1)], model0, small_corpus, args)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").iterdir() if p.name in saved} == saved
    assert sorted(again) == ["diloco-R2-H1", "dp", "dp-muon", "hybrid-R2-H2", "isoloco-R2-H1", "muloco-R2-H1"]
    text = write_results(tmp_path, wanted, again)
    results = json.loads((tmp_path / "results.json").read_text())
    dp = results["baselines"]["dp"]["final_loss"]
    muon = results["baselines"]["dp-muon"]["final_loss"]
    for row in results["cells"]:
        assert row["vs_dp_percent"] == pytest.approx(100 * (row["final_loss"] - dp) / dp)
        assert row.get("vs_dp_muon_percent") == (
            pytest.approx(100 * (row["final_loss"] - muon) / muon) if row["method"] == "muloco" else None
        )
    assert "| diloco |" in text and (tmp_path / "degradation_vs_R.png").stat().st_size > 5_000
    check_folder(tmp_path, wanted)  # the same setting: accepted
    with pytest.raises(SystemExit, match="differs in steps"):
        check_folder(
            tmp_path,
            setting(SimpleNamespace(model="0.13M", global_batch=4, steps=4), small_corpus, wanted["parameters"]),
        )


def test_bench_aggregators_measures_a_share_of_every_payload_per_aggregator(tmp_path, capsys):
    """One aggregator reads every payload twice, θ and the momentum: (2R + 2) payloads' bytes
    (fp32, every tensor trained); S aggregators each about 1/S of it."""
    from merit.bench.aggregators import main

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
    from merit.bench.stragglers import Pool, Setting, run_bench

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

    sync = modes["sync"]  # every round takes all R payloads, a quorum round the first Q = 1
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
    assert [a["weight"] for a in asynchronous["arrivals"]] == [1 / R] * (R * T_async)  # the library's default
    assert all(a["staleness"] == i - a["base"] >= 0 for i, a in enumerate(asynchronous["arrivals"]))
    assert [w["applied"] for w in asynchronous["workers"]] == [T_async, T_async]
    fast, slow = (w["steps_per_payload"] for w in asynchronous["workers"])
    assert fast[0] == slow[0] == H and sum(slow[1:]) < sum(fast[1:])  # DyLU
    assert asynchronous["wall_seconds"] < timed["sync"]["wall_seconds"]


def fed_payloads(theta: dict[str, torch.Tensor], *arrivals: tuple[int, int, int, float]) -> list[tuple[dict, dict]]:
    """(Δ, the message a worker sends) of each (worker, base global, tokens, inner seconds): a random
    Δ of θ's shapes, uncompressed, 100 tokens a step."""
    from merit.bench.stragglers import pack

    g, fed = torch.Generator().manual_seed(len(arrivals)), []
    for n, (k, base, tokens, seconds) in enumerate(arrivals):
        delta = {name: 0.1 * torch.randn(t.shape, generator=g) for name, t in theta.items()}
        message = {"worker": k, "n": n, "base": base, "steps": tokens // 100, "tokens": tokens}
        fed.append((delta, message | {"delta": pack(delta), "bytes": 4, "inner_seconds": seconds}))
    return fed


def test_the_straggler_bench_takes_payloads_weighs_and_steps_as_the_librarys_rounds():
    """The bench's servers, fed payloads in-process (R = 3, Q = 2, T = 2). A quorum round closes at
    the Q-th payload from its global and takes those in worker order, weighted by tokens: θ and the
    momentum bit for bit those of the library's ``aggregate_deltas`` with ``RoundPolicy``'s weights.
    A late payload is dropped (its worker sent the newest global at once) or, discounted, enters the
    next round at 1 / (1 + staleness). Async: every arrival applied by ``AsyncOuter`` (1 / R each),
    the steps of a worker's next payload ``RoundPolicy.local_steps`` of the measured speeds."""
    from merit.bench.stragglers import ArrivalServer, RoundServer, Setting
    from pipeline.diloco.aggregate import AsyncOuter, aggregate_deltas
    from pipeline.diloco.policy import RoundPolicy

    g = torch.Generator().manual_seed(0)
    theta0 = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}
    setting = Setting(workers=3, inner_steps=4, rounds=2, slow={}, quorum=2)
    method = METHODS[setting.method]
    assert setting.policy("sync") == RoundPolicy(3, 4, None, "tokens")
    assert setting.policy("quorum-drop") == setting.policy("quorum-discount") == RoundPolicy(3, 4, 2, "tokens")
    assert setting.policy("async") == RoundPolicy(3, 4, None, "equal")
    # Round 0: workers 2 and 0 (worker 1 a straggler); round 1: worker 1's late payload, then 0 and 1.
    fed = fed_payloads(theta0, (2, 0, 300, 1.0), (0, 0, 100, 1.0), (1, 0, 200, 1.0), (0, 1, 100, 1.0), (1, 1, 200, 1.0))
    (d2, _), (d0, _), _, (e0, _), (e1, _) = fed

    drop = RoundServer(setting, "quorum-drop", theta0, clock=lambda: 0.0)
    assert [drop.take(p) for _, p in fed] == [[], [(0, 4), (2, 4)], [(1, 4)], [], []]
    theta, momentum = {n: t.clone() for n, t in theta0.items()}, {}
    for deltas, tokens in [([d0, d2], [100, 300]), ([e0, e1], [100, 200])]:
        weights = RoundPolicy(3, 4, 2).weights(tokens)
        aggregate_deltas(theta, deltas, weights, list(method.rules), method.outer, momentum, sent=0)
    assert all(torch.equal(drop.theta[n], theta[n]) and torch.equal(drop.momentum[n], momentum[n]) for n in theta)
    assert [(r["aggregated"], r["stragglers"]) for r in drop.rounds] == [([0, 2], [1]), ([0, 1], [2])]
    assert drop.rounds[1]["late_dropped"] == [{"worker": 1, "base": 0, "arrived_at_version": 1}]
    assert drop.rounds[0]["weights"] == pytest.approx([0.25, 0.75]) and drop.done
    assert [(s.payloads, s.applied, s.dropped) for s in drop.stats] == [(2, 2, 0), (2, 1, 1), (1, 1, 0)]

    discount = RoundServer(setting, "quorum-discount", theta0, clock=lambda: 0.0)
    for _, p in fed:
        discount.take(p)
    (x,) = discount.rounds[1]["late_applied"]
    assert x == {"worker": 1, "base": 0, "staleness": 1, "factor": 0.5}
    assert discount.rounds[1]["weights"] == pytest.approx([100 / 400, 200 / 400, 100 / 400])  # 200 tokens × 1/2
    assert [s.applied for s in discount.stats] == [2, 2, 1]

    sync = RoundServer(setting, "sync", theta0, clock=lambda: 0.0)
    assert [sync.take(p) for _, p in fed[:3]] == [[], [], [(0, 4), (1, 4), (2, 4)]]  # all R

    arrivals = ArrivalServer(setting, "async", theta0, clock=lambda: 0.0)
    timed = fed_payloads(theta0, (0, 0, 400, 1.0), (1, 0, 400, 4.0), (0, 1, 400, 1.0), (2, 0, 400, 2.0))
    sends = [arrivals.take(p) for _, p in timed]
    theta = {n: t.clone() for n, t in theta0.items()}
    outer = AsyncOuter(theta, method.outer, window=3)
    expected = [outer.apply(d, 400) for d, _ in timed]
    assert [a["weight"] for a in arrivals.arrivals] == expected == [1 / 3] * 4
    assert all(torch.equal(arrivals.theta[n], theta[n]) for n in theta)
    assert [a["staleness"] for a in arrivals.arrivals] == [0, 1, 1, 3]
    # Speeds 4, 1, 4, 2 steps a second: worker 1 at a quarter of the fastest, worker 2 at half.
    assert sends == [[(0, 4)], [(1, 1)], [], [(2, 2)]]  # worker 0 has sent its T = 2


def test_a_worker_failure_surfaces_with_its_traceback_and_no_process_outlives_the_pool(small_corpus):
    from merit.bench.stragglers import Pool, WorkerFailed

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
