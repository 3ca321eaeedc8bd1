"""``merit bench diloco``: DiLoCo, IsoLoCo and plain averaging against data-parallel training, at a
small standard setting anyone can rerun and compare with the papers' tables.

A text-only ``Qwen2ForCausalLM`` (hidden 128, 4 layers, 4 heads, 2 KV heads, intermediate 384,
untied embeddings, bytes 0–255 plus an end-of-document token, context 128: 0.85 M parameters)
learns the Python standard library's own top-level modules of at most 100 kB each (installed
with Python: 161 files, 3.76 MB under CPython 3.11; one file in 20 held out by a hash of its
path). The R workers live in one process and take iid
shards; every method starts from the same θ0 and sees the same tokens in the same steps: the
data-parallel baseline's batch of R × 8 is the workers' R batches of 8 of that step. Inner
AdamW β (0.9, 0.95), wd 0.1, lr 1e-3, 10 % warm-up then cosine to 0.1× over the T·H steps,
gradients clipped to norm 1.0 (as the trainer does), each worker keeping its own AdamW state
across rounds (as in DiLoCo). The outer step is
:func:`pipeline.diloco.aggregate`, the library's own, so the figures are those of the code
that runs distributed.

Bytes are counted as sent by all R workers together: a DiLoCo round sends each Δ_k once, as
compressed (R · 4P in fp32; ``--compression bf16 int8 int4`` adds variants, each with error
feedback); data-parallel is a ring all-reduce of the fp32 gradients every step (2(R − 1)/R · 4P
per worker, 2(R − 1) · 4P in all).

``--lora-rank r`` adds a LoRA variant of each DiLoCo method, as the run's LoRA workers train
(:mod:`pipeline.diloco.lora`): each round each worker trains a fresh PEFT LoRA adapter (rank r,
alpha 2r, on every linear layer but ``lm_head``, as LLaMA-Factory's ``lora_target: all``) on the
global weights: A Kaiming-uniform and B = 0 drawn from (seed, worker, round), its AdamW moments
restarted from zero (the step count and the lr schedule go on). Its pseudo-gradient is
Δ_k = −(alpha / r)·B A on the adapted tensors (and nothing elsewhere: the embeddings, norms and
``lm_head`` stay θ0's), aggregated by the same library call and outer step; it sends the factors,
R · 4·r(m + n) bytes per adapted m × n tensor a round, in fp32.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sysconfig
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.ticker import MaxNLocator
from tqdm.auto import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM

from pipeline.checkpoint import write_text_atomic
from pipeline.config import TrainSection
from pipeline.diloco import DILOCO, ISOLOCO, OuterSGD, aggregate
from pipeline.diloco.aggregate import aggregate_deltas
from pipeline.figures import save_figure
from pipeline.merge import Rule
from pipeline.merge.layout import InMemory, ModelView
from pipeline.train.engine import lr_lambda, takes_muon

CONTEXT, EOD = 128, 256  # a window is CONTEXT inputs plus the shifted targets: CONTEXT + 1 ids
HELDOUT_EVERY = 20  # a file is held out when crc32(its relative path) % 20 == 0: 1 in 20 (5 %)
MAX_FILE_BYTES = 100_000  # larger modules (_pydecimal, turtle, inspect, ...) would dominate the stream
BATCH, EVAL_BATCH = 8, 64
LR, BETAS, WEIGHT_DECAY, WARMUP_RATIO, MIN_LR_RATIO = 1e-3, (0.9, 0.95), 0.1, 0.1, 0.1
CLIP = 1.0  # max gradient norm, the trainer's default (train.clip); none under Muon, as the trainer
MUON_LR, MUON_MOMENTUM = (
    TrainSection.model_fields["muon_lr"].default,
    TrainSection.model_fields["muon_momentum"].default,
)
MAX_THREADS = 4  # a 128-wide model gains nothing from more; the reference machine has 2 cores
# (hidden, layers, intermediate): the standard setting's model, and the smaller one of the bench at
# the IsoLoCo paper's scale (R up to 128 workers in one process: its steps are 4× cheaper).
MODELS = {"0.85M": (128, 4, 384), "0.13M": (64, 2, 192)}


@dataclass(frozen=True)
class Method:
    """A DiLoCo method: the workers' inner optimizer, the merge rules aggregating their
    pseudo-gradients (the first matching wins) and the outer step."""

    outer: OuterSGD
    rules: tuple[Rule, ...]
    inner: str = "adamw"  # or "muon": Muon on the hidden matrices, AdamW on the rest


def every(method: str, **params) -> tuple[Rule, ...]:
    return (Rule(pattern="*", method=method, params=params),)


NS = {"orthogonaliser": "newton_schulz"}
# The seed article's hybrid: the embeddings (and the untied lm_head) averaged, every other tensor Iso-C.
HYBRID = tuple(Rule(pattern=p, method="weighted_average") for p in ("*embed_tokens*", "lm_head*")) + every("iso_c")
METHODS = {
    "diloco": Method(OuterSGD(**DILOCO), every("weighted_average")),
    "isoloco": Method(OuterSGD(**ISOLOCO), every("iso_c")),
    "average": Method(OuterSGD(lr=1.0, momentum=0.0), every("weighted_average")),
    "isoc-sgd": Method(OuterSGD(lr=1.0, momentum=0.0), every("iso_c")),  # Iso-C, a plain SGD outer step
    "isoloco-ns": Method(OuterSGD(**ISOLOCO), every("iso_c", **NS)),
    "muloco": Method(OuterSGD(**DILOCO), every("weighted_average"), inner="muon"),
    "isoloco-muon": Method(OuterSGD(**ISOLOCO), every("iso_c"), inner="muon"),
    "hybrid": Method(OuterSGD(**ISOLOCO), HYBRID),
}


@dataclass
class Corpus:
    train: torch.Tensor  # (windows, CONTEXT + 1) token ids
    heldout: torch.Tensor
    train_files: list[str]
    heldout_files: list[str]
    train_bytes: int
    heldout_bytes: int
    root: Path  # the folder the files were read from


def stdlib_files(root: Path) -> list[str]:
    """The top-level modules of the standard library of at most MAX_FILE_BYTES, by relative path:
    no packages, which leaves out site-packages, the test suites, generated tables (encodings,
    pydoc_data) and the GUI apps (idlelib, tkinter) — 161 files, 3.76 MB under CPython 3.11."""
    return sorted(p.name for p in root.glob("*.py") if p.is_file() and p.stat().st_size <= MAX_FILE_BYTES)


def is_heldout(relative: str) -> bool:
    """A stable file-level split: the same files on every machine and Python run."""
    return zlib.crc32(relative.encode()) % HELDOUT_EVERY == 0


def windows(files: Iterable[bytes]) -> torch.Tensor:
    """The files' bytes as ids, EOD after each, in one stream cut into windows of CONTEXT + 1 ids
    that overlap by one, so every id but the first is a target once (a last partial window is
    dropped)."""
    stream = torch.cat(
        [torch.cat([torch.frombuffer(bytearray(f), dtype=torch.uint8).long(), torch.tensor([EOD])]) for f in files]
    )
    n = (len(stream) - 1) // CONTEXT
    return stream[: n * CONTEXT + 1].unfold(0, CONTEXT + 1, CONTEXT)


def load_corpus(root: Path | None = None) -> Corpus:
    """The modules of ``root`` (default: this Python's standard library), split by file so that
    held-out code was never seen in part."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    names = stdlib_files(root)
    kept, held = [n for n in names if not is_heldout(n)], [n for n in names if is_heldout(n)]
    train, heldout = [(root / n).read_bytes() for n in kept], [(root / n).read_bytes() for n in held]
    return Corpus(windows(train), windows(heldout), kept, held, sum(map(len, train)), sum(map(len, heldout)), root)


def tiny_qwen2(seed: int = 0, size: str = "0.85M") -> Qwen2ForCausalLM:
    """θ0, seeded: every method and every rerun starts from the same weights."""
    torch.manual_seed(seed)
    hidden, layers, intermediate = MODELS[size]
    config = Qwen2Config(
        vocab_size=EOD + 1,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=intermediate,
        tie_word_embeddings=False,
        max_position_embeddings=CONTEXT,
    )
    return Qwen2ForCausalLM(config).float()


def lm_loss(model: Qwen2ForCausalLM, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction=reduction)


@torch.no_grad()
def heldout_loss(model: Qwen2ForCausalLM, heldout: torch.Tensor) -> float:
    """Mean token NLL over every held-out window."""
    model.eval()
    total = sum(lm_loss(model, heldout[i : i + EVAL_BATCH], "sum").item() for i in range(0, len(heldout), EVAL_BATCH))
    return total / heldout[:, 1:].numel()


def epochs(indices: torch.Tensor, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of ``indices``, a fresh seeded permutation each epoch (no repeats within one)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = indices[torch.randperm(len(indices), generator=generator)]
        yield from order[: len(order) - len(order) % batch].split(batch)


def shard_batches(n_windows: int, workers: int, seed: int, batch: int = BATCH) -> list[Iterator[torch.Tensor]]:
    """Worker k's batches from its iid shard, windows k, k + R, k + 2R, ...: each shard samples
    every file of the stream."""
    return [epochs(torch.arange(k, n_windows, workers), batch, seed + k) for k in range(workers)]


def inner_optimizers(model: torch.nn.Module, inner: str) -> list[torch.optim.Optimizer]:
    """AdamW on every tensor; or, for ``muon``, torch's Muon (Keller Jordan's lr 0.02, Nesterov
    momentum 0.95, 5 Newton–Schulz steps, the update scaled by √max(1, rows/cols)) on the tensors the
    trainer gives Muon (:func:`pipeline.train.engine.takes_muon`) and AdamW on the others."""
    named = list(model.named_parameters())
    if inner == "adamw":
        return [torch.optim.AdamW([p for _, p in named], lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)]
    muon, rest = [p for n, p in named if takes_muon(n, p)], [p for n, p in named if not takes_muon(n, p)]
    return [
        torch.optim.Muon(muon, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WEIGHT_DECAY),
        torch.optim.AdamW(rest, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY),
    ]


def schedules(optimizers: list[torch.optim.Optimizer], steps: int) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """The trainer's warm-up and cosine over ``steps``, one scheduler an optimizer."""
    factor = lr_lambda(steps, WARMUP_RATIO, MIN_LR_RATIO)
    return [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]


class Learner:
    """A model with its own inner optimizer and schedule over the whole run: one DiLoCo worker (its
    optimizer state persists across rounds) or the data-parallel model."""

    def __init__(self, model: Qwen2ForCausalLM, steps: int, inner: str = "adamw"):
        self.model, self.clip = model, CLIP if inner == "adamw" else math.inf
        self.optimizers = inner_optimizers(model, inner)
        self.schedulers = schedules(self.optimizers, steps)

    def train(self, batches: Iterable[torch.Tensor]) -> list[float]:
        """One step a batch; returns the gradient norms before clipping."""
        self.model.train()
        norms = []
        for batch in batches:
            lm_loss(self.model, batch).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)))
            for optimizer, scheduler in zip(self.optimizers, self.schedulers):
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        return norms


