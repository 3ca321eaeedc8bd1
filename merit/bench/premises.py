"""The MERIT paper's premises, measured by ``merit bench quality`` on its own cases before its verdict:

1. **θ0 knows things**: θ0 scores on every benchmark task at least :data:`MARGIN` points above the
   task's constant answer (a model below it has no skill for fine-tuning to keep or lose).
2. **Designed conflicts are gradient conflicts**: the designed pairs' cosines in C
   (``calibration/conflicts.json``) are negative and below every other kind of pair, and MERIT's
   smallest-K split puts the pairs apart.
3. **Interference is real**: from θ0, one branch trained on both sources of every designed pair
   (``together``) scores lower on them, held out, than two branches each trained on one side of
   every pair (``apart``), each source seen once in both.
4. **One basin**: the loss barrier between the branches stays near 0.

Premise 3 trains branches of its own on θ0 (a given split in a run directory linked to the seed's
base case, each branch a real DeepSpeed job) and scores only the paired sources' held-out examples.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from statistics import mean, stdev
from typing import TYPE_CHECKING, Any

from pipeline.checkpoint import write_json_atomic
from pipeline.config import RunConfig, load_config
from pipeline.controls import linked_run
from pipeline.data.builtin import CONFLICTS, FINETUNE
from pipeline.layout import CALIBRATION
from pipeline.report import markdown_table

if TYPE_CHECKING:
    from pipeline.eval.heldout import Heldout

MARGIN = 10.0  # points above the constant answer that count as knowing a task
COSINE_BOUND = -0.3  # the designed pairs' mean cosine at most this
APART_SHARE = 0.9  # of the designed pairs put apart by the smallest K
PAIR_KINDS = ("designed", "same side", "opposite sides", "with an unpaired source")
INTERFERENCE = "interference.json"


def pair_kind(a: str, b: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """Which kind of source pair ``a, b`` is: a designed pair, two sources on the same side of two
    designed pairs (both first or both second), on opposite sides of two, or one not in any."""
    side = {s: i for pair in pairs for i, s in enumerate(pair)}
    if (a, b) in pairs or (b, a) in pairs:
        return "designed"
    if a not in side or b not in side:
        return "with an unpaired source"
    return "same side" if side[a] == side[b] else "opposite sides"


def pair_cosines(run_dir: Path, kind: str) -> dict[str, Any] | None:
    """Mean cosine of each kind of source pair in the run's C, and the lowest cosine of a pair
    that is not designed (with its sources); None before calibration."""
    path = run_dir / CALIBRATION / "conflicts.json"
    if not path.is_file():
        return None
    conflicts = json.loads(path.read_text())
    sources, cosine, pairs = conflicts["sources"], conflicts["cosine"], CONFLICTS[kind]
    by_kind: dict[str, list[float]] = {k: [] for k in PAIR_KINDS}
    lowest = (2.0, "", "")
    for i, j in combinations(range(len(sources)), 2):
        k = pair_kind(sources[i], sources[j], pairs)
        by_kind[k].append(cosine[i][j])
        if k != "designed":
            lowest = min(lowest, (cosine[i][j], sources[i], sources[j]))
    means = {k: mean(v) for k, v in by_kind.items() if v}
    return {"means": means, "by_kind": by_kind, "lowest_other": list(lowest)}


def interference_groups(kind: str, sources: list[str]) -> dict[str, list[list[str]]]:
    """The two given splits premise 3 trains (the unpaired sources in a group of their own, never
    trained): every pair's two sides apart, and every pair together."""
    pairs = CONFLICTS[kind]
    first, second = [a for a, _ in pairs], [b for _, b in pairs]
    rest = [s for s in sources if s not in first + second]
    return {"apart": [first, second, rest], "together": [first + second, rest]}


