"""DiLoCo rounds SIGKILLed at every boundary of their life, then re-run.

The run is ``pipeline.diloco.loop.run_rounds`` itself on the tiny model; the workers are stand-ins
that publish fabricated payloads as a worker publishes what it saved (``worker.publish``), without
training. A forked child runs it with one function wrapped to SIGKILL the process at a boundary
(a worker publishing, the round's members decided, each part, the assembly, the global renamed,
the record, the clean-up); the test re-runs it and compares with an undisturbed run of the same
payloads. In the killed round worker 2 fails (sync) or is a straggler (quorum), and its payload
is published after the kill: a re-run that decided the round again would aggregate it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import pipeline.diloco.asynchronous as asynchronous
import pipeline.diloco.loop as loop
import pipeline.diloco.rounds as rounds
from pipeline.checkpoint import MANIFEST, is_complete, write_manifest
from pipeline.config import load_config
from pipeline.diloco.compress import compress
from pipeline.diloco.loop import Evaluator, run_rounds
from pipeline.diloco.plan import DilocoPlan, diloco_plan
from pipeline.diloco.rounds import (
    GLOBAL,
    MEMBERS,
    delta_dir,
    global_dir,
    members,
    parts_dir,
    payload_digest,
    records,
    rounds_done,
    send,
)
from pipeline.diloco.worker import PAYLOAD, WorkerJob, next_open_round, publish
from pipeline.merge import CheckpointReader, ModelView
from pipeline.models import init_model

KILLED = 1  # the round killed (sync, quorum): it reads round 0's momentum and writes its own
ARRIVAL = 1  # the arrival killed (async, 2 workers): it closes the first momentum window
LATE = 2  # the worker left out of the killed round, whose payload comes after the kill


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """θ0 (the tiny model) and a data manifest: what a plan needs; no training data."""
    run_dir = tmp_path_factory.mktemp("kills") / "run"
    init_model(load_config(None, ["warmup.steps=0"]), run_dir)
    (run_dir / "data").mkdir()
    (run_dir / "data" / "manifest.json").write_text(json.dumps({"sources": {"s": {"train_examples": 8}}}))
    return run_dir


@pytest.fixture(autouse=True, scope="module")
def heldout_loss():
    """The final global's held-out loss, without a model: the records get one, as the flow's do."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pipeline.eval.score_heldout", lambda *_: {"loss": 2.5, "token_accuracy": 0.5})
        yield


def make_plan(run_dir: Path, folder: Path, mode: str, parts: int = 1) -> tuple:
    """(config, plan) of a variant in ``folder``: 3 workers, 2 rounds, int8 payloads, Iso-C with
    Nesterov momentum (sync, quorum with a quorum of 2); async: 2 workers, 2 payloads each,
    averaging."""
    settings = ["warmup.steps=0", "diloco.rounds=2", "diloco.compression=int8", "diloco.eval_every=0"]
    settings += [f"diloco.aggregators={parts}", f"diloco.workers={2 if mode == 'async' else 3}"]
    settings += {"sync": [], "quorum": ["diloco.sync=quorum", "diloco.quorum=2"], "async": ["diloco.sync=async"]}[mode]
    method = "weighted_average" if mode == "async" else "iso_c"
    settings.append(f"diloco.methods=[{{name: m, method: {method}, outer_lr: 0.7, outer_momentum: 0.9}}]")
    cfg = load_config(None, settings)
    return cfg, diloco_plan(cfg, run_dir, cfg.diloco.methods[0]).model_copy(update={"folder": str(folder)})