class LoraLearner(Learner):
    """A DiLoCo worker that trains a fresh LoRA adapter on the global weights each round (rank r,
    alpha 2r, every linear layer but ``lm_head``); its AdamW steps the adapters only."""

    def __init__(self, model0: Qwen2ForCausalLM, steps: int, rank: int):
        from peft import LoraConfig, get_peft_model

        from pipeline.diloco.lora import LoraWeights

        model = copy.deepcopy(model0)
        targets = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
        get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))  # in place
        self.model, self.clip = model, CLIP
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizers = [torch.optim.AdamW(trainable, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)]
        self.schedulers = schedules(self.optimizers, steps)
        self.weights = LoraWeights.of(model, ModelView(InMemory(model0.state_dict()), model0.config.to_dict()))

    def start_round(self, theta: dict[str, torch.Tensor], seed: int) -> None:
        """The global's weights under a fresh adapter, its moments from zero."""
        self.weights.set_base(theta)
        self.weights.fresh_adapters(seed, self.optimizers[0])

    @property
    def payload_bytes(self) -> int:
        """The adapter's factors in fp32: what the worker sends a round."""
        return self.weights.stored_bytes()


@dataclass
class Run:
    """One method's run: its global model at the end and the curve of rounds 1 to T (θ0, the same
    for every method, is evaluated once)."""

    model: Qwen2ForCausalLM
    curve: list[dict] = field(default_factory=list)

    def record(self, heldout: torch.Tensor, bytes_sent: int, **figures: float | None) -> None:
        start = time.perf_counter()
        loss = heldout_loss(self.model, heldout)
        figures["eval_seconds"] = time.perf_counter() - start
        sent = bytes_sent + (self.curve[-1]["bytes_sent"] if self.curve else 0)
        self.curve.append({"round": len(self.curve) + 1, "loss": loss, "bytes_sent": sent, **figures})


