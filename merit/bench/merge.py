"""``merit bench merge``: merge throughput on generated checkpoints beside the streaming floor,
unloaded and beside competing busy processes, and beside mergekit.

For K = 2, 4, 8 generated checkpoints of ``--size-mb`` each (a Qwen2 model's tensors and its
``config.json``, random, in ``--dtype``), every method runs in a fresh process (so its peak RSS
is its own), ``--repeats`` times; the median is printed (these machines are noisy). The floor,
measured in the same run on the same files, is a plain streaming read of every tensor of the
files a method reads (θ0 and the K models; the K models alone for the weighted average, which
never reads θ0) plus an fp32 weighted sum. It copies each tensor out of the file, as earlier
pages' floors did; a merge reads memory-map views, so an average can beat it. Targets: the
averages at ≥ 50 % of it, TIES and DARE at ≥ 25 %.

``--width 7b`` gives the layers Qwen2.5-7B's shapes (its MLP matrices 3584 × 18944: at K = 8 their
task vectors exceed the default block budget, so the element-wise methods take the row-block path).
``--cache warm cold`` measures each figure with the inputs as the last run left them and again with
them dropped from the page cache first (as a fresh machine reads them); the whole commands take
turns in every repeat, so that a drift of the machine weighs on each alike.

``--load N`` measures everything again beside N busy processes (default: as many as this
process has CPUs) and prints the loaded/unloaded ratio: a process that shares C cores with N
single-threaded spinners gets C / (C + N) of them, 2× its unloaded time for N = C.

``--mergekit CMD`` times whole commands: ``merit merge`` and mergekit (``CMD CONFIG OUT``, e.g.
``mergekit-yaml``) on the same checkpoints for the methods both have, and both on tiny
checkpoints (their start-up). Beside them it times the whole-command floor, ``merit merge``
averaging every file a method reads, and prints mergekit's seconds over it: the ratio no merge
of these files can pass on this machine, whatever its method.

Memory: peak RSS includes the input files' pages that safetensors memory-maps (file-backed page
cache, reclaimable, shared); peak anonymous RSS (sampled every 10 ms) is what the merge itself
allocates, which O((K + 2) × largest tensor) bounds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

import torch
import yaml
from safetensors.torch import save_file

from pipeline.memory import AnonymousPeak, max_rss
from pipeline.merge import CheckpointReader, MergeSpec, get_method, merge_checkpoints
from pipeline.threads import available_cpus, set_threads

# (hidden, intermediate, vocabulary, heads, key-value heads): Qwen2.5-3B's widths, Qwen2.5-7B's (its MLP
# matrices 3584 × 18944, 68 M entries), or a tiny one for start-up runs. The vocabulary is kept small: the
# embedding is one tensor, read once, where the layers are what a merge spends its time on.
WIDTHS = {"3b": (2048, 5632, 8192, 16, 2), "7b": (3584, 18944, 8192, 28, 4)}
TINY = (64, 176, 512, 16, 2)


@dataclass(frozen=True)
class Shared:
    """A method and mergekit's counterpart, set up for the same merge."""

    params: dict  # ours
    theirs: str  # mergekit's method
    per_model: dict | None = field(default_factory=dict)  # mergekit's per-model parameters (None: no weight)
    shared: dict = field(default_factory=dict)  # mergekit's global parameters
    base: bool = True  # both read θ0 (mergekit's slerp reads the first model as its base instead)