def measure_interference(config: str, overrides: list[str], base: Path, folder: Path, kind: str) -> dict[str, Any]:
    """Premise 3 for one seed: train the paired groups of :func:`interference_groups` from the base
    case's θ0 and score each paired source's held-out accuracy in the branch that trained it.
    Kept in ``folder/interference.json``; a finished measurement is read back."""
    # Imported here, as the quality bench imports its flows: `merit bench` starts without them.
    from calibration.stage import calibrate
    from pipeline.eval.heldout import Heldout, source_roles
    from pipeline.train.launch import train_branch
    from pipeline.train.plan import group_specs

    done = folder / INTERFERENCE
    if done.is_file():
        return json.loads(done.read_text())
    accuracy: dict[str, dict[str, float]] = {}
    paired = [s for pair in CONFLICTS[kind] for s in pair]
    for arrangement, groups in interference_groups(kind, FINETUNE[kind]).items():
        given = ["calibration.method=given", f"calibration.groups={json.dumps(groups)}", "flow.controls=[]"]
        cfg = load_config(config, [*overrides, *given])
        run_dir = linked_run(cfg, base, folder / arrangement)
        calibrate(cfg, run_dir)
        trained = group_specs(cfg, run_dir)[:-1]  # the unpaired sources' group is not trained
        if "theta0" not in accuracy:  # where both arrangements start; their held-out data is the base case's
            full = Heldout.load(cfg, run_dir, source_roles(run_dir))
            heldout = Heldout({s: full.examples[s] for s in paired}, {s: full.roles[s] for s in paired})
            accuracy["theta0"] = _heldout_accuracy(cfg, heldout, Path(trained[0].init), paired)
        accuracy[arrangement] = {}
        for spec in trained:
            train_branch(spec, echo=False)
            accuracy[arrangement] |= _heldout_accuracy(cfg, heldout, Path(spec.out_dir) / "final", spec.sources)
    result = {"accuracy": accuracy, "pairs": [list(p) for p in CONFLICTS[kind]]}
    write_json_atomic(done, result)
    return result


def _heldout_accuracy(cfg: RunConfig, heldout: Heldout, checkpoint: Path, sources: list[str]) -> dict[str, float]:
    """Exact-match accuracy of a checkpoint on the held-out examples of ``sources``."""
    from pipeline.devices import eval_device
    from pipeline.eval.heldout import Heldout, score_model
    from pipeline.models.loading import load_model, load_processor

    wanted = Heldout({s: heldout.examples[s] for s in sources}, {s: heldout.roles[s] for s in sources})
    model = load_model(checkpoint, cfg.model).to(eval_device(cfg)).eval()
    scored = score_model(cfg, model, load_processor(checkpoint, cfg.model), wanted, checkpoint.parent.name, True)
    return {s: figures["accuracy"] for s, figures in scored.items()}


def interference_drop(result: dict[str, Any]) -> dict[str, float]:
    """Mean held-out accuracy of θ0, apart, together, and the difference apart − together, over
    every paired source and over each side of the pairs."""
    theta0, apart, together = (result["accuracy"][a] for a in ("theta0", "apart", "together"))
    sides = {"all": [s for p in result["pairs"] for s in p]}
    sides |= {"first": [a for a, _ in result["pairs"]], "second": [b for _, b in result["pairs"]]}
    out = {}
    for side, sources in sides.items():
        out[f"theta0/{side}"] = mean(theta0[s] for s in sources)
        out[f"apart/{side}"] = mean(apart[s] for s in sources)
        out[f"together/{side}"] = mean(together[s] for s in sources)
        out[f"drop/{side}"] = out[f"apart/{side}"] - out[f"together/{side}"]
    return out


def _spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    if not values:
        return ""
    spread = stdev(values) if len(values) > 1 else 0.0
    return f"{scale * mean(values):+.{digits}f} ± {scale * spread:.{digits}f}"


def knowledge_table(rows: list[dict[str, Any]], constant_label: str) -> tuple[str, bool]:
    """Premise 1: per benchmark task, θ0 − the constant answer seed by seed (mean ± std and the
    smallest); holds when the smallest is at least :data:`MARGIN` on every task."""
    constants = {r["seed"]: r for r in rows if r["model"] == constant_label}
    theta0 = {r["seed"]: r for r in rows if r["model"] == "theta0" and r["seed"] in constants}
    tasks = sorted({k for r in theta0.values() for k in r if k.startswith("bench/")})
    table, holds = [], bool(tasks)
    for task in tasks:
        gaps = [
            theta0[s][task] - constants[s][task]
            for s in theta0
            if theta0[s].get(task) is not None and constants[s].get(task) is not None
        ]
        held = bool(gaps) and min(gaps) >= MARGIN
        holds &= held
        low = f"{min(gaps):+.1f}" if gaps else ""
        table.append([task.removeprefix("bench/"), len(gaps), _spread(gaps), low, "yes" if held else "**no**"])
    headers = ["task", "seeds", "θ0 − constant (points)", "smallest", f"≥ {MARGIN:g} at every seed"]
    return markdown_table(headers, table), holds