def run_diloco(
    model0: Qwen2ForCausalLM,
    train: torch.Tensor,
    heldout: torch.Tensor,
    workers: int,
    inner_steps: int,
    rounds: int,
    method: str,
    seed: int = 0,
    compression: str = "none",
    lora_rank: int | None = None,
    streams: list[Iterator[torch.Tensor]] | None = None,
) -> Run:
    """R workers, H inner steps each from the global weights, then the library's outer step (the
    pseudo-gradients compressed as sent, with error feedback when compressed). With ``lora_rank``
    the workers train a fresh LoRA adapter each round and send its factors (fp32). ``streams``:
    each worker's batches (default: its iid shard, batches of 8)."""
    from pipeline.diloco.lora import round_seed

    if lora_rank is not None and compression != "none":
        raise ValueError("LoRA workers send their adapter's factors in fp32 here: compression none")
    chosen = METHODS[method]
    outer, rules = chosen.outer, list(chosen.rules)
    run = Run(copy.deepcopy(model0))
    theta = run.model.state_dict()  # the global model's own tensors: aggregate steps them in place
    steps = inner_steps * rounds
    if lora_rank is None:
        learners = [Learner(copy.deepcopy(model0), steps, chosen.inner) for _ in range(workers)]
    else:
        learners = [LoraLearner(model0, steps, lora_rank) for _ in range(workers)]
    streams = streams or shard_batches(len(train), workers, seed)
    momentum: dict[str, torch.Tensor] = {}
    residuals = None if compression == "none" else [{} for _ in range(workers)]
    kind = compression if lora_rank is None else f"LoRA r{lora_rank}"
    for t in tqdm(range(rounds), desc=f"R={workers} {method} {kind}", unit="round", leave=False):
        start = time.perf_counter()
        for k, (learner, stream) in enumerate(zip(learners, streams)):
            if lora_rank is None:
                learner.model.load_state_dict(theta)
            else:
                learner.start_round(theta, round_seed(seed, k, t))
            learner.train(train[next(stream)] for _ in range(inner_steps))
        trained = time.perf_counter()
        if lora_rank is None:
            stats = aggregate(
                theta,
                [w.model.state_dict() for w in learners],
                [1.0] * workers,
                rules,
                outer,
                momentum,
                compression=compression,
                residuals=residuals,
            )
        else:
            deltas, sent = [w.weights.deltas() for w in learners], sum(w.payload_bytes for w in learners)
            stats = aggregate_deltas(theta, deltas, [1.0] * workers, rules, outer, momentum, sent)
        aggregated = time.perf_counter()
        run.record(
            heldout,
            stats.bytes_sent,
            mean_cosine=stats.mean_cosine,
            train_seconds=trained - start,
            aggregate_seconds=aggregated - trained,
        )
    return run