METHODS = {
    "weighted_average": Shared({}, "linear", base=False),
    "task_arithmetic": Shared({}, "task_arithmetic"),
    "ties": Shared({"density": 0.2}, "ties", {"density": 0.2}),
    "dare": Shared({"drop": 0.9}, "dare_linear", {"density": 0.1}),
    "dare_ties": Shared({"density": 0.1}, "dare_ties", {"density": 0.1}),
    "breadcrumbs": Shared({"density": 0.9, "gamma": 0.01}, "breadcrumbs", {"density": 0.9, "gamma": 0.01}),
    "breadcrumbs_ties": Shared({"density": 0.9, "gamma": 0.01}, "breadcrumbs_ties", {"density": 0.9, "gamma": 0.01}),
    "della": Shared({"density": 0.7, "epsilon": 0.15}, "della", {"density": 0.7, "epsilon": 0.15}),
    "della_linear": Shared({"density": 0.7, "epsilon": 0.15}, "della_linear", {"density": 0.7, "epsilon": 0.15}),
    "sce": Shared({"select_topk": 0.5}, "sce", None, {"select_topk": 0.5}),
    "model_stock": Shared({}, "model_stock", None),
    "multislerp": Shared({}, "multislerp"),
    "karcher": Shared({}, "karcher", None, base=False),
    "nuslerp": Shared({}, "nuslerp"),
    "slerp": Shared({}, "slerp", None, {"t": 0.5}, base=False),
}
DEFAULT_METHODS = ["weighted_average", "task_arithmetic", "ties", "dare"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def qwen2_config(size_mb: float, dtype: str, width: str = "3b") -> dict:
    """A Qwen2 config (tied embeddings) with as many layers as ``size_mb`` holds (at least one): at
    ``width``'s widths, or 64 wide under 16 MB."""
    hidden, intermediate, vocab, heads, kv_heads = WIDTHS[width] if size_mb >= 16 else TINY
    kv = hidden // heads * kv_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + hidden + 2 * kv + 3 * hidden * intermediate + 2 * hidden
    budget = size_mb * 1e6 / DTYPES[dtype].itemsize - vocab * hidden - hidden
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": max(1, math.ceil(budget / per_layer)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for name, shape in (
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.q_proj.bias", (hidden,)),
            ("self_attn.k_proj.weight", (kv, hidden)),
            ("self_attn.k_proj.bias", (kv,)),
            ("self_attn.v_proj.weight", (kv, hidden)),
            ("self_attn.v_proj.bias", (kv,)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (intermediate, hidden)),
            ("mlp.up_proj.weight", (intermediate, hidden)),
            ("mlp.down_proj.weight", (hidden, intermediate)),
            ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,)),
        ):
            shapes[f"{prefix}.{name}"] = shape
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def generate(
    folder: Path, k: int, size_mb: float, dtype: str = "bfloat16", width: str = "3b"
) -> tuple[Path, list[Path]]:
    """θ0 and K models near it (θ0 + 0.01 · noise), each a folder with its config.json."""
    config = qwen2_config(size_mb, dtype, width)
    g = torch.Generator().manual_seed(0)
    base = {n: torch.randn(s, generator=g).to(DTYPES[dtype]) for n, s in checkpoint_shapes(config).items()}
    paths = []
    for i in range(k + 1):
        path = folder / ("base" if i == 0 else f"m{i}")
        path.mkdir()
        noise = {} if i == 0 else {n: (0.01 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in base.items()}
        tensors = {n: t + noise[n] if noise else t for n, t in base.items()}
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths[0], paths[1:]


def streaming_floor(paths: list[Path]) -> float:
    """Seconds for a plain streaming read of every tensor of ``paths`` plus an fp32 weighted sum."""
    readers, w = [CheckpointReader(p) for p in paths], 1.0 / len(paths)
    start = time.perf_counter()
    for name in readers[0].info:
        acc = readers[0].get(name).float().mul_(w)
        for reader in readers[1:]:
            acc.add_(reader.get(name), alpha=w)
    return time.perf_counter() - start


def _measured(queue, work) -> None:
    set_threads()
    with AnonymousPeak() as anon:
        result = work()
    queue.put((result, max_rss(), anon.peak))


def _run_method(queue, method: str, base: Path, models: list[Path], out: Path, device: str) -> None:
    spec = merge_spec(method, base, models, out, device)
    _measured(queue, lambda: merge_checkpoints(spec, progress=False).total_seconds)


def _floor_process(queue, paths: list[Path]) -> None:
    _measured(queue, lambda: streaming_floor(paths))


def run_in_process(target, *args):
    """What ``target(queue, *args)`` puts on its queue, run in a fresh process. A child that dies
    first (an error, a full disk, the OOM killer) raises here: a bare ``queue.get`` would wait forever."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue, *args))
    proc.start()
    while True:
        alive = proc.is_alive()  # read before the get: a result put just before the child exited is still taken
        try:
            result = queue.get(timeout=1)
        except Empty:
            if alive:
                continue
            raise RuntimeError(f"{target.__name__} exited with code {proc.exitcode} and no result") from None
        proc.join()
        return result


def merge_spec(method: str, base: Path, models: list[Path], out: Path, device: str = "cpu") -> MergeSpec:
    return MergeSpec(
        base_model=str(base) if METHODS[method].base else None,
        models=[{"path": str(p)} for p in models],
        method=method,
        params=METHODS[method].params,
        out_path=str(out),
        device=device,
    )


def median_of(repeats: int, measure) -> tuple[float, float, float]:
    """Median seconds of ``repeats`` measurements, and the largest peak RSS and anonymous RSS."""
    results = [measure() for _ in range(repeats)]
    return statistics.median(r[0] for r in results), max(r[1] for r in results), max(r[2] for r in results)


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU (pure Python: one core each) until the block ends."""
    procs: list[subprocess.Popen] = []
    try:
        procs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n))
        time.sleep(0.5)  # let them start spinning
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def timed_command(argv: list[str], repeats: int) -> float:
    """Median wall seconds of a whole command (its output discarded; a failure raises)."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise SystemExit(f"merit bench merge: {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def command_pair(
    method: str, base: Path, models: list[Path], folder: Path, mergekit: str, dtype: str, device: str = "cpu"
) -> tuple[list[str], list[str]]:
    """``merit merge`` and mergekit's command for the same merge (outputs under ``folder``)."""
    spec = folder / f"{method}.yaml"
    ours = merge_spec(method, base, models, folder / f"ours-{method}", device)
    spec.write_text(yaml.safe_dump(ours.model_dump(mode="json")))
    shared = METHODS[method]
    entries = [
        {"model": str(p)} | ({} if shared.per_model is None else {"parameters": {"weight": 1.0, **shared.per_model}})
        for p in models
    ]
    config = {"merge_method": shared.theirs, "models": entries, "dtype": dtype, "parameters": shared.shared}
    if shared.base or method == "slerp":
        config["base_model"] = str(base if shared.base else models[0])
    (folder / f"{method}-mergekit.yaml").write_text(yaml.safe_dump(config))
    ours = [sys.executable, "-m", "merit", "merge", str(spec)]
    return ours, [*mergekit.split(), str(folder / f"{method}-mergekit.yaml"), str(folder / f"mergekit-{method}")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="numbers of checkpoints")
    parser.add_argument("--size-mb", type=int, default=512, help="size of each generated checkpoint")
    parser.add_argument(
        "--width", choices=sorted(WIDTHS), default="3b", help="the layers' widths: Qwen2.5-3B's or 7B's"
    )
    parser.add_argument(
        "--cache",
        nargs="+",
        choices=["warm", "cold"],
        default=["warm"],
        help="page-cache states of the inputs (cold: evicted before every measurement, as a fresh machine reads them)",
    )
    parser.add_argument(
        "--methods", help=f"comma-separated methods (default: {','.join(DEFAULT_METHODS)}; known: {','.join(METHODS)})"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the checkpoints' dtype")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workdir", help="where to generate the checkpoints (default: the temp folder)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure (the median is printed)")
    parser.add_argument(
        "--load",
        type=int,
        nargs="?",
        const=0,
        help="measure again beside N busy processes (no N: as many as this process has CPUs)",
    )
    parser.add_argument("--mergekit", metavar="CMD", help="also time mergekit's command (e.g. mergekit-yaml)")


def main(args: argparse.Namespace) -> None:
    methods = args.methods.split(",") if args.methods else DEFAULT_METHODS
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"merit bench merge: unknown methods {unknown}; known: {sorted(METHODS)}")
    load = (args.load or available_cpus()) if args.load is not None else 0
    if args.workdir:  # a folder that does not exist yet is made, as every bench's output folder is
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="merit-bench-merge-", dir=args.workdir))
    print(
        f"checkpoints of {args.size_mb} MB ({args.dtype}, {args.width} widths), {available_cpus()} CPUs, torch threads "
        f"{set_threads()}, median of {args.repeats}" + (f", loaded: beside {load} busy processes" if load else "")
    )
    headers = ["K", "method", "seconds", "GB/s read", "% floor", "peak RSS GB", "anon GB"]
    headers += ["loaded s", "loaded/unloaded"] if load else []
    print("  ".join(f"{h:>{len(h) if i != 1 else 24}}" for i, h in enumerate(headers)))
    try:
        for k in args.k:
            folder = root / f"k{k}"
            folder.mkdir()
            base, models = generate(folder, k, args.size_mb, args.dtype, args.width)
            for cache in args.cache:
                floors, tag = {}, f" {cache}" if len(args.cache) > 1 else ""
                for reads_base in (False, True):
                    paths = [base, *models] if reads_base else models
                    gb = sum(p.joinpath("model.safetensors").stat().st_size for p in paths) / 1e9
                    measure = evicting(cache, paths, functools.partial(run_in_process, _floor_process, paths))
                    floors[reads_base] = row(args, load, k, f"floor ({len(paths)} files){tag}", gb, None, measure)
                for method in fitting(methods, k):
                    floor, gb = floors[METHODS[method].base]
                    inputs = [base, *models] if METHODS[method].base else models
                    merged = functools.partial(_merged, method, base, models, folder / f"out-{method}", args.device)
                    row(args, load, k, f"{method}{tag}", gb, floor, evicting(cache, inputs, merged))
            if args.mergekit:
                compare_with_mergekit(args, fitting(methods, k), base, models, folder)
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def evicting(cache: str, inputs: list[Path], measure):
    """``measure``, its inputs evicted from the page cache before every call where ``cache`` is cold."""
    return (lambda: (evict(inputs), measure())[1]) if cache == "cold" else measure


