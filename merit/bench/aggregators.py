"""``merit bench aggregators``: what one DiLoCo round costs its busiest aggregator, for R workers
and S aggregators (``diloco.aggregators``), measured by aggregating a round of fabricated
payloads with the run's own code (``aggregate_round``): θ0 at a width (``--size``), R payloads of
random Δ_k in the round's compression, each of the S parts reading its tensors of every payload.
The bytes are those the aggregator's readers ask for (every payload twice: the drift pass, then
the merge; θ's tensors; the momentum after the first round), the seconds its wall time."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from merit.bench.widths import build_theta0, width_overrides
from pipeline.checkpoint import write_manifest
from pipeline.config import DilocoMethod, load_config
from pipeline.data import prepare_data
from pipeline.diloco.compress import compress
from pipeline.diloco.plan import DilocoPlan, diloco_plan
from pipeline.diloco.rounds import aggregate_part, aggregate_round, assemble_round, delta_dir
from pipeline.layout import CONFIG, bench_dir, start_run
from pipeline.merge.layout import ModelView
from pipeline.models import processor_for

MB = 2**20


def fabricate_round(plan: DilocoPlan, r: int, seed: int) -> None:
    """Round r's payloads of every worker as a worker publishes them: Δ_k of every floating tensor
    of θ0 as the model holds it, in the plan's compression, with the tokens and seconds a worker records."""
    theta = ModelView.open(plan.init)
    generator = torch.Generator().manual_seed(seed)
    for k in range(plan.size):
        folder = delta_dir(plan, r, k)
        folder.mkdir(parents=True)
        payload = {}
        for name, info in theta.loaded().items():
            if info.dtype.is_floating_point:
                delta = 1e-2 * torch.randn(info.shape, generator=generator)
                payload |= compress(name, delta, plan.compression)
        save_file(payload, folder / "model.safetensors")
        seconds = {"inner": 1.0, "load": 0.1, "save": 0.1}
        write_manifest(folder, tokens=100 * (k + 1), seconds=seconds, kind="diloco_delta", round=r, worker=k)


def measure(run_dir: Path, overrides: list[str], workers: int, aggregators: int, method: str) -> dict[str, float]:
    """The second of two rounds (it reads the first's momentum) of R workers with S aggregators:
    the payload of a worker, what the busiest aggregator read and its seconds, and the seconds of
    assembling the parts into the round's global weights."""
    cfg = load_config(run_dir / CONFIG, [*overrides, f"diloco.workers={workers}"])
    entry = DilocoMethod(name="bench", method=method, outer_lr=0.7, outer_momentum=0.9)
    folder = bench_dir(run_dir, f"aggregators/R{workers}-S{aggregators}")
    plan = diloco_plan(cfg, run_dir, entry).model_copy(update={"folder": str(folder), "aggregators": aggregators})
    fabricate_round(plan, 0, seed=0)
    aggregate_round(plan, 0, list(range(workers)))
    fabricate_round(plan, 1, seed=1)
    seconds = []
    for part in range(aggregators):  # one after another here; on machines of their own at once
        start = time.perf_counter()
        aggregate_part(plan, 1, list(range(workers)), part)
        seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    record = assemble_round(plan, 1, list(range(workers)))
    assemble = time.perf_counter() - start
    shutil.rmtree(folder)
    read, sent = record["bytes"]["aggregator_read"], record["bytes"]["sent"]
    return {"payload_mb": sent / workers / MB, "read_mb": read / MB, "seconds": max(seconds), "assemble": assemble}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="numbers of workers R")
    parser.add_argument("--size", choices=["small", "medium", "3b"], default="small", help="θ0's widths")
    parser.add_argument("--compression", choices=["none", "bf16", "int8", "int4"], default="none")
    parser.add_argument("--method", default="iso_c", help="the merge method that aggregates")
    parser.add_argument("--workdir", help="where to write θ0 and the payloads (default: the temp folder)")


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one aggregator a core, as on a machine of its own
    overrides = [*width_overrides(args.size), "data.builtin.examples_per_source=8", "warmup.steps=0"]
    overrides.append(f"diloco.compression={args.compression}")
    if args.workdir:  # a folder that does not exist yet is made, as every bench's output folder is
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        cfg, run_dir = start_run(None, overrides, Path(tmp) / "run")
        counts = build_theta0(cfg, run_dir)
        prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
        print(
            f"θ0: Qwen2.5-VL at the '{args.size}' widths, {counts['total'] / 1e6:.1f} M parameters; "
            f"payloads {args.compression}; {args.method}; 1 thread an aggregator"
        )
        header = ["R", "S", "payload MB / worker", "read MB / aggregator", "read / (R · payload)"]
        header += ["aggregator s", "assembly s"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for workers in args.workers:
            for aggregators in sorted({1, 2, workers}):
                m = measure(run_dir, overrides, workers, aggregators, args.method)
                ratio = m["read_mb"] / (workers * m["payload_mb"])
                print(
                    f"| {workers} | {aggregators} | {m['payload_mb']:.1f} | {m['read_mb']:.1f} | {ratio:.2f} | "
                    f"{m['seconds']:.2f} | {m['assemble']:.2f} |",
                    flush=True,
                )
    print(
        "read: what the busiest of the S aggregators reads in a round after the first (every payload twice, "
        "θ's tensors, the outer momentum), as its readers count it; aggregator s: the slowest part's"
    )