def run_dp(
    model0: Qwen2ForCausalLM,
    train: torch.Tensor,
    heldout: torch.Tensor,
    workers: int,
    inner_steps: int,
    rounds: int,
    seed: int = 0,
    batches: Iterator[torch.Tensor] | None = None,
    inner: str = "adamw",
) -> Run:
    """One model with the ``inner`` optimizer, evaluated every H steps, on ``batches`` (default:
    batches of R × 8, the workers' batches of the same step)."""
    learner = Learner(copy.deepcopy(model0), inner_steps * rounds, inner)
    run = Run(learner.model)
    if batches is None:
        streams = shard_batches(len(train), workers, seed)
        batches = (torch.cat([next(s) for s in streams]) for _ in itertools.count())
    step_bytes = 2 * (workers - 1) * 4 * sum(p.numel() for p in model0.parameters())
    for _ in tqdm(range(rounds), desc=f"R={workers} dp", unit="round", leave=False):
        start = time.perf_counter()
        learner.train(train[next(batches)] for _ in range(inner_steps))
        run.record(heldout, step_bytes * inner_steps, mean_cosine=None, train_seconds=time.perf_counter() - start)
    return run


def run_method(
    method: str,
    model0: Qwen2ForCausalLM,
    corpus: Corpus,
    workers: int,
    inner_steps: int,
    rounds: int,
    compression: str = "none",
    lora_rank: int | None = None,
) -> dict:
    start = time.perf_counter()
    if method == "dp":
        run = run_dp(model0, corpus.train, corpus.heldout, workers, inner_steps, rounds)
    else:
        run = run_diloco(
            model0,
            corpus.train,
            corpus.heldout,
            workers,
            inner_steps,
            rounds,
            method,
            compression=compression,
            lora_rank=lora_rank,
        )
    final = run.curve[-1]
    return {
        "final_loss": final["loss"],
        "bytes_sent": final["bytes_sent"],
        "wall_seconds": time.perf_counter() - start,
        "curve": run.curve,
    }