def fitting(methods: list[str], k: int) -> list[str]:
    """The methods that merge K inputs (SLERP: 2)."""
    fit = []
    for method in methods:
        try:
            get_method(method).check_inputs(k)
            fit.append(method)
        except ValueError:
            print(f"    {method}: not run at K = {k} (it merges {get_method(method).inputs} inputs)")
    return fit


def _merged(method: str, base: Path, models: list[Path], out: Path, device: str):
    result = run_in_process(_run_method, method, base, models, out, device)
    shutil.rmtree(out)
    return result


def row(args, load: int, k: int, label: str, gb: float, floor: float | None, measure) -> tuple[float, float]:
    """Measure, print one row; returns (seconds, GB read)."""
    seconds, rss, anon = median_of(args.repeats, measure)
    cells = [f"{k:>2}", f"{label:<24}", f"{seconds:7.2f}", f"{gb / seconds:9.2f}"]
    cells += [f"{100 * (floor or seconds) / seconds:7.0f}", f"{rss / 1e9:11.2f}", f"{anon / 1e9:7.2f}"]
    if load:
        with busy_processes(load):
            loaded, _, _ = median_of(args.repeats, measure)
        cells += [f"{loaded:8.2f}", f"{loaded / seconds:15.2f}"]
    print("  ".join(cells), flush=True)
    return seconds, gb


