"""``merit bench diloco --global-batch G``: DiLoCo's methods at the IsoLoCo paper's scale of workers
(R up to 128) and inner steps (H from 30 to 240), each cell (method, R, H) against data-parallel
training on the same tokens.

Every step trains on G windows of the stdlib corpus (:mod:`merit.bench.diloco`), the same G whatever
R: a step's windows are the next G of one seeded order of the training windows (a fresh permutation
each epoch), and worker k of R takes the k-th, (k + R)-th, … of them, G / R each. The data-parallel
baseline trains on all G windows of every step, so it is one run for every R and H, and every method
sees the same tokens in the same steps. Every cell trains ``--steps`` inner steps in all (T = steps / H
rounds) under the same lr schedule; the figure is its final held-out loss's degradation against
data-parallel, (loss − loss_dp) / loss_dp, as the paper states it.

The R workers live in one process and the outer step is the library's own
(:func:`pipeline.diloco.aggregate`). Memory is R models with their inner optimizer's state: AdamW 16
bytes a parameter (fp32 weights, gradient and two moments), Muon 12 on its matrices (one momentum
instead of two); ``worker_bytes`` gives the figure printed at the start.

Each cell is saved as ``<out>/cells/<method>-R<R>-H<H>.json`` (the baseline ``dp.json``) next to the
setting it was measured in (``setting.json``): a rerun skips the cells it has and refuses a folder of
another setting, so a long table is built over several sittings; every run rewrites ``results.json``,
``degradation_vs_R.png`` and ``degradation_vs_H.png`` from all the cells there.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from merit.bench.diloco import (
    BETAS,
    CLIP,
    CONTEXT,
    LR,
    METHODS,
    MIN_LR_RATIO,
    MUON_LR,
    MUON_MOMENTUM,
    WARMUP_RATIO,
    WEIGHT_DECAY,
    Corpus,
    epochs,
    heldout_loss,
    load_corpus,
    markdown,
    rules_text,
    run_diloco,
    run_dp,
    tiny_qwen2,
)
from pipeline.checkpoint import write_text_atomic
from pipeline.figures import save_figure
from pipeline.train.engine import takes_muon

DP_EVERY = 30  # the baselines' held-out loss every 30 steps (their final loss is the one compared)
# Data-parallel training with AdamW, the baseline of every cell, and with Muon (on the matrices
# Muon takes, AdamW on the rest), which tells a Muon-inside method's degradation from Muon's own gain.
BASELINES = {"dp": "adamw", "dp-muon": "muon"}


def global_batches(n_windows: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """The windows of every step, G at a time, in one seeded order (a fresh permutation each epoch)."""
    return epochs(torch.arange(n_windows), batch, seed)


def worker_batches(n_windows: int, batch: int, workers: int, k: int, seed: int) -> Iterator[torch.Tensor]:
    """Worker k's share of every step's G windows: the k-th, (k + R)-th, … of them."""
    return (step[k::workers] for step in global_batches(n_windows, batch, seed))


def cell_name(method: str, workers: int, inner_steps: int) -> str:
    return method if method in BASELINES else f"{method}-R{workers}-H{inner_steps}"


def worker_bytes(model: torch.nn.Module, inner: str) -> int:
    """A worker's fp32 weights, gradients and optimizer state: AdamW's two moments, Muon's one."""
    return sum(p.numel() * 4 * (3 if inner == "muon" and takes_muon(n, p) else 4) for n, p in model.named_parameters())


def setting(args: argparse.Namespace, corpus: Corpus, params: int) -> dict:
    """What every cell's figures depend on: a folder's cells are comparable when this is equal."""
    return {
        "model": args.model,
        "parameters": params,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "context": CONTEXT,
        "windows": {"train": len(corpus.train), "heldout": len(corpus.heldout)},
        "inner": {
            "adamw": {"lr": LR, "betas": BETAS, "weight_decay": WEIGHT_DECAY, "max_grad_norm": CLIP},
            "muon": {"lr": MUON_LR, "momentum": MUON_MOMENTUM, "weight_decay": WEIGHT_DECAY, "max_grad_norm": None},
            "schedule": {"warmup": WARMUP_RATIO, "min": MIN_LR_RATIO},
        },
    }