def variants(
    methods: list[str], compressions: list[str], lora_ranks: list[int] = ()
) -> list[tuple[str, str, int | None]]:
    """(method, compression, LoRA rank) to run: data-parallel once (it sends gradients, not
    payloads); each DiLoCo method in every compression, then with LoRA workers of every rank (fp32)."""
    dense = [(m, c, None) for m in methods for c in (["none"] if m == "dp" else compressions)]
    return dense + [(m, "none", r) for m in methods if m != "dp" for r in lora_ranks]


def label(method: str, compression: str, lora_rank: int | None) -> str:
    if lora_rank is not None:
        return f"{method} LoRA r{lora_rank}"
    return method if compression == "none" else f"{method} {compression}"


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = [headers, ["---"] * len(headers), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def compare_with_dp(methods: dict[str, dict]) -> None:
    """Each method's degradation vs data-parallel, (loss − loss_dp) / loss_dp, as the IsoLoCo paper gives it."""
    if "dp" in methods:
        dp = methods["dp"]["final_loss"]
        for r in methods.values():
            r["vs_dp_percent"] = 100 * (r["final_loss"] - dp) / dp


def summary_table(results: dict[int, dict[str, dict]]) -> str:
    rows = [
        [
            str(workers),
            method,
            f"{r['final_loss']:.4f}",
            f"{r['vs_dp_percent']:+.2f} %" if "vs_dp_percent" in r else "—",
            f"{r['bytes_sent'] / 1e6:,.1f} MB",
            f"{r['wall_seconds']:.0f}",
        ]
        for workers, methods in results.items()
        for method, r in methods.items()
    ]
    return markdown(["R", "method", "held-out loss", "vs DP", "bytes sent", "wall s"], rows)


def curve_table(initial: float, methods: dict[str, dict]) -> str:
    rounds = len(next(iter(methods.values()))["curve"])
    rows = [["0", *[f"{initial:.4f}"] * len(methods)]]
    rows += [[str(t + 1), *[f"{r['curve'][t]['loss']:.4f}" for r in methods.values()]] for t in range(rounds)]
    return markdown(["round", *methods], rows)


def plot(results: dict[int, dict[str, dict]], out: Path) -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False, sharey=True)
    for ax, (workers, methods) in zip(axes[0], results.items()):
        for method, r in methods.items():
            ax.plot([c["round"] for c in r["curve"]], [c["loss"] for c in r["curve"]], label=method)
        ax.set(title=f"R = {workers}", xlabel="round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out loss (nats / byte)")
    axes[0][0].legend()
    save_figure(fig, out)


