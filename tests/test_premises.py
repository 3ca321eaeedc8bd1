"""The quality bench's premise figures (merit/bench/premises.py) against hand-computed values."""

from __future__ import annotations

import json
from statistics import mean, stdev

import pytest

from merit.bench import premises
from pipeline.data.builtin import CONFLICTS, FINETUNE

PAIRS = (("a", "a_neg"), ("b", "b_neg"))


def test_pair_kinds():
    kinds = [premises.pair_kind(x, y, PAIRS) for x, y in (("a_neg", "a"), ("a", "b"), ("a", "b_neg"), ("a", "u"))]
    assert kinds == ["designed", "same side", "opposite sides", "with an unpaired source"]


def test_pair_cosines_average_each_kind_of_pair(tmp_path, monkeypatch):
    monkeypatch.setitem(CONFLICTS, "test", PAIRS)
    sources = ["a", "a_neg", "b", "b_neg", "u"]
    cosine = [[1.0] * 5 for _ in sources]
    values = {("a", "a_neg"): -0.9, ("b", "b_neg"): -0.7, ("a", "b"): 0.5, ("a_neg", "b_neg"): 0.3}
    values |= {("a", "b_neg"): -0.2, ("a_neg", "b"): -0.4, ("a", "u"): 0.1, ("a_neg", "u"): -0.5}
    values |= {("b", "u"): 0.0, ("b_neg", "u"): 0.2}
    for (x, y), v in values.items():
        i, j = sources.index(x), sources.index(y)
        cosine[i][j] = cosine[j][i] = v
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "conflicts.json").write_text(json.dumps({"sources": sources, "cosine": cosine}))
    got = premises.pair_cosines(tmp_path, "test")
    assert got["means"] == pytest.approx(
        {"designed": -0.8, "same side": 0.4, "opposite sides": -0.3, "with an unpaired source": -0.05}
    )
    assert got["lowest_other"] == [-0.5, "a_neg", "u"] and got["by_kind"]["designed"] == [-0.9, -0.7]
    assert premises.plot_pair_cosines({0: got, 1: got}, tmp_path / "p.png").stat().st_size > 5_000
    assert premises.pair_cosines(tmp_path / "nowhere", "test") is None


def test_the_conflict_premise_needs_every_condition_at_every_seed():
    def seed(designed, other, apart):
        means = {"designed": designed, "same side": 0.2, "opposite sides": other, "with an unpaired source": 0.0}
        return {"means": means, "by_kind": {"designed": [designed]}, "lowest_other": [other, "x", "y"]}

    table, holds = premises.conflict_table({0: seed(-0.5, -0.2, 5), 1: seed(-0.4, -0.1, 5)}, {0: 5, 1: 5}, 5)
    assert holds and table.count("| yes |") == 2
    for cosines, apart in (
        ({0: seed(-0.5, -0.2, 5), 1: seed(-0.25, -0.1, 5)}, {0: 5, 1: 5}),  # a mean above -0.3
        ({0: seed(-0.5, -0.6, 5)}, {0: 5}),  # another kind of pair lower
        ({0: seed(-0.5, -0.2, 4)}, {0: 4}),  # 4 of 5 apart: under 90 %
    ):
        assert not premises.conflict_table(cosines, apart, 5)[1]


def test_the_knowledge_premise_is_theta0_minus_the_constant_seed_by_seed():
    rows = [
        {"seed": 0, "model": "constant answer", "bench/t1": 25.0, "bench/t2": 5.0},
        {"seed": 1, "model": "constant answer", "bench/t1": 25.0, "bench/t2": 5.0},
        {"seed": 0, "model": "theta0", "bench/t1": 40.0, "bench/t2": 30.0},
        {"seed": 1, "model": "theta0", "bench/t1": 34.0, "bench/t2": 20.0},
    ]
    table, holds = premises.knowledge_table(rows, "constant answer")
    assert not holds  # t1's gap at seed 1 is 9 points
    assert f"| t1 | 2 | +12.0 ± {stdev([15.0, 9.0]):.1f} | +9.0 | **no** |" in table
    assert f"| t2 | 2 | +20.0 ± {stdev([25.0, 15.0]):.1f} | +15.0 | yes |" in table


def test_interference_is_accuracy_apart_minus_together():
    accuracy = {
        "theta0": {"a": 0.5, "a_neg": 0.5, "b": 0.5, "b_neg": 0.3},
        "apart": {"a": 1.0, "a_neg": 0.8, "b": 0.6, "b_neg": 0.4},
        "together": {"a": 0.5, "a_neg": 0.5, "b": 0.7, "b_neg": 0.1},
    }
    drop = premises.interference_drop({"accuracy": accuracy, "pairs": [list(p) for p in PAIRS]})
    assert drop["drop/all"] == pytest.approx(mean([0.5, 0.3, -0.1, 0.3]))
    assert drop["drop/first"] == pytest.approx(mean([0.5, -0.1])) and drop["together/second"] == pytest.approx(0.3)
    table, holds = premises.interference_table({0: drop})  # b's first side gains, but each side's mean drops
    assert holds and "| first | 1 | 50.0 ± 0.0 | 80.0 ± 0.0 | 60.0 ± 0.0 | +20.0 ± 0.0 | +20.0 | yes |" in table
    gain = {"accuracy": accuracy | {"apart": accuracy["together"], "together": accuracy["apart"]}, "pairs": PAIRS}
    table, holds = premises.interference_table({0: drop, 1: premises.interference_drop(gain)})
    assert not holds and "| all | 2 |" in table and "**no**" in table


def test_interference_groups_train_each_side_apart_or_both_together():
    groups = premises.interference_groups("opposed", FINETUNE["opposed"])
    first, second = ([pair[i] for pair in CONFLICTS["opposed"]] for i in (0, 1))
    rest = [s for s in FINETUNE["opposed"] if s not in first + second]
    assert groups == {"apart": [first, second, rest], "together": [first + second, rest]}


def test_the_barrier_is_one_per_split_and_seed():
    rows = [
        {"seed": 0, "split": "MERIT-2", "merge": "a", "barrier": 0.01},
        {"seed": 0, "split": "MERIT-2", "merge": "b", "barrier": 0.01},
        {"seed": 1, "split": "MERIT-2", "merge": "a", "barrier": 0.03},
        {"seed": 0, "split": "—", "model": "theta0", "barrier": None},
    ]
    assert f"| MERIT-2 | 2 | 0.0200 ± {stdev([0.01, 0.03]):.4f} | +0.0300 |" in premises.barrier_table(rows)
