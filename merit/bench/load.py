"""``merit bench load``: each stage's time unloaded and beside busy processes, the fair-share test
of the thread settings (``pipeline.threads``).

A calibration, training steps of the real branch trainer (DeepSpeed, one rank; the median step,
after the first ones) and merges of K = 2 branches (weighted average and TIES), at a width of
``merit bench memory``'s, each in a fresh process, ``--repeats`` times (the median is printed),
then again beside ``--load`` processes spinning on the CPU (default: one per CPU this process
may use). A process that shares C cores with N single-threaded spinners gets C / (C + N) of
them: 2× its unloaded time for N = C. Thread pools that spin-wait on cores another process
holds take far longer (7× for a TIES merge before ``pipeline.threads``)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from merit.bench.memory import calibrate_stage, merge_stage, moved_branches, run_train_steps
from merit.bench.merge import busy_processes, run_in_process
from merit.bench.widths import build_theta0, width_overrides
from merit.cli import add_run_options, format_table, resolve_run
from pipeline.data import prepare_data
from pipeline.layout import INIT, bench_dir
from pipeline.models import processor_for
from pipeline.threads import available_cpus, set_threads

FIRST_STEPS = 2  # steps left out of the median: start-up allocations and the loader's first batches


def _timed(queue, stage, *args) -> None:
    set_threads()
    start = time.perf_counter()
    stage(*args)
    queue.put(time.perf_counter() - start)


def step_seconds(cfg, run_dir: Path, steps: int) -> float:
    """The median seconds of a training step of the real trainer (one rank), from its metrics."""
    elapsed = [record["elapsed_s"] for record in run_train_steps(cfg, run_dir, steps, "load-train")]
    return statistics.median(b - a for a, b in zip(elapsed[FIRST_STEPS - 1 :], elapsed[FIRST_STEPS:]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--size", choices=["small", "medium"], default="small", help="model widths")
    parser.add_argument("--steps", type=int, default=8, help="training steps (the median step is printed)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure (the median is printed)")
    parser.add_argument("--load", type=int, help="busy processes (default: one per CPU this process may use)")


def main(args: argparse.Namespace) -> None:
    if args.steps <= FIRST_STEPS:
        raise SystemExit(f"merit bench load: --steps must be over {FIRST_STEPS} (the first steps are not timed)")
    args.overrides = [*args.overrides, *width_overrides(args.size), "data.builtin.examples_per_source=16"]
    cfg, run_dir = resolve_run(args)
    init, run = str(run_dir / INIT), str(run_dir)
    if not (run_dir / INIT / "model.safetensors").is_file():
        build_theta0(cfg, run_dir)
    prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    branches = moved_branches(run_dir, 2, "cpu")
    load = args.load or available_cpus()
    stages = {
        "calibrate": lambda: run_in_process(_timed, calibrate_stage, cfg, init, run, "cpu"),
        "train step (1 rank)": lambda: step_seconds(cfg, run_dir, args.steps),
        **{
            f"merge {method}, K = 2": lambda m=method: run_in_process(
                _timed, merge_stage, init, branches, m, str(bench_dir(run_dir, f"merged-{m}")), "cpu"
            )
            for method in ("weighted_average", "ties")
        },
    }
    cpus = available_cpus()
    print(f"{args.size} widths, {cpus} CPUs, median of {args.repeats}; loaded: beside {load} busy processes")
    rows = []
    for name, measure in stages.items():
        unloaded = statistics.median(measure() for _ in range(args.repeats))
        with busy_processes(load):
            loaded = statistics.median(measure() for _ in range(args.repeats))
        rows.append([name, round(unloaded, 3), round(loaded, 3), round(loaded / unloaded, 2)])
        print(f"{name}: {unloaded:.3f} s, loaded {loaded:.3f} s", flush=True)
    print(format_table(["stage", "unloaded s", "loaded s", "loaded/unloaded"], rows))