def write_results(
    out: Path, args: argparse.Namespace, corpus: Corpus, params: int, initial: float, results: dict
) -> None:
    """results.json: the setting, θ0's held-out loss, per R and method the final figures and the curve."""
    setting = {
        "corpus_files": {"train": len(corpus.train_files), "heldout": corpus.heldout_files},
        "corpus_bytes": {"train": corpus.train_bytes, "heldout": corpus.heldout_bytes},
        "corpus": f"{corpus.root}/*.py of at most {MAX_FILE_BYTES} bytes",
        "windows": {"train": len(corpus.train), "heldout": len(corpus.heldout), "context": CONTEXT},
        "parameters": params,
        "inner": {
            "lr": LR,
            "betas": BETAS,
            "weight_decay": WEIGHT_DECAY,
            "warmup": WARMUP_RATIO,
            "min": MIN_LR_RATIO,
            "max_grad_norm": CLIP,
        },
        "outer": {
            m: METHODS[m].outer.model_dump() | {"aggregate": rules_text(METHODS[m])} for m in args.methods if m != "dp"
        },
        "batch_per_worker": BATCH,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "bytes_sent": "by all workers: R payloads a round (DiLoCo methods, as compressed), "
        "2(R−1)·4P a step (dp, ring all-reduce)",
        "compression": args.compression,
        "error_feedback": "on for every compressed variant",
        "lora": {
            "ranks": lora_ranks(args),
            "alpha": "2 × rank",
            "targets": "every linear layer but lm_head",
            "each round": "a fresh adapter on the global (A Kaiming-uniform, B = 0; AdamW moments from 0, "
            "step count and lr schedule continued); Δ = −(alpha / r)·B A, factors sent in fp32",
        },
    }
    figures = {"setting": setting, "initial_loss": initial, "results": {f"R={w}": m for w, m in results.items()}}
    write_text_atomic(out / "results.json", json.dumps(figures, indent=1))


def rules_text(method: Method) -> str:
    """The method's merge rules in words: ``iso_c`` or ``*embed_tokens*: weighted_average, …, *: iso_c``."""
    if len(method.rules) == 1 and method.rules[0].pattern == "*":
        return method.rules[0].method
    return ", ".join(f"{r.pattern}: {r.method}" for r in method.rules)


def lora_ranks(args: argparse.Namespace) -> list[int]:
    return list(getattr(args, "lora_rank", None) or [])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, nargs="+", default=[4], help="numbers of workers R")
    parser.add_argument(
        "--inner-steps",
        type=int,
        nargs="+",
        default=[30],
        help="inner steps per round (H; several with --global-batch)",
    )
    parser.add_argument("--rounds", type=int, default=20, help="outer rounds (T; with --global-batch: --steps / H)")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=["dp", *METHODS],
        default=None,
        help="dp (data-parallel baseline), diloco, isoloco, average (outer η 1, μ 0), isoc-sgd (Iso-C, outer η 1, "
        "μ 0), isoloco-ns (Newton–Schulz Iso-C), muloco and isoloco-muon (Muon inside), hybrid (embeddings "
        "averaged, the rest Iso-C); default: dp, diloco, isoloco, average, with --slow: diloco",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        metavar="G",
        help="the bench at the IsoLoCo paper's scale: G windows a step split among the R workers (G / R each), "
        "the data-parallel baseline one run of batch G for every R, --steps inner steps in all at every H, "
        "each (method, R, H) a cell saved apart in --out and skipped when rerun",
    )
    parser.add_argument("--steps", type=int, default=240, help="with --global-batch: inner steps T·H of every cell")
    parser.add_argument("--model", choices=list(MODELS), default="0.85M", help="the model's size (parameters)")
    parser.add_argument(
        "--compression",
        nargs="+",
        choices=["none", "bf16", "int8", "int4"],
        default=["none"],
        help="pseudo-gradient compression(s) of the DiLoCo methods, each with error feedback but none",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        nargs="+",
        metavar="R",
        help="also each DiLoCo method with LoRA workers of these ranks: a fresh adapter (alpha 2 × rank, every "
        "linear layer but lm_head) each round, its factors sent in fp32",
    )
    parser.add_argument(
        "--out",
        default="runs/bench-diloco",
        help="folder for results.json and loss.png (with --slow: stragglers-<method>.json and .png)",
    )
    parser.add_argument(
        "--slow",
        nargs="+",
        metavar="K:F",
        help="straggler bench: worker K runs F× slower; the R workers run as processes and the sync modes "
        "(sync, quorum with drop or discount, async) are compared in wall time",
    )
    parser.add_argument("--quorum", type=int, help="with --slow: payloads a quorum round waits for (default R − 1)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["sync", "quorum-drop", "quorum-discount", "async"],
        default=["sync", "quorum-drop", "quorum-discount", "async"],
        help="with --slow: the sync modes to run",
    )