def run_cell(method: str, workers: int, inner_steps: int, model0, corpus: Corpus, args: argparse.Namespace) -> dict:
    """One cell's run: its final held-out loss, its curve (every round; the baseline every DP_EVERY
    steps) and its seconds (training, aggregation: Iso-C's orthogonalisation included)."""
    start, n, G = time.perf_counter(), len(corpus.train), args.global_batch
    if method in BASELINES:
        every = math.gcd(args.steps, DP_EVERY)
        run = run_dp(
            model0,
            corpus.train,
            corpus.heldout,
            1,
            every,
            args.steps // every,
            0,
            global_batches(n, G, 0),
            BASELINES[method],
        )
    else:
        streams = [worker_batches(n, G, workers, k, seed=0) for k in range(workers)]
        rounds = args.steps // inner_steps
        run = run_diloco(model0, corpus.train, corpus.heldout, workers, inner_steps, rounds, method, streams=streams)
    curve = [{k: v for k, v in c.items() if k != "bytes_sent"} for c in run.curve]
    return {
        "method": method,
        "workers": None if method in BASELINES else workers,
        "inner_steps": None if method in BASELINES else inner_steps,
        "final_loss": curve[-1]["loss"],
        "train_seconds": sum(c["train_seconds"] for c in curve),
        "aggregate_seconds": sum(c.get("aggregate_seconds", 0.0) for c in curve),
        "wall_seconds": time.perf_counter() - start,
        "curve": curve,
    }


def run_cells(out: Path, todo: list[tuple[str, int, int]], model0, corpus: Corpus, args: argparse.Namespace) -> dict:
    """Every (method, R, H) of ``todo`` not yet in ``out/cells/`` run and saved there (each as soon as
    it ends: an interrupted table keeps its finished cells; a cell another process of the same
    folder finished meanwhile is not run again); returns every cell of the folder."""
    cells = out / "cells"
    cells.mkdir(exist_ok=True)
    for method, workers, inner_steps in tqdm(todo, desc="cells", unit="cell"):
        path = cells / f"{cell_name(method, workers, inner_steps)}.json"
        if path.is_file():
            continue
        cell = run_cell(method, workers, inner_steps, model0, corpus, args)
        write_text_atomic(path, json.dumps(cell, indent=1))
        tqdm.write(f"{path.stem}: held-out loss {cell['final_loss']:.4f} ({cell['wall_seconds']:.0f} s)")
    return {p.stem: json.loads(p.read_text()) for p in sorted(cells.glob("*.json"))}


def check_folder(out: Path, wanted: dict) -> None:
    """Record the setting, or refuse a folder whose cells were measured in another one."""
    path, wanted = out / "setting.json", json.loads(json.dumps(wanted))  # as saved: tuples are lists
    if path.is_file() and (have := json.loads(path.read_text())) != wanted:
        changed = sorted(k for k in wanted.keys() | have.keys() if wanted.get(k) != have.get(k))
        raise SystemExit(
            f"merit: error: {out} holds cells of another setting (differs in {', '.join(changed)}); use another --out"
        )
    write_text_atomic(path, json.dumps(wanted, indent=1))


def percent(loss: float, baseline: dict) -> float:
    return 100 * (loss - baseline["final_loss"]) / baseline["final_loss"]


def degradations(cells: dict[str, dict]) -> list[dict]:
    """Every DiLoCo cell's row, its loss against data-parallel AdamW's in %, and a Muon-inside
    method's also against data-parallel Muon's (where measured)."""
    rows = []
    for name, c in cells.items():
        if name in BASELINES:
            continue
        row = c | {"vs_dp_percent": percent(c["final_loss"], cells["dp"])}
        if METHODS[c["method"]].inner == "muon" and "dp-muon" in cells:
            row["vs_dp_muon_percent"] = percent(c["final_loss"], cells["dp-muon"])
        rows.append(row)
    order = list(METHODS)
    return sorted(rows, key=lambda r: (order.index(r["method"]), r["workers"], r["inner_steps"]))


def table(rows: list[dict], across: str, fixed: str, value: int) -> str:
    """Degradation vs DP per method (rows) across R or H (columns), the other fixed at ``value``."""
    picked = [r for r in rows if r[fixed] == value]
    columns = sorted({r[across] for r in picked})
    methods = list(dict.fromkeys(r["method"] for r in picked))
    cell = {(r["method"], r[across]): f"{r['vs_dp_percent']:+.2f} %" for r in picked}
    head = "R" if across == "workers" else "H"
    return markdown(
        ["method", *[f"{head} = {c}" for c in columns]],
        [[m, *[cell.get((m, c), "—") for c in columns]] for m in methods],
    )


