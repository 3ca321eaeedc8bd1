"""``merit bench mixture``: the data stages at the corpus sizes users train on. For each of
``--sizes`` examples, a Cauldron-shaped mixture of ``--subsets`` subsets (:func:`write_large_mixture`:
1 to 3 turns a row, images of 28 to 448 px at aspect ratios 1:2 to 2:1, ``--shards`` parquet files a
subset, one corrupt image) is named as one ``format: hub`` entry with ``on_bad_record: skip``, and
three stages run each in a fresh process on the tiny θ0 (the demo's widths): ``prepare`` (timed;
its own peak resident memory and its largest worker's), ``calibrate`` (r = 1), and one training
rank's data side (its group's examples from the store, the packing order, ``--steps`` steps of
micro batches encoded: what a rank holds besides its model). Then a mixture whose image column
holds paths in the snapshot (LLaVA-OneVision's shape, images as files) is prepared the same way.

What should hold: prepare linear in the examples (its rate flat), every stage's peak memory flat in
them: a process allocates its batch and an index of 12 bytes an example (columns "MB": peak
anonymous memory / max RSS). Its max RSS also counts the pages of the memory-mapped store it has
touched: clean page cache, shared by every rank of the machine and dropped under pressure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import psutil

from merit.bench.hub_cache import image, write_dataset_cache, write_large_mixture
from merit.bench.merge import run_in_process
from merit.cli import add_run_options, format_table, resolve_run
from pipeline.config import RunConfig
from pipeline.memory import AnonymousPeak, max_rss
from pipeline.models import init_model, processor_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="examples")
    parser.add_argument("--subsets", type=int, default=20, help="subsets (sources) of each mixture")
    parser.add_argument("--shards", type=int, default=2, help="parquet files a subset")
    parser.add_argument("--steps", type=int, default=20, help="steps of micro batches the rank encodes")
    parser.add_argument("--paths", type=int, default=10_000, help="examples of the path-string mixture (0: none)")


def _stage(queue, what: str, cfg: RunConfig, run_dir: str, home: str, steps: int) -> None:
    """One stage in this (fresh) process; puts its seconds, peaks and summary."""
    os.environ["HF_HOME"] = home
    with AnonymousPeak() as anonymous, WorkerPeak() as workers:
        result = _run_stage(what, cfg, run_dir, steps)
    queue.put({"rss": max_rss(), "anonymous": anonymous.peak, "workers": workers.peak, **result})


class WorkerPeak(AnonymousPeak):
    """The largest resident size any child process (a prepare worker) reached, sampled."""

    def _sample(self, interval: float) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            for child in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.peak = max(self.peak, child.memory_info().rss)
            self._stop.wait(interval)


def _write(queue, home: str, repo: str, subsets: int, rows: int, shards: int) -> None:
    """The mixture written in a process of its own: the rows it builds are not the stages' parent's."""
    start = time.perf_counter()
    write_large_mixture(Path(home), repo, subsets, rows, shards)
    queue.put(time.perf_counter() - start)


def _run_stage(what: str, cfg: RunConfig, run_dir: str, steps: int) -> dict:
    start, summary = time.perf_counter(), {}
    if what == "prepare":
        from pipeline.data import prepare_data

        processor = processor_for(cfg, run_dir)
        startup = time.perf_counter() - start  # imports and the processor: the same at any size
        manifest = prepare_data(cfg, run_dir, processor, force=True)
        sources = manifest["sources"].values()
        skipped: dict[str, int] = {}
        for info in sources:
            for reason, n in info.get("skipped_by_reason", {}).items():
                skipped[reason] = skipped.get(reason, 0) + n
        summary = {"examples": sum(s.get("examples", 0) for s in sources), "skipped": skipped, "startup": startup}
    elif what == "calibrate":
        from calibration.stage import calibrate

        calibrate(cfg, run_dir, force=True)
    else:
        from pipeline.train.plan import group_specs
        from pipeline.train.sampling import BranchData

        spec = group_specs(cfg, run_dir)[0]
        data = BranchData.for_branch(spec, processor_for(cfg, run_dir))
        built = time.perf_counter() - start
        for step in range(steps):
            for batch in data.micro_batches(step):
                data.encoder.encode_batch(batch)
        summary = {"examples": len(data.examples), "built": built}
    return {"seconds": time.perf_counter() - start, **summary}


def _run(args: argparse.Namespace, base: Path, name: str, repo: str) -> tuple[RunConfig, Path]:
    settings = [
        f"data.sources=[{{name: mix, format: hub, path: {repo}, subsets: all}}]",
        "data.on_bad_record=skip",
        "warmup.steps=0",
        "warmup.sources=[]",
        "eval.sources=[]",
        "eval.benchmarks=[]",
        "calibration.n_per_source=16",
    ]
    one = argparse.Namespace(**{**vars(args), "overrides": [*settings, *args.overrides], "run_dir": base / name})
    cfg, run_dir = resolve_run(one)
    init_model(cfg, run_dir)
    return cfg, run_dir


def _mb(n: int) -> int:
    return round(n / 2**20)


def _rate(prepared: dict) -> list[str]:
    """Seconds (start-up: imports and the processor), and examples a second with and without it."""
    seconds, startup, examples = prepared["seconds"], prepared["startup"], prepared["examples"]
    return [f"{seconds:.1f} ({startup:.1f})", f"{examples / seconds:,.0f} / {examples / (seconds - startup):,.0f}"]


def _peaks(result: dict) -> str:
    return f"{_mb(result['anonymous'])} / {_mb(result['rss'])}"


def main(args: argparse.Namespace) -> None:
    base = Path(args.run_dir or "runs/bench-mixture")
    home = base / "hf"
    os.environ["HF_HOME"] = str(home)  # the snapshots are found, and pinned, as the configs resolve
    rows = []
    for size in args.sizes:
        repo = f"bench/cauldron-{size}"
        if not (home / "hub" / f"datasets--{repo.replace('/', '--')}").is_dir():
            seconds = run_in_process(_write, str(home), repo, args.subsets, size // args.subsets, args.shards)
            print(f"{repo}: written in {seconds:.0f} s")
        cfg, run_dir = _run(args, base, str(size), repo)
        prepared = run_in_process(_stage, "prepare", cfg, str(run_dir), str(home), args.steps)
        calibrated = run_in_process(_stage, "calibrate", cfg, str(run_dir), str(home), args.steps)
        rank = run_in_process(_stage, "rank", cfg, str(run_dir), str(home), args.steps)
        rows.append(
            [
                f"{prepared['examples']:,}",
                ", ".join(f"{k}: {v}" for k, v in prepared["skipped"].items()) or "none",
                *_rate(prepared),
                _peaks(prepared),
                _mb(prepared["workers"]),
                f"{calibrated['seconds']:.1f}",
                _peaks(calibrated),
                f"{rank['examples']:,}",
                f"{rank['built']:.1f} / {rank['seconds']:.1f}",
                _peaks(rank),
            ]
        )
    headers = [
        "examples",
        "skipped",
        "prepare s (start-up)",
        "ex/s: all / after start-up",
        "prepare MB",
        "a worker's peak RSS MB",
        "calibrate s",
    ]
    headers += ["calibrate MB", "rank's examples", "rank s (data built / with steps)", "rank MB"]
    print(format_table(headers, rows))
    if args.paths:
        _path_strings(args, base, home)


def _path_strings(args: argparse.Namespace, base: Path, home: Path) -> None:
    """A LLaVA-OneVision-shaped mixture whose ``image`` column holds paths to files in the snapshot."""
    import datasets

    repo, per = "bench/path-images", args.paths // args.subsets
    if not (home / "hub" / f"datasets--{repo.replace('/', '--')}").is_dir():
        pictures = {f"images/{i}.png": image(i, 28 + 8 * (i % 40)) for i in range(args.paths)}
        extra = {}
        for rel, picture in pictures.items():
            path = base / "tmp.png"
            picture.save(path)
            extra[rel] = path.read_bytes()
        configs = {}
        for s in range(args.subsets):
            ids = range(s * per, (s + 1) * per)
            table = {
                "image": [f"images/{i}.png" for i in ids],
                "conversations": [
                    [{"from": "human", "value": f"<image>\nWhat is picture {i}?"}, {"from": "gpt", "value": f"{i}"}]
                    for i in ids
                ],
            }
            configs[f"task_{s:03d}"] = {"train": datasets.Dataset.from_dict(table)}
        write_dataset_cache(home, repo, configs, extra=extra)
    cfg, run_dir = _run(args, base, "paths", repo)
    prepared = run_in_process(_stage, "prepare", cfg, str(run_dir), str(home), args.steps)
    headers = [
        "path-string mixture: examples",
        "skipped",
        "prepare s (start-up)",
        "ex/s: all / after start-up",
        "prepare MB",
        "a worker's peak RSS MB",
    ]
    row = [
        f"{prepared['examples']:,}",
        ", ".join(f"{k}: {v}" for k, v in prepared["skipped"].items()) or "none",
        *_rate(prepared),
        _peaks(prepared),
        _mb(prepared["workers"]),
    ]
    print(format_table(headers, [row]))