def conflict_table(cosines: dict[int, dict[str, Any]], apart: dict[int, int | None], n_pairs: int) -> tuple[str, bool]:
    """Premise 2, seed by seed: mean cosine per kind of pair, the lowest other pair, the designed
    pairs the smallest-K split puts apart; holds when at every seed the designed mean is at most
    :data:`COSINE_BOUND` and below every other kind's, and at least :data:`APART_SHARE` are apart."""
    table, holds = [], bool(cosines)
    for seed, c in sorted(cosines.items()):
        means, designed = c["means"], c["means"].get("designed")
        others = [v for k, v in means.items() if k != "designed"]
        split = apart.get(seed)
        held = (
            designed is not None
            and designed <= COSINE_BOUND
            and all(designed < v for v in others)
            and split is not None
            and split >= APART_SHARE * n_pairs
        )
        holds &= held
        value, a, b = c["lowest_other"]
        cells = [f"{means[k]:+.3f}" if k in means else "" for k in PAIR_KINDS]
        table.append([seed, *cells, f"{value:+.3f} ({a} / {b})", split, "yes" if held else "**no**"])
    headers = ["seed", *(f"{k}: mean cosine" for k in PAIR_KINDS), "lowest other pair", "pairs apart", "holds"]
    return markdown_table(headers, table), holds


def interference_table(drops: dict[int, dict[str, float]]) -> tuple[str, bool]:
    """Premise 3 over seeds: held-out accuracy of the paired sources at θ0, apart and together
    (mean ± std, %), per side; holds when the drop of every side is positive at every seed."""
    table, holds = [], bool(drops)
    for side in ("all", "first", "second"):
        per_seed = [d[f"drop/{side}"] for d in drops.values()]
        held = min(per_seed) > 0
        holds &= held
        table.append(
            [
                side,
                len(per_seed),
                _spread([d[f"theta0/{side}"] for d in drops.values()], 100).lstrip("+"),
                _spread([d[f"apart/{side}"] for d in drops.values()], 100).lstrip("+"),
                _spread([d[f"together/{side}"] for d in drops.values()], 100).lstrip("+"),
                _spread(per_seed, 100),
                f"{100 * min(per_seed):+.1f}",
                "yes" if held else "**no**",
            ]
        )
    headers = [
        "sources",
        "seeds",
        "θ0 (%)",
        "apart (%)",
        "together (%)",
        "apart − together",
        "smallest",
        "> 0 at every seed",
    ]
    return markdown_table(headers, table), holds


def plot_pair_cosines(cosines: dict[int, dict[str, Any]], path: Path) -> Path:
    """Premise 2 as a picture: every pair's cosine in C by kind of pair, one column of points per
    seed within a kind, each kind's mean as a bar across its seeds and the bound as a line."""
    import matplotlib.pyplot as plt

    from pipeline.figures import save_figure

    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    seeds = sorted(cosines)
    width = 0.8 / max(1, len(seeds))
    for x, kind in enumerate(PAIR_KINDS):
        values = [v for s in seeds for v in cosines[s]["by_kind"].get(kind, [])]
        for i, seed in enumerate(seeds):
            points = cosines[seed]["by_kind"].get(kind, [])
            at = x - 0.4 + width * (i + 0.5)
            colour = "tab:red" if kind == "designed" else "tab:blue"
            ax.scatter([at] * len(points), points, s=10, alpha=0.6, color=colour, label=None)
        if values:
            ax.hlines(mean(values), x - 0.4, x + 0.4, color="black", linewidth=2)
    ax.axhline(COSINE_BOUND, color="tab:red", linestyle="--", linewidth=1, label=f"bound {COSINE_BOUND}")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xticks(range(len(PAIR_KINDS)), PAIR_KINDS)
    ax.set_ylabel("cosine of the two sources' gradients at θ0")
    ax.set_title(f"Pairs of sources by kind: seeds {', '.join(map(str, seeds))} left to right; bar: mean")
    ax.legend(loc="upper right", fontsize=8)
    return save_figure(fig, path)


def barrier_table(rows: list[dict[str, Any]]) -> str:
    """Premise 4: the loss barrier between each split's branches (one per split and seed, whatever
    the merge), mean ± std over seeds and the largest."""
    barriers: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("barrier") is not None and "merge" in r:
            barriers.setdefault(r["split"], {})[r["seed"]] = r["barrier"]
    table = [
        [split, len(by_seed), _spread(list(by_seed.values()), digits=4).lstrip("+"), f"{max(by_seed.values()):+.4f}"]
        for split, by_seed in barriers.items()
    ]
    return markdown_table(["split", "seeds", "barrier (loss)", "largest"], table)
