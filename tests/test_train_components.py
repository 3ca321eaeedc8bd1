"""The trainer's components on their own: the data order, the prefetching loader, the loss
without full-vocabulary logits, and the budget a spec resolves."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import small_config

from calibration.split import SplitPlan
from merit.cli import main as merit
from pipeline.config import load_config
from pipeline.data import Collator, Encoder, load_sources
from pipeline.models import load_model
from pipeline.models.loss import mean_nll, supervised_nll
from pipeline.train import BranchSpec
from pipeline.train.launch import BranchFailed
from pipeline.train.loader import StepBatches, step_batches
from pipeline.train.packing import PackOrder, first_fit
from pipeline.train.plan import all_sources, group_specs, joint_spec
from pipeline.train.sampling import BatchOrder, BranchData

ROOT = Path(__file__).parent.parent
SOURCES = ["colour_name", "add_digits", "caption"]


def test_an_epoch_draws_every_example_once_and_the_order_is_a_function_of_the_step():
    order = BatchOrder(10, seed=3)
    first_epoch = np.concatenate([order.global_batch(s, 5) for s in range(2)])
    assert sorted(first_epoch.tolist()) == list(range(10))  # without replacement
    spanning = order.global_batch(1, 6)  # positions 6..11: the end of epoch 0, the start of epoch 1
    assert spanning[:4].tolist() == first_epoch[6:].tolist() and len(set(spanning[4:])) == 2
    assert np.array_equal(BatchOrder(10, seed=3).global_batch(7, 4), order.global_batch(7, 4))  # no state
    assert not np.array_equal(BatchOrder(10, seed=4).global_batch(0, 10), first_epoch)
    ranks = [order.rank_batches(2, micro_batch=2, grad_accum=2, rank=r, world=2) for r in range(2)]
    together = np.concatenate([b for m in range(2) for b in (ranks[0][m], ranks[1][m])])
    assert np.array_equal(together, order.global_batch(2, 8))  # the ranks split the step's examples


def test_first_fit_puts_each_example_in_the_first_micro_batch_with_room():
    packs = first_fit(np.array([60, 50, 40, 30, 20, 90]), budget=100)
    assert [p.tolist() for p in packs] == [[0, 2], [1, 3, 4], [5]]


def test_packed_epochs_hold_every_example_once_within_the_budget_and_resume_on_the_same_batches():
    lengths = np.random.default_rng(0).integers(5, 60, size=500)
    order = PackOrder(lengths, budget=100, window=64, seed=3)
    for epoch in range(2):
        packs = order.epoch(epoch)
        assert sorted(np.concatenate(packs).tolist()) == list(range(500))  # each example exactly once
        assert max(lengths[p].sum() for p in packs) <= 100
        assert lengths.sum() / (100 * len(packs)) > 0.9  # first-fit over windows leaves little room unused
    assert [p.tolist() for p in order.epoch(0)] != [p.tolist() for p in order.epoch(1)]  # a new draw each epoch
    per_epoch = order.per_epoch()
    spanning = order.micro_batches(per_epoch - 1, 2)  # the last of epoch 0, the first of epoch 1
    assert [p.tolist() for p in spanning] == [order.epoch(0)[-1].tolist(), order.epoch(1)[0].tolist()]
    ranks = [order.rank_batches(5, grad_accum=2, rank=r, world=2) for r in range(2)]
    assert [p.tolist() for m in range(2) for p in (ranks[0][m], ranks[1][m])] == [
        p.tolist() for p in order.micro_batches(20, 4)
    ]
    resumed = PackOrder(lengths, budget=100, window=64, seed=3)  # a restarted process: no sampler state
    steps = range(3 * per_epoch // 2 - 2, 3 * per_epoch // 2 + 2)  # mid-epoch 1, and across into epoch 2
    assert all(
        [p.tolist() for p in resumed.rank_batches(s, 1, 0, 1)] == [p.tolist() for p in order.rank_batches(s, 1, 0, 1)]
        for s in steps
    )
    other = PackOrder(lengths, budget=100, window=64, seed=4)
    assert [p.tolist() for p in other.epoch(0)] != [p.tolist() for p in order.epoch(0)]
    with pytest.raises(ValueError, match="an example of 60 tokens does not fit a micro batch of 50"):
        PackOrder(np.array([10, 60]), budget=50, window=8, seed=0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("components")
    settings = ["--set", "data.builtin.examples_per_source=20", "--set", "warmup.steps=0"]
    assert merit(["init", str(ROOT / "configs/demo.yaml"), "--run-dir", str(run), *settings]) == 0
    assert merit(["prepare", "--run-dir", str(run)]) == 0
    return run


def spec(run_dir: Path, *overrides: str, sources=SOURCES) -> BranchSpec:
    """A padded branch (``train.packing=true`` among the overrides: a packed one)."""
    settings = ["train.packing=false", "train.micro_batch=4", "train.grad_accum=2", *overrides]
    cfg = load_config(run_dir / "config.yaml", settings)
    init = str(run_dir / "init")
    return BranchSpec(
        name="b", run_dir=str(run_dir), init=init, sources=sources, out_dir=str(run_dir / "b"), config=cfg
    )


def test_epochs_resolve_into_steps_over_the_branch_data_and_the_joint_baseline_gets_all_of_it(run_dir):
    branch = spec(run_dir, "train.epochs=2")
    assert branch.examples() == 3 * 18  # 20 per source, 2 held out
    assert branch.train.steps == -(-2 * 54 // 8)  # ceil(epochs × examples / global batch)
    assert spec(run_dir, "train.steps=5").train.steps == 5  # steps override epochs
    assert BranchSpec.model_validate_json(branch.model_dump_json()).digest() == branch.digest()

    cfg = load_config(run_dir / "config.yaml", ["train.packing=false", "train.micro_batch=4", "train.grad_accum=2"])
    everything = all_sources(run_dir)  # 18 sources of 18 training examples
    SplitPlan([everything[:12], everything[12:]], [1, 1], 1, [1.0], "pca", 0).save(
        run_dir / "calibration" / "split.json"
    )
    groups, joint = group_specs(cfg, run_dir), joint_spec(cfg, run_dir)
    assert [g.train.steps for g in groups] == [-(-12 * 18 // 8), -(-6 * 18 // 8)]  # one epoch of each group
    assert joint.sources == everything and joint.train.steps == -(-18 * 18 // 8)  # one epoch of all the data
    steps = load_config(run_dir / "config.yaml", ["train.steps=3"])
    assert joint_spec(steps, run_dir).train.steps == 2 * 3  # K × steps with the override


def test_packed_epochs_resolve_into_steps_of_packed_micro_batches(run_dir, processor):
    branch = spec(run_dir, "train.packing=true", "train.max_tokens=300", "train.epochs=2")
    data = BranchData.for_branch(branch, processor)
    lengths = np.array([len(ex.token_ids) for ex in data.examples])
    assert np.array_equal(branch.lengths(), lengths)  # the spec's counts, from the token cache alone
    per_epoch = PackOrder(lengths, 300, branch.train.packing_window, seed=0).per_epoch()
    assert branch.train.steps == -(-2 * per_epoch // 2)  # ceil(epochs × micro batches / (accumulation × ranks))
    batches = [data.micro_batches(s) for s in range(branch.train.steps)]
    assert all(len(b) == 2 for b in batches)  # grad_accum packed micro batches a step
    seen = [id(ex) for step in batches[: per_epoch // 2] for micro in step for ex in micro]
    assert len(seen) == len(set(seen))  # within an epoch, no example twice
    too_small = spec(run_dir, "train.packing=true", "train.max_tokens=40", "train.steps=1")
    with pytest.raises(
        ValueError, match=r"source 'colour_name' has \d+ training example\(s\) over train.max_tokens = 40"
    ):
        too_small.validate_inputs()


@pytest.mark.parametrize("packing", ["false", "true"])
def test_prefetching_workers_give_the_same_batches_and_a_resumed_loader_starts_at_its_step(run_dir, processor, packing):
    branch = spec(run_dir, "train.steps=4", f"train.packing={packing}", "train.max_tokens=300")
    data = BranchData.for_branch(branch, processor)
    inline = list(step_batches(StepBatches(data, branch.train, 0, 1), 0, pin_memory=False))
    workers = branch.train.model_copy(update={"loader_workers": 2})
    prefetched = list(step_batches(StepBatches(data, workers, 0, 1), 0, pin_memory=False))
    resumed = list(step_batches(StepBatches(data, branch.train, 0, 1), 2, pin_memory=False))
    assert [b.step for b in inline] == [0, 1, 2, 3] and [b.step for b in resumed] == [2, 3]
    for a, b in [*zip(inline, prefetched), *zip(inline[2:], resumed)]:
        assert (a.tokens, a.supervised, a.examples, len(a.micro)) == (b.tokens, b.supervised, b.examples, 2)
        for x, y in zip(a.micro, b.micro):
            assert x.keys() == y.keys() and all(
                torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x
            )
    one = inline[0]
    rows = sum(m["input_ids"].shape[0] for m in one.micro)
    assert rows == (2 if packing == "true" else 8) and one.positions == sum(m["input_ids"].numel() for m in one.micro)
    assert (one.positions == one.tokens) == (packing == "true")  # a packed row has no padding
    two_ranks = StepBatches(data, branch.train, 1, 2)[0]  # rank 1 of 2: a filler image where none
    assert all("pixel_values" in m for m in two_ranks.micro)
    assert two_ranks.supervised == [len(m["loss_positions"]) for m in two_ranks.micro]
    answers = [sum(e.num_supervised for e in data.encoder.encode_batch(g)) for g in data.micro_batches(0, 1, 2)]
    assert two_ranks.supervised == answers  # the filler adds no label


@pytest.fixture(scope="module")
def batch(tiny_run, processor):
    examples = load_sources(small_config().data, 0).examples
    chosen = [examples["caption"][0], examples["add_digits"][1], examples["colour_name"][2]]
    return Collator(processor.tokenizer.pad_token_id)(Encoder(processor, 256).encode_batch(chosen))


def test_the_loss_without_full_logits_equals_the_models_own_in_value_and_gradient(tiny_run, batch):
    cfg, run_dir = tiny_run
    model = load_model(run_dir / "init", cfg.model)
    own = model(**batch).loss
    own.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    supervised = int((batch["labels"][:, 1:] != -100).sum())
    for chunk, pieces in ((1024, None), (7, None), (1024, 5)):  # one projection; parts recomputed in backward
        model.zero_grad()
        nll, count = supervised_nll(model, batch, chunk=chunk, pieces=pieces)
        assert count == supervised
        torch.testing.assert_close(nll / count, own, rtol=1e-5, atol=1e-6)
        (nll / count).backward()
        for name, grad in reference.items():
            torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(mean_nll(model, batch), own, rtol=1e-5, atol=1e-6)
    nothing = torch.zeros(0, dtype=torch.long)
    unsupervised = {**batch, "loss_positions": nothing, "loss_targets": nothing}
    for pieces in (None, 3):  # a rank without answers still projects as often as the others
        nll, count = supervised_nll(model, unsupervised, pieces=pieces)
        assert count == 0 and nll.item() == 0 and nll.requires_grad  # still part of the graph


TORCHRUN_REPORT = """Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 11)
  traceback : Signal 15 (SIGTERM) received by PID 11
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : {code} (pid: 10)
  traceback : {why}
============================================================
"""


def test_a_failed_branch_is_killed_only_when_its_first_failing_rank_was(tmp_path):
    """torchrun stops the other ranks with SIGTERM after the first one fails: that is no kill."""
    log = tmp_path / "train.log"
    log.write_text(TORCHRUN_REPORT.format(code=1, why="To enable traceback see: https://pytorch.org"))
    failed = BranchFailed("0", 1, log)
    assert not failed.killed and "exit code 1" in str(failed)
    log.write_text(TORCHRUN_REPORT.format(code=-9, why="Signal 9 (SIGKILL) received by PID 10"))
    assert BranchFailed("0", 1, log).killed and "killed (SIGKILL)" in str(BranchFailed("0", 1, log))
    assert BranchFailed("0", -9, tmp_path / "none.log").killed  # one rank, no launcher: the exit code