def main(args: argparse.Namespace) -> None:
    if args.methods is None:
        args.methods = ["diloco"] if args.slow else ["dp", "diloco", "isoloco", "average"]
    if args.global_batch:  # the paper's scale: cells of (method, R, H), resumable
        from merit.bench.diloco_scale import main as at_scale

        at_scale(args)
        return
    if len(args.inner_steps) != 1:
        raise SystemExit("merit: error: several --inner-steps need --global-batch")
    args.inner_steps = args.inner_steps[0]
    if args.slow:  # stragglers: the workers as processes, the sync modes compared in wall time
        if args.lora_rank:
            raise SystemExit("merit: error: --lora-rank is for the bench without --slow")
        from merit.bench.stragglers import main as stragglers

        stragglers(args)
        return
    torch.set_num_threads(min(MAX_THREADS, torch.get_num_threads()))
    corpus = load_corpus()
    model0 = tiny_qwen2(size=args.model)
    params = sum(p.numel() for p in model0.parameters())
    print(
        f"corpus: {len(corpus.train_files) + len(corpus.heldout_files)} stdlib modules, "
        f"{(corpus.train_bytes + corpus.heldout_bytes) / 1e6:.2f} MB; held out: {len(corpus.heldout_files)} files "
        f"(crc32 % {HELDOUT_EVERY} == 0), {corpus.heldout_bytes / 1e6:.2f} MB, {len(corpus.heldout)} windows; "
        f"train: {len(corpus.train)} windows of {CONTEXT} + 1"
    )
    print(
        f"model: Qwen2ForCausalLM, {params:,} parameters, fp32, {torch.get_num_threads()} threads; "
        f"H = {args.inner_steps}, T = {args.rounds}, batch {BATCH} per worker"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    initial = heldout_loss(model0, corpus.heldout)
    results: dict[int, dict[str, dict]] = {}
    for workers in args.workers:
        methods = results[workers] = {}
        for method, compression, rank in variants(args.methods, args.compression, lora_ranks(args)):
            methods[label(method, compression, rank)] = run_method(
                method, model0, corpus, workers, args.inner_steps, args.rounds, compression, rank
            )
            write_results(out, args, corpus, params, initial, results)  # a long run keeps what it has
        compare_with_dp(methods)
        write_results(out, args, corpus, params, initial, results)
        print(f"\nheld-out loss per round, R = {workers}:\n{curve_table(initial, methods)}")
    plot(results, out / "loss.png")
    print(f"\n{summary_table(results)}")
    print(
        "\nbytes sent: by all R workers together; DiLoCo methods send each Δ_k once a round, as compressed "
        "(R · 4P in fp32; LoRA workers their adapter's factors, 4·r(m + n) a tensor), "
        "data-parallel is a ring all-reduce of the gradients every step (2(R − 1) · 4P); "
        "wall s: training, aggregation and the held-out evaluation of every round"
    )
    print(f"outputs: {out / 'results.json'}, {out / 'loss.png'}")
