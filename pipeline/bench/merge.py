"""``merit bench merge``: merge throughput on generated checkpoints, beside the floor.

For K = 2, 4, 8 generated bf16 checkpoints of ``--size-mb`` each (default 512 MB, Qwen-like
shapes), every method is run in a fresh process (so its peak RSS is its own) and reported as
GB/s of input read; the floor, measured in the same run on the same files, is a plain
streaming read of every tensor of every input plus one add. Target: weighted average, task
arithmetic and TIES at ≥ 50 % of the floor.

Two memory figures per run: peak RSS, which includes the input files' pages that safetensors
memory-maps (file-backed page cache, reclaimable, shared), and peak anonymous RSS, the memory
the merge itself allocates (sampled every 10 ms), which is what O((K + 2) × largest tensor) bounds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.memory import AnonymousPeak, max_rss
from pipeline.merge import CheckpointReader, MergeSpec, merge_checkpoints

HIDDEN, INTERMEDIATE, VOCAB = 2048, 5632, 8192
DEFAULT_METHODS = ("weighted_average", "task_arithmetic", "ties", "dare")


def checkpoint_shapes(size_mb: int) -> dict[str, tuple[int, ...]]:
    """Qwen-like tensors (embeddings, attention, MLP, norms) adding up to about ``size_mb`` in bf16."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    layer, total = 0, VOCAB * HIDDEN * 2
    while total < size_mb * 1e6:
        prefix = f"model.layers.{layer}"
        for name, shape in (
            ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            ("mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            ("mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            ("input_layernorm.weight", (HIDDEN,)),
        ):
            shapes[f"{prefix}.{name}"] = shape
            total += torch.Size(shape).numel() * 2
        layer += 1
    return shapes


def generate(folder: Path, k: int, size_mb: int) -> tuple[Path, list[Path]]:
    shapes = checkpoint_shapes(size_mb)
    g = torch.Generator().manual_seed(0)
    base = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    paths = []
    for i, tensors in enumerate([base] + [None] * k):
        path = folder / ("base" if i == 0 else f"m{i}")
        path.mkdir()
        if tensors is None:
            tensors = {
                n: (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(torch.bfloat16) for n, t in base.items()
            }
        save_file(tensors, str(path / "model.safetensors"))
        paths.append(path)
    return paths[0], paths[1:]


def streaming_floor(paths: list[Path]) -> float:
    """Seconds for a plain streaming read of every tensor of every input plus one add."""
    readers = [CheckpointReader(p) for p in paths]
    start = time.perf_counter()
    for name in readers[0].info:
        acc = readers[0].get(name).float()
        for reader in readers[1:]:
            acc.add_(reader.get(name))
    return time.perf_counter() - start


def _measured(queue, work) -> None:
    with AnonymousPeak() as anon:
        result = work()
    queue.put((result, max_rss(), anon.peak))


def _run_method(queue, method: str, base: Path, models: list[Path], out: Path, device: str) -> None:
    spec = MergeSpec(
        base_model=str(base), models=[{"path": str(p)} for p in models], method=method, out_path=str(out), device=device
    )
    _measured(queue, lambda: merge_checkpoints(spec, progress=False).total_seconds)


def _floor_process(queue, paths: list[Path]) -> None:
    _measured(queue, lambda: streaming_floor(paths))


def run_in_process(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue, *args))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main(args: argparse.Namespace) -> None:
    methods = args.methods.split(",") if args.methods else list(DEFAULT_METHODS)
    root = Path(tempfile.mkdtemp(prefix="merit-bench-merge-", dir=args.workdir))
    largest = max(torch.Size(s).numel() for s in checkpoint_shapes(args.size_mb).values()) * 4 / 1e9
    print(
        f"checkpoints of {args.size_mb} MB (bf16), device {args.device}, torch threads {torch.get_num_threads()}, "
        f"largest tensor {largest:.3f} GB in fp32"
    )
    print(
        f"{'K':>2}  {'method':<18} {'seconds':>8} {'GB/s read':>10} {'% floor':>8} {'peak RSS GB':>12} {'anon GB':>8}"
    )
    try:
        for k in args.k:
            folder = root / f"k{k}"
            folder.mkdir()
            base, models = generate(folder, k, args.size_mb)
            read_gb = sum(p.joinpath("model.safetensors").stat().st_size for p in models) / 1e9
            floor, rss, anon = run_in_process(_floor_process, models)
            print(
                f"{k:>2}  {'floor (read+add)':<18} {floor:8.2f} {read_gb / floor:10.2f} {100:8.0f} "
                f"{rss / 1e9:12.2f} {anon / 1e9:8.2f}"
            )
            for method in methods:
                seconds, rss, anon = run_in_process(
                    _run_method, method, base, models, folder / f"out-{method}", args.device
                )
                print(
                    f"{k:>2}  {method:<18} {seconds:8.2f} {read_gb / seconds:10.2f} {100 * floor / seconds:8.0f} "
                    f"{rss / 1e9:12.2f} {anon / 1e9:8.2f}"
                )
                shutil.rmtree(folder / f"out-{method}")
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
