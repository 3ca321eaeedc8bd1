"""``merit bench memory``: the peak memory of every stage at a given width, each measured in a
fresh process so that its peak is its own: calibration, training steps (the real branch trainer,
DeepSpeed, one rank), Fisher, evaluation, and merges for several K (``--stages`` picks some), with the
seconds each took in its process (a merge: θ0 in the tiny model's layout, as the hub stores its family).

On CPU two figures: the peak resident memory (ru_maxrss), and the peak anonymous resident memory
(what the stage allocates itself). A model stage is counted by the first: transformers keeps
weights loaded in their stored dtype memory-mapped from the checkpoint, so they are resident but
not anonymous. A merge is counted by the second: it maps its K input files and its resident
memory would count their pages, which are the page cache's, shared and reclaimable, and not
what the merge holds. On a GPU the figure is ``max_memory_allocated``. All beside the baseline
of a process that imported torch and transformers. Bytes per parameter, (peak − baseline) / N,
give the largest model whose weight-proportional memory fits a device; activations grow with the
sequence, not N: the README's arithmetic covers them.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from merit.bench.merge import run_in_process
from merit.bench.widths import build_theta0, width_overrides
from merit.cli import add_run_options, format_table, resolve_run
from pipeline.config import RunConfig
from pipeline.data import Collator, Encoder, load_split, prepare_data
from pipeline.layout import INIT, bench_dir
from pipeline.memory import AnonymousPeak, max_rss
from pipeline.merge import CheckpointReader
from pipeline.models import load_model, load_processor, processor_for
from pipeline.models.families import tiny_family

DEVICES_GB = (80, 141)  # A100 / H100 80 GB, H200
STAGES = ("calibrate", "train", "fisher", "evaluate", "merge")


def _measured(queue, stage, device: str, *args: Any) -> None:
    """Run ``stage(*args)`` in this (fresh) process; put its peaks on ``queue``."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    with AnonymousPeak() as anon:
        stage(*args)
    seconds = time.perf_counter() - began
    cuda = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    queue.put({"anon": anon.peak, "rss": max_rss(), "cuda": cuda, "seconds": seconds})


def _baseline() -> None:
    import transformers  # noqa: F401  (what every stage's process imports first)


def _encoders(cfg: RunConfig, processor: Any) -> tuple[Encoder, Collator]:
    return Encoder(processor, cfg.data.max_length), Collator(processor.tokenizer.pad_token_id)


def calibrate_stage(cfg: RunConfig, init: str, run_dir: str, device: str) -> None:
    from calibration.gradients import estimate_source_gradients, select_parameters

    model = load_model(init, cfg.model).to(device)
    sample = {name: items[:8] for name, items in list(load_split(cfg, run_dir, "train").items())[:2]}
    encoder, collator = _encoders(cfg, load_processor(init, cfg.model))
    names = select_parameters(model, cfg.calibration.params)
    estimate_source_gradients(model, sample, encoder, collator, names, batch_size=4, devices=[device])


def _fisher(cfg: RunConfig, init: str, run_dir: str, device: str) -> None:
    from pipeline.fisher import estimate_fisher

    examples = [items[0] for items in load_split(cfg, run_dir, "train").values()][:8]
    encoder, collator = _encoders(cfg, load_processor(init, cfg.model))
    batches = (collator([encoder(ex)]) for ex in examples)
    estimate_fisher(load_model(init, cfg.model), batches, f"{run_dir}/bench/fisher", device=device)


def _evaluate(cfg: RunConfig, init: str, run_dir: str, device: str) -> None:
    from pipeline.eval import evaluate_model

    evaluation = cfg.eval.model_copy(update={"device": device, "max_examples_per_source": 4})
    evaluate_model(cfg.model_copy(update={"eval": evaluation}), run_dir, "bench", init, force=True)


def merge_stage(init: str, branches: list[str], method: str, out: str, device: str) -> None:
    from pipeline.merge import MergeSpec, merge_checkpoints

    models = [{"path": b} for b in branches]
    merge_checkpoints(MergeSpec(base_model=init, models=models, method=method, out_path=out, device=device), False)


def run_train_steps(cfg: RunConfig, run_dir: Path, steps: int, name: str = "train") -> list[dict[str, Any]]:
    """Steps of the real branch trainer on one rank, from θ0 afresh; its metrics records."""
    from pipeline.train import BranchSpec, train_branch
    from pipeline.train.plan import all_sources

    out = bench_dir(run_dir, name)
    shutil.rmtree(out, ignore_errors=True)  # a finished branch would be skipped
    train = cfg.train.model_copy(update={"steps": steps, "processes": 1, "checkpoint_every": 10**9})
    spec = BranchSpec(
        name=f"bench-{name}",
        run_dir=str(run_dir),
        init=str(run_dir / INIT),
        sources=all_sources(run_dir),
        out_dir=str(out),
        config=cfg.model_copy(update={"train": train}),
    )
    train_branch(spec, echo=False)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_steps(cfg: RunConfig, run_dir: Path, steps: int) -> dict[str, float]:
    """The trainer's peaks (the rank's own, from its metrics)."""
    last = run_train_steps(cfg, run_dir, steps)[-1]
    return {
        key: last.get(f"peak_{name}_mb", 0) * 2**20 for key, name in (("anon", "anon"), ("rss", "rss"), ("cuda", "gpu"))
    }