@pytest.fixture(scope="module")
def saved(run_dir, tmp_path_factory) -> Callable[[int, int], Path]:
    """``saved(r, k)``: worker k's checkpoint holding its payload of round r (async: its r-th, begun
    from global 2r), as the worker saves it before publishing: int8 Δ of every floating tensor as the model
    holds it."""
    folder, theta = tmp_path_factory.mktemp("saved"), ModelView.open(Path(run_dir) / "init")
    for r in range(2):
        for k in range(3):
            generator, payload = torch.Generator().manual_seed(10 * r + k), {}
            for name, info in theta.loaded().items():
                if info.dtype.is_floating_point:
                    payload |= compress(name, 1e-2 * torch.randn(info.shape, generator=generator), "int8")
            out = folder / str(r) / str(k) / "diloco" / PAYLOAD
            out.mkdir(parents=True)
            save_file(payload, out / "model.safetensors")
            meta = {"tokens": 100 * (k + 1), "seconds": {"inner": 1.0, "load": 0.1}, "base": 2 * r, "steps": [0, 2]}
            write_manifest(out, kind="diloco_delta", round=r, worker=k, **meta)
    return lambda r, k: folder / str(r) / str(k)


def stand_ins(plan: DilocoPlan, saved, fails: tuple[int, ...] = (), publishes: dict | None = None):
    """``launch`` of stand-in workers. Worker k of ``publishes`` {k: (r, ready)} publishes its
    payload r from a thread once ``ready()`` (the aggregator waits for it then), and ends; a worker
    of ``fails`` fails at its first launch; the others have ended already (their payloads are
    published by the test)."""
    failing = set(fails)

    def launch(k: int) -> Future:
        future = Future()
        if k in failing:
            failing.discard(k)
            future.set_exception(RuntimeError(f"worker {k}: training exit code 1"))
        elif publishes and k in publishes:
            r, ready = publishes[k]

            def work():
                while not ready():
                    time.sleep(0.01)
                publish(WorkerJob(plan=plan, index=k), saved(r, k), r)
                future.set_result(None)

            threading.Thread(target=work, daemon=True).start()
        else:
            future.set_result(None)
        return future

    return launch


def bookkept(plan: DilocoPlan, v: int) -> Callable[[], bool]:
    """Whether the aggregator is through global v's bookkeeping (its record, its payloads retired):
    it waits for the next payloads then."""
    return lambda: len(records(plan)) == v and not (Path(plan.folder) / "deltas" / "0").exists()


def in_turn(plan: DilocoPlan):
    """``run_parts``: a round's parts one after another, looked up at each call (so a child's
    wrapper is the one called), so that "after part 0" is a moment."""
    return lambda r, workers: [rounds.aggregate_part(plan, r, workers, s) for s in range(plan.aggregators)]


def publish_all(plan: DilocoPlan, saved, r: int, workers) -> None:
    for k in workers:
        send(saved(r, k) / "diloco" / PAYLOAD, plan, r, k)


def killed(run: Callable[[], None], arm: Callable[[], None]) -> None:
    """``run`` in a forked child with ``arm``'s wrapper in place; returns once the child is
    SIGKILLed at the wrapped boundary (a child that ends otherwise fails the test)."""
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
            arm()
            run()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"not killed at the boundary: {status}"