def compare_with_mergekit(args, methods: list[str], base: Path, models: list[Path], folder: Path) -> None:
    """Whole commands, ours and mergekit's (with ``--cuda`` too when ours runs on the GPU), on these
    checkpoints and on tiny ones (start-up); each repeat runs every command once, in turn, under every
    cache state, so that a drift of the machine weighs on all of them alike."""
    tiny = folder / "tiny"
    tiny.mkdir()
    tiny_base, tiny_models = generate(tiny, 2, 0.5, args.dtype)
    floors = {
        (reads_base, cache): floor_command(base, models, folder, reads_base, args.repeats, cache == "cold")
        for reads_base in (False, True)
        for cache in args.cache
    }
    for cache in args.cache:
        print(
            f"   floor (whole command, {cache}): {floors[False, cache]:.2f} s over the K models, "
            f"{floors[True, cache]:.2f} s with θ0"
        )
    tools = ["merit", "mergekit", *(["mergekit --cuda"] if args.device == "cuda" else [])]
    columns = [f"{tool} {cache}" for cache in args.cache for tool in tools]
    columns += [f"mergekit/merit {cache}" for cache in args.cache] + [f"mergekit/floor {c}" for c in args.cache]
    print(f"   {'whole command':<18}  " + "  ".join(f"{c:>{max(10, len(c))}}" for c in columns))
    cases = [(m, base, models, folder, f"{m}, K = {len(models)}") for m in methods]
    cases.append(("weighted_average", tiny_base, tiny_models, tiny, "start-up (tiny)"))
    for method, b, ms, where, label in cases:
        ours, theirs = command_pair(method, b, ms, where, args.mergekit, args.dtype, args.device)
        commands = dict(zip(tools, [ours, theirs, [*theirs[:-2], "--cuda", *theirs[-2:]]]))
        seconds = alternated(commands, [b, *ms], args.cache, args.repeats, where, method)
        cells = [seconds[tool, cache] for cache in args.cache for tool in tools]
        cells += [seconds["mergekit", cache] / seconds["merit", cache] for cache in args.cache]
        floor = [floors[METHODS[method].base, cache] for cache in args.cache]
        cells += [seconds["mergekit", c] / f for c, f in zip(args.cache, floor)] if where == folder else []
        print(f"   {label:<18}  " + "  ".join(f"{v:>{max(10, len(c))}.2f}" for v, c in zip(cells, columns)), flush=True)