def moved_branches(run_dir: Path, k: int, device: str) -> list[str]:
    """K copies of θ0, each moved a little: the merges' inputs (the noise drawn on ``device``)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(run_dir / INIT / "model.safetensors")
    folders = [bench_dir(run_dir, "branches") / str(i) for i in range(k)]
    for i, folder in enumerate(folders):
        if not (folder / "model.safetensors").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            g = torch.Generator(device).manual_seed(i)
            moved = {
                n: t + (1e-3 * torch.randn(t.shape, generator=g, device=device)).to(t.dtype).cpu()
                for n, t in weights.items()
            }
            save_file(moved, str(folder / "model.safetensors"))
            shutil.copy2(run_dir / INIT / "config.json", folder / "config.json")
    return [str(f) for f in folders]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--size", choices=["small", "medium", "3b"], default="medium", help="model widths")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="the weights' dtype")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="numbers of merged branches")
    parser.add_argument("--methods", default="weighted_average,ties,dare,iso_c", help="comma-separated merge methods")
    parser.add_argument("--steps", type=int, default=4, help="training steps of the train stage")
    parser.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)} (default: all)"
    )


def main(args: argparse.Namespace) -> None:
    device = args.device
    sizes = [*width_overrides(args.size), f"model.dtype={args.dtype}", "data.builtin.examples_per_source=16"]
    args.overrides = [*sizes, *args.overrides]  # a --set refines the --size (e.g. fewer layers)
    cfg, run_dir = resolve_run(args)
    init = str(run_dir / INIT)
    if not (run_dir / INIT / "model.safetensors").is_file():
        build_theta0(cfg, run_dir, device)
    prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    params = json.loads((run_dir / INIT / "manifest.json").read_text())["parameters"]["total"]
    run = str(run_dir)
    kinds = ("cuda",) if device == "cuda" else ("rss", "anon")
    baseline = run_in_process(_measured, _baseline, device)
    at_rest = ", ".join(f"{k} {baseline[k] / 2**20:,.0f} MB" for k in kinds)
    family = tiny_family(cfg.model.name_or_path).model_type  # --set model.name_or_path=tiny:<model_type>
    print(f"{family} at the {args.size} widths: {params / 1e6:,.1f} M parameters, {args.dtype}, {device}")
    print(f"baseline (a process with torch and transformers imported): {at_rest}")
    peaks = ["peak GPU MB"] if device == "cuda" else ["peak resident MB", "peak anonymous MB"]

    def row(name: str, measured: dict[str, float], counted: str, unit: float) -> list[Any]:
        """Peaks, the seconds, and the largest size (parameters, or entries of the largest tensor) that fits."""
        key = "cuda" if device == "cuda" else counted
        per_unit = max(measured[key] - baseline[key], 0) / unit
        fits = [f"{(gb * 1e9 - baseline[key]) / per_unit / 1e9:,.1f} B" if per_unit else "any" for gb in DEVICES_GB]
        seconds = round(measured["seconds"], 1) if "seconds" in measured else "-"
        return [name, *(round(measured[k] / 2**20) for k in kinds), seconds, key, round(per_unit, 2), *fits]

    stages = args.stages.split(",")
    if unknown := sorted(set(stages) - set(STAGES)):
        raise SystemExit(f"--stages {unknown}: not stages; the stages: {', '.join(STAGES)}")
    measures = {
        "calibrate": ("calibrate", lambda: run_in_process(_measured, calibrate_stage, device, cfg, init, run, device)),
        "train": ("train steps (1 rank)", lambda: train_steps(cfg, run_dir, args.steps)),
        "fisher": ("fisher", lambda: run_in_process(_measured, _fisher, device, cfg, init, run, device)),
        "evaluate": ("evaluate", lambda: run_in_process(_measured, _evaluate, device, cfg, init, run, device)),
    }
    models = [(name, measure()) for stage, (name, measure) in measures.items() if stage in stages]
    fits = [f"fits {gb} GB up to" for gb in DEVICES_GB]
    if models:
        headers = ["stage", *peaks, "seconds", "counted", "bytes / param", *fits]
        print(format_table(headers, [row(n, m, "rss", params) for n, m in models]))
    if "merge" not in stages:
        return
    # A merge holds a few tensors at a time: its memory scales with the largest tensor, not N.
    largest = max(math.prod(info.shape) for info in CheckpointReader(init).info.values())
    merges = []
    for k in args.k:
        branches = moved_branches(run_dir, k, device)
        for method in args.methods.split(","):
            out = f"{run}/bench/merged"
            measured = run_in_process(_measured, merge_stage, device, init, branches, method, out, device)
            merges.append(row(f"{method}, K={k}", measured, "anon", largest))
    print(f"merges (largest tensor: {largest / 1e6:,.1f} M entries, {4 * largest / 2**20:,.0f} MB in fp32):")
    headers = ["merge", *peaks, "seconds", "counted", "bytes / largest entry", *(f"{f} (entries)" for f in fits)]
    print(format_table(headers, merges))
