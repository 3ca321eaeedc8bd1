"""Diagnostics of a run's weights on real tiny checkpoints: the loss barrier between branches
(none between identical models, some between models trained apart from a random start), the
distance from θ0 against torch's own norm, and diagnostics.json written and reused."""

import json
import shutil

import pytest
import torch
from test_eval_accuracy import TRAINED, tiny_run, train, with_eval

from pipeline.checkpoint import save_pretrained_checkpoint
from pipeline.data import load_split
from pipeline.eval import diagnose
from pipeline.eval import diagnostics as diagnostics_module
from pipeline.eval.diagnostics import distance, loss_barrier
from pipeline.eval.heldout import Heldout, source_roles
from pipeline.layout import CALIBRATION, DIAGNOSTICS, EVAL, branch_dir
from pipeline.models import load_model, load_processor


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("diagnostics-run")
    return tiny_run(run_dir, "eval.device=cpu", "eval.barrier_points=3"), run_dir


@pytest.fixture(scope="module")
def branches(run):
    """Two branches trained apart from the random θ0: both learn the held-out examples by heart
    (so each sits at a near-zero loss) along with a different source's training examples."""
    cfg, run_dir = run
    init = str(run_dir / "init")
    heldout = [ex for items in load_split(cfg, run_dir, "heldout", TRAINED).values() for ex in items]
    own = load_split(cfg, run_dir, "train", TRAINED)
    processor = load_processor(init, cfg.model)
    for k, src in enumerate(TRAINED):
        model = train(cfg, init, heldout + list(own[src]), steps=500, lr=1e-3)
        save_pretrained_checkpoint(branch_dir(run_dir, k) / "final", model, processor)
    (run_dir / CALIBRATION).mkdir(exist_ok=True)
    (run_dir / CALIBRATION / "split.json").write_text(json.dumps({"groups": [[src] for src in TRAINED]}))
    return {k: str(branch_dir(run_dir, k) / "final") for k in range(len(TRAINED))}


def trained_heldout(cfg, run_dir) -> Heldout:
    return Heldout.load(cfg, run_dir, source_roles(run_dir)).trained()


def test_no_barrier_between_identical_models(run):
    cfg, run_dir = run
    init = str(run_dir / "init")
    result = loss_barrier(cfg, trained_heldout(cfg, run_dir), {0: init, 1: init})
    assert result["alphas"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    (pair,) = result["pairs"]
    assert pair["branches"] == [0, 1] and len(pair["losses"]) == 5
    assert max(pair["losses"]) - min(pair["losses"]) <= 1e-6
    assert abs(pair["barrier"]) <= 1e-6 and abs(result["barrier"]) <= 1e-6


def test_a_barrier_between_models_trained_apart(run, branches):
    cfg, run_dir = run
    result = loss_barrier(cfg, trained_heldout(cfg, run_dir), branches)
    (pair,) = result["pairs"]
    start, *middle, end = pair["losses"]
    assert max(start, end) < 0.05  # both branches know the held-out examples
    assert pair["barrier"] == pytest.approx(
        max(loss - ((1 - a) * start + a * end) for a, loss in zip(result["alphas"], pair["losses"]))
    )
    assert pair["barrier"] > 0.02 and max(middle) > 2 * max(start, end)


def test_pairs_all_up_to_four_branches_then_consecutive(run, monkeypatch):
    cfg, run_dir = run
    lines = []
    monkeypatch.setattr(
        diagnostics_module,
        "line_losses",
        lambda cfg, heldout, i, j, alphas: lines.append((i, j)) or [0.0] * len(alphas),
    )
    heldout = trained_heldout(cfg, run_dir)
    loss_barrier(cfg, heldout, {k: f"b{k}" for k in range(4)})
    assert lines == [("b0", "b1"), ("b0", "b2"), ("b0", "b3"), ("b1", "b2"), ("b1", "b3"), ("b2", "b3")]
    five = loss_barrier(cfg, heldout, {k: f"b{k}" for k in range(5)})
    assert [p["branches"] for p in five["pairs"]] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert loss_barrier(with_eval(cfg, barrier_points=0), heldout, {0: "b0", 1: "b1"}) is None
    assert loss_barrier(cfg, heldout, {0: "b0"}) is None


def test_distance_from_theta0_is_the_norm_of_the_difference(run, tmp_path):
    cfg, run_dir = run
    init = str(run_dir / "init")
    assert distance(init, init) == {"l2": 0.0, "relative": 0.0}

    base, perturbed = load_model(init, cfg.model), load_model(init, cfg.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():  # the tied embedding and head once, as the checkpoint stores them
            p.add_(torch.randn_like(p), alpha=0.01)
        difference = torch.cat([(p - q).flatten() for p, q in zip(perturbed.parameters(), base.parameters())])
        norm = torch.cat([q.flatten() for q in base.parameters()]).norm()
    folder = save_pretrained_checkpoint(tmp_path / "perturbed", perturbed, load_processor(init, cfg.model))
    got = distance(folder, init)
    assert got["l2"] == pytest.approx(float(difference.norm()), rel=1e-5)
    assert got["relative"] == pytest.approx(float(difference.norm() / norm), rel=1e-5)


def test_diagnose_writes_and_reuses_its_json(run, branches, monkeypatch):
    cfg, run_dir = run
    result = diagnose(cfg, run_dir)
    assert json.loads((run_dir / EVAL / DIAGNOSTICS).read_text()) == result
    assert set(result) == {"barrier", "distance_from_theta0", "checkpoints", "config_digest"}
    assert result["barrier"]["pairs"][0]["branches"] == [0, 1] and result["barrier"]["barrier"] > 0
    assert set(result["distance_from_theta0"]) == {"branch-0", "branch-1"}  # no joint or merges in this run
    assert result["distance_from_theta0"]["branch-0"] == distance(branches[0], run_dir / "init")
    assert set(result["checkpoints"]) == {"theta0", "branch-0", "branch-1"}

    lines = []
    measured = diagnostics_module.line_losses
    monkeypatch.setattr(diagnostics_module, "line_losses", lambda *args: lines.append(args) or measured(*args))
    assert diagnose(cfg, run_dir) == result and lines == []  # reused
    shutil.copytree(run_dir / "init", run_dir / "joint" / "final")  # a new model: one distance more
    grown = diagnose(cfg, run_dir)
    assert lines == [] and grown["barrier"] == result["barrier"]  # the branches are the same
    assert grown["distance_from_theta0"]["joint"] == {"l2": 0.0, "relative": 0.0}
    assert set(grown["checkpoints"]) == {"theta0", "branch-0", "branch-1", "joint"}
    again = diagnose(with_eval(cfg, barrier_points=1), run_dir)
    assert len(lines) == 1 and again["barrier"]["alphas"] == [0.0, 0.5, 1.0]
    assert again["barrier"]["pairs"][0]["losses"][::2] == pytest.approx(result["barrier"]["pairs"][0]["losses"][::4])