def cells_table(cells: dict[str, dict], rows: list[dict]) -> str:
    dp = cells["dp"]
    body = [
        [name, "—", "—", "—", f"{c['final_loss']:.4f}", f"{percent(c['final_loss'], dp):+.2f} %", "—", *seconds]
        for name, c in cells.items()
        if name in BASELINES and (seconds := [f"{c['train_seconds']:.0f}", "—"])
    ]
    body += [
        [
            r["method"],
            str(r["workers"]),
            str(r["inner_steps"]),
            str(len(r["curve"])),
            f"{r['final_loss']:.4f}",
            f"{r['vs_dp_percent']:+.2f} %",
            f"{r['vs_dp_muon_percent']:+.2f} %" if "vs_dp_muon_percent" in r else "—",
            f"{r['train_seconds']:.0f}",
            f"{1000 * r['aggregate_seconds'] / len(r['curve']):.1f}",
        ]
        for r in rows
    ]
    headers = ["method", "R", "H", "T", "held-out loss", "vs DP", "vs DP (Muon)", "train s", "aggregate ms / round"]
    return markdown(headers, body)


def plot(rows: list[dict], across: str, fixed: str, value: int, out: Path) -> None:
    picked = [r for r in rows if r[fixed] == value]
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in picked):
        points = sorted((r[across], r["vs_dp_percent"]) for r in picked if r["method"] == method)
        ax.plot(*zip(*points), marker="o", label=method)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    name = "R (workers)" if across == "workers" else "H (inner steps)"
    ax.set(
        xlabel=name,
        ylabel="held-out loss vs data-parallel (%)",
        title=f"{'H' if fixed == 'inner_steps' else 'R'} = {value}",
    )
    ticks = sorted({r[across] for r in picked})
    ax.set_xticks(ticks, [str(v) for v in ticks])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out)


def most_common(rows: list[dict], key: str, among: str) -> int:
    """The value of ``key`` with the most distinct values of ``among`` (the plot's fixed axis)."""
    values = {r[key] for r in rows}
    return max(sorted(values), key=lambda v: len({r[among] for r in rows if r[key] == v}))


def write_results(out: Path, wanted: dict, cells: dict[str, dict]) -> str:
    """results.json, the two plots and the tables (returned) from every cell of the folder."""
    rows = degradations(cells)
    methods = sorted({r["method"] for r in rows}, key=list(METHODS).index)
    about = {
        m: {"inner": METHODS[m].inner, "aggregate": rules_text(METHODS[m]), "outer": METHODS[m].outer.model_dump()}
        for m in methods
    }
    figures = {"setting": wanted, "methods": about, "baselines": {n: cells[n] for n in BASELINES if n in cells}}
    figures["cells"] = rows
    write_text_atomic(out / "results.json", json.dumps(figures, indent=1))
    text = [f"data-parallel: held-out loss {cells['dp']['final_loss']:.4f}", "", cells_table(cells, rows)]
    if rows:
        h = most_common(rows, "inner_steps", "workers")
        r = most_common(rows, "workers", "inner_steps")
        plot(rows, "workers", "inner_steps", h, out / "degradation_vs_R.png")
        plot(rows, "inner_steps", "workers", r, out / "degradation_vs_H.png")
        text += ["", f"vs data-parallel at H = {h}:", "", table(rows, "workers", "inner_steps", h)]
        text += ["", f"vs data-parallel at R = {r}:", "", table(rows, "inner_steps", "workers", r)]
    return "\n".join(text)


def main(args: argparse.Namespace) -> None:
    G = args.global_batch
    if bad := [r for r in args.workers if G % r]:
        raise SystemExit(f"merit: error: --global-batch {G} does not split among R = {bad} workers alike")
    if bad := [h for h in args.inner_steps if args.steps % h]:
        raise SystemExit(f"merit: error: --steps {args.steps} is not a whole number of rounds of H = {bad}")
    torch.set_num_threads(min(4, torch.get_num_threads()))
    corpus, model0 = load_corpus(), tiny_qwen2(size=args.model)
    params = sum(p.numel() for p in model0.parameters())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = setting(args, corpus, params)
    check_folder(out, wanted)
    inners = {METHODS[m].inner for m in args.methods if m != "dp"} | {"adamw"}
    memory = max(worker_bytes(model0, i) for i in inners) * max(args.workers)
    print(
        f"model: Qwen2ForCausalLM {args.model}, {params:,} parameters; {G} windows of {CONTEXT} + 1 a step "
        f"({G * CONTEXT:,} tokens), {args.steps} steps in all, {torch.get_num_threads()} threads; "
        f"R = {max(args.workers)} workers hold {memory / 2**20:,.0f} MiB (weights, gradients, optimizer state)"
    )
    todo = [(b, 1, 1) for b, inner in BASELINES.items() if inner in inners] + [
        (m, r, h) for m in args.methods if m != "dp" for r in args.workers for h in args.inner_steps
    ]
    have = run_cells(out, todo, model0, corpus, args)
    print(f"\nθ0: held-out loss {heldout_loss(model0, corpus.heldout):.4f}")
    print(write_results(out, wanted, have))
    print(f"outputs: {out / 'results.json'}, {out / 'degradation_vs_R.png'}, {out / 'degradation_vs_H.png'}")
