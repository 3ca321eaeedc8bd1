"""``merit bench sources``: the data stages at the paper's scale of sources. A hub-shaped mixture
of ``--counts`` subsets in the Cauldron's shape (subset s holding ``--rows`` × (1 + s mod 4)
examples, as real mixtures' subsets differ in size; written by :mod:`merit.bench.hub_cache` as the
tests' fixtures are) is named as one ``format: hub`` entry with ``subsets: all``; for each count,
``prepare`` and then ``calibrate`` at every ``--r`` run in fresh processes, each timed, with its
peak resident memory, on the tiny θ0 (the demo's widths).

What grows with the number of sources S: prepare reads and encodes every example once (linear in
the examples); calibration's gradient passes are linear in S × n_per_source, its conflict matrix
and PCA are S × S (negligible below thousands), its sketches S × dim floats.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from merit.bench.hub_cache import write_mixture
from merit.bench.merge import run_in_process
from merit.cli import add_run_options, format_table, resolve_run
from pipeline.config import RunConfig
from pipeline.data.manifest import read_manifest
from pipeline.memory import max_rss
from pipeline.models import init_model, processor_for

REPO = "bench/mixture"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--counts", type=int, nargs="+", default=[18, 176], help="numbers of subsets (sources)")
    parser.add_argument(
        "--rows", type=int, default=24, help="examples of the smallest subset (subset s: rows × (1 + s mod 4))"
    )
    parser.add_argument("--n-per-source", type=int, default=16, help="calibration examples per source")
    parser.add_argument("--r", type=int, nargs="+", default=[3, 4], help="split depths: K = 2^r groups")


def _stage(queue, what: str, cfg: RunConfig, run_dir: str, home: str) -> None:
    """Run ``prepare`` or ``calibrate`` in this (fresh) process; put its seconds, peak and summary."""
    os.environ["HF_HOME"] = home
    start = time.perf_counter()
    if what == "prepare":
        from pipeline.data import prepare_data

        result = prepare_data(cfg, run_dir, processor_for(cfg, run_dir), force=True)
        summary = {"examples": sum(s.get("examples", 0) for s in result["sources"].values())}
    else:
        from calibration.errors import SplitError
        from calibration.stage import calibrate

        try:
            result = calibrate(cfg, run_dir, force=True)
        except SplitError as err:  # e.g. 16 balanced groups of 18 sources: said in the table
            queue.put({"refused": str(err).split(":")[0]})
            return
        examples = {name: info["train_examples"] for name, info in read_manifest(run_dir)["sources"].items()}
        summary = {
            "sources": [len(g) for g in result["groups"]],
            "examples": [sum(examples[s] for s in g) for g in result["groups"]],
            "gradient_seconds": result["gradient_seconds"],
        }
    queue.put({"seconds": time.perf_counter() - start, "rss": max_rss(), **summary})


def main(args: argparse.Namespace) -> None:
    base = Path(args.run_dir or "runs/bench-sources")
    home = base / "hf"  # one hub cache for every count's mixture
    os.environ["HF_HOME"] = str(home)  # the snapshots are found, and pinned, as the configs resolve
    rows = []
    for count in args.counts:
        repo = f"{REPO}-{count}"
        if not (home / "hub" / f"datasets--{repo.replace('/', '--')}").is_dir():
            write_mixture(home, repo, count, [args.rows * (1 + s % 4) for s in range(count)])
        settings = [f"data.sources=[{{name: mix, format: hub, path: {repo}, subsets: all}}]", "warmup.steps=0"]
        settings += ["warmup.sources=[]", "eval.sources=[]", "eval.benchmarks=[]"]
        settings += [f"calibration.n_per_source={args.n_per_source}"]
        one = argparse.Namespace(
            **{**vars(args), "overrides": [*settings, *args.overrides], "run_dir": base / str(count)}
        )
        cfg, run_dir = resolve_run(one)
        init_model(cfg, run_dir)
        prepared = run_in_process(_stage, "prepare", cfg, str(run_dir), str(home))
        row = [count, prepared["examples"], f"{prepared['seconds']:.1f}", round(prepared["rss"] / 2**20)]
        for r in args.r:
            calibrated = cfg.model_copy(update={"calibration": cfg.calibration.model_copy(update={"r": r})})
            result = run_in_process(_stage, "calibrate", calibrated, str(run_dir), str(home))
            if "refused" in result:
                row += ["refused", "", result["refused"]]
                continue
            sources, examples = result["sources"], result["examples"]
            row += [
                f"{result['seconds']:.1f} ({result['gradient_seconds']:.1f})",
                round(result["rss"] / 2**20),
                f"{len(sources)}: {min(sources)}–{max(sources)} / {min(examples)}–{max(examples)}",
            ]
        rows.append(row)
    headers = ["sources", "examples", "prepare s", "prepare peak MB"]
    for r in args.r:
        headers += [f"calibrate r={r} s (gradients)", "peak MB", "groups: sources / train examples"]
    print(format_table(headers, rows))