def alternated(
    commands: dict[str, list[str]], inputs: list[Path], caches: list[str], repeats: int, where: Path, method: str
) -> dict[tuple[str, str], float]:
    """Median seconds of each command under each cache state (``cold``: the input files evicted
    from the page cache first, as a fresh machine reads them), the commands taking turns."""
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for cache in caches:
            for tool, argv in commands.items():
                if cache == "cold":
                    evict(inputs)
                seconds.setdefault((tool, cache), []).append(timed_command(argv, 1))
                for out in where.glob(f"*-{method}"):  # the output, before the next command writes its own
                    shutil.rmtree(out)
    return {key: statistics.median(values) for key, values in seconds.items()}


def evict(folders: list[Path]) -> None:
    """Every file of ``folders`` dropped from the page cache (written back first: dirty pages stay)."""
    for folder in folders:
        for file in folder.iterdir():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def floor_command(base: Path, models: list[Path], folder: Path, reads_base: bool, repeats: int, cold: bool) -> float:
    """Median seconds of the whole-command floor: ``merit merge`` averaging every file a method
    reads (the K models, and θ0 as one more input where the method reads it). It starts up, reads
    those bytes, writes an output of the same size and computes one multiply-add per entry read,
    so mergekit's seconds over it are the largest ratio any merge of these files reaches on this
    machine; its writes land in the page cache as a merge's do. ``cold``: its inputs evicted first."""
    paths = [base, *models] if reads_base else models
    spec, out = folder / f"floor-{len(paths)}.yaml", folder / f"floor-{len(paths)}"
    spec.write_text(yaml.safe_dump(merge_spec("weighted_average", base, paths, out).model_dump(mode="json")))
    seconds = []
    for _ in range(repeats):
        if cold:
            evict(paths)
        seconds.append(timed_command([sys.executable, "-m", "merit", "merge", str(spec)], 1))
        shutil.rmtree(out)
    return statistics.median(seconds)