def kill_before(module, name: str, when: Callable[..., bool]) -> Callable[[], None]:
    """Wrap ``module.name`` to SIGKILL the process when it is called with arguments ``when`` accepts."""

    def arm():
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            if when(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(module, name, wrapped)

    return arm


def kill_after(module, name: str, when: Callable[..., bool]) -> Callable[[], None]:
    """Wrap ``module.name`` to SIGKILL the process once a call ``when`` accepts has returned."""

    def arm():
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            if when(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(module, name, wrapped)

    return arm


def writing(kind: str, **meta) -> Callable[..., bool]:
    """A ``write_manifest`` call of a folder of ``kind`` (its files written, the folder not yet renamed)."""
    return lambda folder, hashes=None, **written: written.get("kind") == kind and meta.items() <= written.items()


# A sync or quorum round: (name, the wrapper, what the kill left on disk), for plan and S.
ROUND_BOUNDARIES = {
    "worker-publishing": (
        lambda plan: kill_before(rounds, "write_manifest", writing("diloco_delta")),
        lambda plan: not is_complete(delta_dir(plan, KILLED, 1)) and not members(plan)[KILLED:],
    ),
    "members-decided": (
        lambda plan: kill_before(rounds, "aggregate_part", lambda plan, r, *_: r == KILLED),
        lambda plan: members(plan)[KILLED]["workers"] == [0, 1] and not parts_dir(plan, KILLED).exists(),
    ),
    "part-0-written": (
        lambda plan: kill_after(rounds, "aggregate_part", lambda plan, r, workers, s, *_: (r, s) == (KILLED, 0)),
        lambda plan: is_complete(parts_dir(plan, KILLED) / "0") and rounds_done(plan) == KILLED,
    ),
    "last-part-writing": (
        lambda plan: kill_before(
            rounds, "write_manifest", writing("diloco_part", round=KILLED + 1, part=plan.aggregators - 1)
        ),
        lambda plan: not is_complete(parts_dir(plan, KILLED) / str(plan.aggregators - 1)),
    ),
    "assembly": (
        lambda plan: kill_before(rounds, "write_manifest", writing("diloco_global", round=KILLED + 1)),
        lambda plan: rounds_done(plan) == KILLED and any((Path(plan.folder) / GLOBAL).glob(f".{KILLED + 1}.tmp-*")),
    ),
    "global-renamed": (
        lambda plan: kill_before(shutil, "rmtree", lambda path, **_: Path(path) == parts_dir(plan, KILLED)),
        lambda plan: rounds_done(plan) == KILLED + 1 and parts_dir(plan, KILLED).exists(),
    ),
    "record": (
        lambda plan: kill_before(Evaluator, "save", lambda self, record: record["round"] == KILLED),
        lambda plan: rounds_done(plan) == KILLED + 1 and len(records(plan)) == KILLED,
    ),
    "clean-up": (
        lambda plan: kill_before(loop, "retire", lambda plan, r: r == KILLED),
        lambda plan: len(records(plan)) == KILLED + 1 and delta_dir(plan, KILLED, 0).exists(),
    ),
}


def run_round_mode(plan, cfg, saved, mode: str, publisher: bool = False):
    """The run of a sync or quorum plan: round 0 of every worker published, round 1 of workers 0
    and 1 (worker 1's by its stand-in, once round 0 is through, with ``publisher``); worker 2 fails
    in round 1 (sync) or is slow (quorum): its round-1 payload is not there."""
    publish_all(plan, saved, 0, range(3))
    publish_all(plan, saved, KILLED, [0] if publisher else [0, 1])
    fails = (LATE,) if mode == "sync" else ()
    launch = stand_ins(plan, saved, fails, {1: (KILLED, bookkept(plan, KILLED))} if publisher else None)
    return lambda: run_rounds(cfg, plan.folder, plan, launch, in_turn(plan))


def arrivals_of(plan, cfg, saved, held: tuple = (), publisher: bool = False):
    """The run of an async plan: payloads (worker, n) published in the order (0, 0), (1, 0),
    (0, 1), (1, 1) (their manifests' times say so), but for those ``held``; with ``publisher``,
    worker 0's stand-in publishes its payload 1 once arrival 1 is through."""
    for t, (k, n) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        if (k, n) not in held:
            published(plan, saved, k, n, when=t)
    launch = stand_ins(plan, saved, publishes={0: (1, bookkept(plan, 2))} if publisher else None)
    return lambda: run_rounds(cfg, plan.folder, plan, launch)


def published(plan, saved, k: int, n: int, when: float) -> None:
    """Worker k's payload n published, as at second ``when``."""
    send(saved(n, k) / "diloco" / PAYLOAD, plan, n, k)
    dated(plan, k, n, when)


def dated(plan, k: int, n: int, when: float) -> None:
    """Worker k's payload n as published at second ``when`` (its manifest's time orders async arrivals)."""
    os.utime(delta_dir(plan, n, k) / MANIFEST, (1e9 + when, 1e9 + when))


def same_run(plan: DilocoPlan, reference: DilocoPlan, but: tuple[str, ...] = ()) -> None:
    """The final global and its momentum equal the reference's bit for bit; the records (but for
    their seconds and the fields ``but``), the members and the arrivals are the same; nothing of
    the rounds is left."""
    for sub in ("", "outer"):
        got = CheckpointReader(global_dir(plan, plan.final) / sub)
        expected = CheckpointReader(global_dir(reference, reference.final) / sub)
        assert got.info.keys() == expected.info.keys() and got.info
        for name in expected.info:
            assert torch.equal(got.get(name), expected.get(name)), (sub, name)

    def timeless(p):
        return [{k: v for k, v in x.items() if k not in ("seconds", *but)} for x in records(p)]

    assert timeless(plan) == timeless(reference) and len(records(plan)) == plan.final
    assert members(plan) == members(reference)
    assert asynchronous.arrivals(plan) == asynchronous.arrivals(reference)
    assert not list((Path(plan.folder) / GLOBAL).glob(".*")) and not list((Path(plan.folder) / "deltas").iterdir())


@pytest.fixture(scope="module")
def reference(run_dir, saved, tmp_path_factory):
    """``reference(mode, S)``: the plan of an undisturbed run, run once."""
    runs = {}

    def of(mode: str, parts: int = 1) -> DilocoPlan:
        if (mode, parts) not in runs:
            cfg, plan = make_plan(run_dir, tmp_path_factory.mktemp(f"{mode}-{parts}"), mode, parts)
            (arrivals_of(plan, cfg, saved) if mode == "async" else run_round_mode(plan, cfg, saved, mode))()
            runs[mode, parts] = plan
        return runs[mode, parts]

    return of


def digest_of(saved_checkpoint: Path) -> str:
    return payload_digest(saved_checkpoint / "diloco" / PAYLOAD)


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("mode", ["sync", "quorum"])
@pytest.mark.parametrize("boundary", list(ROUND_BOUNDARIES))
def test_a_round_killed_at_any_boundary_and_re_run_ends_as_the_undisturbed_run(
    run_dir, saved, reference, tmp_path, boundary, mode, parts
):
    """Killed once its members were decided, the re-run aggregates them, not worker 2's payload
    published since, to the same bits; killed before (a worker publishing), it decides them as
    the killed run would have (worker 2 still failing, or still slow)."""
    cfg, plan = make_plan(run_dir, tmp_path / "run", mode, parts)
    arm, landed = ROUND_BOUNDARIES[boundary]
    publisher = boundary == "worker-publishing"
    killed(run_round_mode(plan, cfg, saved, mode, publisher), arm(plan))
    assert landed(plan), boundary
    if publisher:  # the worker, started again, publishes the payload it had saved
        publish(WorkerJob(plan=plan, index=1), saved(KILLED, 1), KILLED)
    else:  # worker 2, started again, publishes nothing for a round decided without it ...
        publish(WorkerJob(plan=plan, index=LATE), saved(KILLED, LATE), KILLED)
        assert not delta_dir(plan, KILLED, LATE).exists()
        # ... but a straggler's payload can land just after the decision.
        send(saved(KILLED, LATE) / "diloco" / PAYLOAD, plan, KILLED, LATE)
    fails = (LATE,) if publisher and mode == "sync" else ()
    run_rounds(cfg, plan.folder, plan, stand_ins(plan, saved, fails), in_turn(plan))
    same_run(plan, reference(mode, parts))
    record = records(plan)[KILLED]
    assert record["workers"] == [0, 1] and record["heldout_loss"] == 2.5
    assert (
        record["digests"] == members(plan)[KILLED]["digests"] == {str(k): digest_of(saved(KILLED, k)) for k in (0, 1)}
    )
    if mode == "sync":
        assert (record["failures"], record["stragglers"]) == ({"2": "worker 2: training exit code 1"}, [])
    else:
        assert (record["failures"], record["stragglers"]) == ({}, [LATE])


ARRIVAL_BOUNDARIES = {
    "worker-publishing": (
        kill_before(rounds, "write_manifest", writing("diloco_delta")),
        lambda plan: rounds_done(plan) == 2 and not is_complete(delta_dir(plan, 1, 0)),
    ),
    "arrival-recorded": (
        kill_before(loop, "apply_arrival", lambda plan, v, *_, **__: v == ARRIVAL),
        lambda plan: len(asynchronous.arrivals(plan)) == ARRIVAL + 1 and rounds_done(plan) == ARRIVAL,
    ),
    "global-and-momentum-writing": (
        kill_before(asynchronous, "write_manifest", writing("diloco_global", round=ARRIVAL + 1)),
        lambda plan: rounds_done(plan) == ARRIVAL and any((Path(plan.folder) / GLOBAL).glob(f".{ARRIVAL + 1}.tmp-*")),
    ),
    "record": (
        kill_before(Evaluator, "save", lambda self, record: record["round"] == ARRIVAL),
        lambda plan: rounds_done(plan) == ARRIVAL + 1 and len(records(plan)) == ARRIVAL,
    ),
    "clean-up": (
        kill_before(loop, "retire_arrivals", lambda plan, v, schedule: v == ARRIVAL),
        lambda plan: len(records(plan)) == ARRIVAL + 1 and delta_dir(plan, 0, 0).exists(),
    ),
    "payload-retired-halfway": (  # renamed out of sight, not yet deleted
        kill_before(shutil, "rmtree", lambda path, **_: Path(path).name.endswith(".retired") and Path(path).exists()),
        lambda plan: any((Path(plan.folder) / "deltas" / "0").glob(".*.retired")),
    ),
}


@pytest.mark.parametrize("boundary", list(ARRIVAL_BOUNDARIES))
def test_an_arrival_killed_at_any_boundary_and_re_run_ends_as_the_undisturbed_run(
    run_dir, saved, reference, tmp_path, boundary
):
    """Killed once arrival 1 (worker 1's first payload, closing the first momentum window) was
    recorded, the re-run applies it even though worker 0's second payload, published since, looks
    older; the arrivals weigh 1 / R each (equal weighting, async's default)."""
    cfg, plan = make_plan(run_dir, tmp_path / "run", "async")
    arm, landed = ARRIVAL_BOUNDARIES[boundary]
    publisher = boundary == "worker-publishing"
    killed(arrivals_of(plan, cfg, saved, held=((0, 1), (1, 1)) if publisher else ((0, 1),), publisher=publisher), arm)
    assert landed(plan), boundary
    if publisher:  # worker 0, started again, publishes the payload it had saved; then worker 1
        publish(WorkerJob(plan=plan, index=0), saved(1, 0), 1)
        dated(plan, 0, 1, when=2)
        published(plan, saved, 1, 1, when=3)
    else:
        published(plan, saved, 0, 1, when=0.5)  # before worker 1's first: the next arrival, if chosen again
    run_rounds(cfg, plan.folder, plan, stand_ins(plan, saved))
    same_run(plan, reference("async"))
    applied = asynchronous.arrivals(plan)
    assert [(a.worker, a.payload, a.weight) for a in applied] == [(0, 0, 0.5), (1, 0, 0.5), (0, 1, 0.5), (1, 1, 0.5)]
    assert [a.digest for a in applied] == [digest_of(saved(a.payload, a.worker)) for a in applied]
    assert [r["digests"] for r in records(plan)] == [{str(a.worker): a.digest} for a in applied]


@pytest.mark.parametrize("parts", [1, 3])
def test_the_parts_may_change_in_number_between_a_killed_run_and_its_re_run(run_dir, saved, reference, tmp_path, parts):
    """diloco.aggregators is not in the plan's digest: killed with part 0 of 2 written, re-run
    with S = 1 or 3, the round's parts are made again (a part is of its split), to the same bits."""
    cfg, plan = make_plan(run_dir, tmp_path / "run", "sync", 2)
    arm, _ = ROUND_BOUNDARIES["part-0-written"]
    killed(run_round_mode(plan, cfg, saved, "sync"), arm(plan))
    cfg, plan = make_plan(run_dir, tmp_path / "run", "sync", parts)
    run_rounds(cfg, plan.folder, plan, stand_ins(plan, saved), in_turn(plan))
    # The record tells the split (the aggregators, what the busiest one read) and sums the drift's
    # Gram matrix over the parts: float64 sums of the 56 tensors' products in another order, each
    # within 56 float64 ulps (6e-15 relative) of the other; cosines (at most 1) to the same.
    same_run(plan, reference("sync", 2), but=("aggregators", "bytes", "delta_norms", "mean_cosine"))
    got, expected = records(plan)[KILLED], records(reference("sync", 2))[KILLED]
    assert got["aggregators"] == parts and got["bytes"]["sent"] == expected["bytes"]["sent"]
    assert got["delta_norms"] == pytest.approx(expected["delta_norms"], rel=1e-12, abs=0)
    assert got["mean_cosine"] == pytest.approx(expected["mean_cosine"], rel=0, abs=1e-12)
    assert len(CheckpointReader(global_dir(plan, 2)).files) == parts


def test_a_part_of_other_members_is_made_again_and_a_changed_payload_refused(run_dir, saved, reference, tmp_path):
    """A complete part 0 of workers [0, 1, 2] on disk (written before members were recorded) is
    not reused for members [0, 1]; a payload changed after its round was decided stops the run,
    named, rather than aggregating something else than was decided."""
    cfg, plan = make_plan(run_dir, tmp_path / "run", "sync", 2)
    arm, _ = ROUND_BOUNDARIES["members-decided"]
    killed(run_round_mode(plan, cfg, saved, "sync"), arm(plan))
    send(saved(KILLED, LATE) / "diloco" / PAYLOAD, plan, KILLED, LATE)
    record = Path(plan.folder) / MEMBERS
    decided = record.read_text()
    with pytest.raises(RuntimeError, match=r"asked to aggregate workers \[0, 1, 2\], but the round's members"):
        rounds.aggregate_part(plan, KILLED, [0, 1, 2], 0)
    record.unlink()
    rounds.aggregate_part(plan, KILLED, [0, 1, 2], 0)
    record.write_text(decided)
    run_rounds(cfg, plan.folder, plan, stand_ins(plan, saved), in_turn(plan))
    same_run(plan, reference("sync", 2))

    cfg, plan = make_plan(run_dir, tmp_path / "changed", "sync", 2)
    killed(run_round_mode(plan, cfg, saved, "sync"), arm(plan))
    shutil.rmtree(delta_dir(plan, KILLED, 1))
    send(saved(0, 1) / "diloco" / PAYLOAD, plan, KILLED, 1)
    with pytest.raises(RuntimeError, match=r"records worker 1's payload .* and .*deltas/1/1 holds another"):
        run_rounds(cfg, plan.folder, plan, stand_ins(plan, saved), in_turn(plan))
    assert rounds.aborted(plan) is not None  # the workers are told


def test_a_worker_started_again_skips_the_rounds_decided_without_it(run_dir, tmp_path):
    _, plan = make_plan(run_dir, tmp_path / "run", "sync")
    global_dir(plan, 1).mkdir(parents=True)
    (global_dir(plan, 1) / MANIFEST).write_text("{}")
    (Path(plan.folder) / MEMBERS).write_text(json.dumps([{"round": 1, "workers": [0, 1], "digests": {}}]))
    assert next_open_round(plan, 0, 1, timeout_s=0) == 1
    with pytest.raises(TimeoutError, match="no global weights of round 2"):
        next_open_round(plan, 2, 1, timeout_s=0)
