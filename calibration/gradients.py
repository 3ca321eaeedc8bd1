"""Per-source mean gradients at θ0 (MERIT step 2), sketched to a fixed dimension.

g_d is the gradient of the instruction-tuning loss averaged over every supervised token of n
calibration examples of source d: batches are weighted by their share of those tokens, so the
result equals one backward pass over all n examples at once. No optimizer step is taken;
gradients are computed only for the chosen parameters and the model is left as it was.
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from calibration.errors import CalibrationError
from pipeline.checkpoint import write_json_atomic
from pipeline.data import Collator, Encoded, Encoder, Example
from pipeline.models.loss import supervised_nll


def is_matrix(name: str, p: torch.Tensor) -> bool:
    """A weight matrix, or a mixture of experts' fused tensor (``mlp.experts.gate_up_proj``: one
    matrix per expert), not a norm, bias or convolution kernel."""
    return p.dim() == 2 or (p.dim() == 3 and ".mlp.experts." in name)


def select_parameters(model: torch.nn.Module, patterns: Sequence[str], matrices_only: bool = True) -> list[str]:
    names = [
        name
        for name, p in model.named_parameters()
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns) and (is_matrix(name, p) or not matrices_only)
    ]
    if not names:
        raise CalibrationError(f"no parameter matches {list(patterns)} (matrices_only={matrices_only})")
    return names


class Sketch:
    """A seeded linear map from the concatenated gradient (D coordinates) to ``dim`` coordinates.

    ``stride``: every s-th coordinate from a seeded offset, s = D // dim (the paper's
    "stride-s subsampling"). ``projection``: a CountSketch, each coordinate added with a seeded
    random sign into a seeded random bucket: an unbiased random projection that needs no D × dim
    matrix (its hashes are regenerated per call, so memory stays O(largest tensor)).
    When D ≤ dim both keep every coordinate.
    """

    def __init__(self, kind: str, sizes: Sequence[int], dim: int, seed: int):
        self.kind, self.sizes, self.seed = kind, list(sizes), seed
        self.total = sum(self.sizes)
        self.dim = min(dim, self.total)
        self.identity = self.dim == self.total
        if kind == "stride" and not self.identity:
            stride = self.total // self.dim
            offset = random.Random(seed).randrange(stride)
            picked = offset + stride * torch.arange(self.dim)
            starts = torch.tensor([0, *self.sizes]).cumsum(0)
            self._local = [picked[(picked >= a) & (picked < b)] - a for a, b in itertools.pairwise(starts)]

    def __call__(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = [g.reshape(-1).float() for g in grads]
        if self.identity:
            return torch.cat(flat)
        if self.kind == "stride":
            return torch.cat([g[idx.to(g.device)] for g, idx in zip(flat, self._local)])
        out = torch.zeros(self.dim, device=flat[0].device)
        for j, g in enumerate(flat):
            gen = torch.Generator(device=g.device).manual_seed(self.seed * 1_000_003 + j)
            bucket = torch.randint(self.dim, g.shape, generator=gen, device=g.device)
            sign = torch.randint(2, g.shape, generator=gen, device=g.device).mul_(2).sub_(1)
            out.index_add_(0, bucket, g * sign)
        return out


@dataclass
class SourceGradients:
    sources: list[str]
    matrix: torch.Tensor  # (S, dim) float32, CPU
    examples: dict[str, int]
    supervised_tokens: dict[str, int]
    parameters: int  # coordinates before the sketch
    sketch: str
    seconds: float
    notes: list[str] = field(default_factory=list)

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / ".gradients.safetensors.tmp"
        save_file({"gradients": self.matrix.contiguous()}, str(tmp))
        tmp.replace(folder / "gradients.safetensors")
        meta = {k: v for k, v in self.__dict__.items() if k != "matrix"}
        write_json_atomic(folder / "gradients.json", meta)


def calibration_sample(
    examples: dict[str, list[Example]], n: int, seed: int
) -> tuple[dict[str, list[Example]], list[str]]:
    """A seeded sample of ``n`` examples per source; a smaller source gives all it has, and says so."""
    sample, notes = {}, []
    for name, items in examples.items():
        if len(items) < n:
            notes.append(f"source '{name}': {len(items)} examples, fewer than n={n}; using all of them")
        order = list(range(len(items)))
        random.Random(f"{seed}/calibration/{name}").shuffle(order)
        sample[name] = [items[i] for i in sorted(order[:n])]
    return sample, notes


def estimate_source_gradients(
    model: torch.nn.Module,
    examples: dict[str, list[Example]],
    encoder: Encoder,
    collator: Collator,
    param_names: Sequence[str],
    sketch_kind: str = "projection",
    dim: int = 16384,
    batch_size: int = 16,
    seed: int = 0,
    devices: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    checkpointing: bool = False,
) -> SourceGradients:
    """The S × dim matrix of sketched per-source mean gradients (``examples`` already sampled).
    ``checkpointing``: recompute activations in the backward pass, as the branches do (at 7B a
    batch of 8 long examples holds ~40 GB of activations otherwise)."""
    start = time.perf_counter()
    params = dict(model.named_parameters())
    sketch = Sketch(sketch_kind, [params[n].numel() for n in param_names], dim, seed)
    replicas = _Replicas(model, param_names, devices or [str(next(model.parameters()).device)], checkpointing)
    rows, used, tokens = [], {}, {}
    try:
        for name, items in examples.items():
            if not items:
                raise CalibrationError(f"source '{name}' has no calibration examples")
            batches = [encoder.encode_batch(items[i : i + batch_size]) for i in range(0, len(items), batch_size)]
            supervised = sum(e.num_supervised for batch in batches for e in batch)
            if supervised == 0:
                raise CalibrationError(f"source '{name}': no supervised tokens in its calibration examples")
            row = replicas.mean_gradient(batches, collator, supervised, sketch)
            if not torch.isfinite(row).all():
                raise CalibrationError(f"source '{name}': the gradient contains NaN or Inf")
            rows.append(row.cpu())
            used[name], tokens[name] = len(items), supervised
            if progress:
                progress(name)
    finally:
        replicas.restore()
    return SourceGradients(
        list(examples), torch.stack(rows), used, tokens, sketch.total, sketch_kind, time.perf_counter() - start
    )


class _Replicas:
    """The model on each device (data parallel over batches), with gradients enabled only for
    the chosen parameters; :meth:`restore` puts the caller's model back as it was."""

    def __init__(
        self, model: torch.nn.Module, param_names: Sequence[str], devices: Sequence[str], checkpointing: bool = False
    ):
        self.model, self.names, self.checkpointing = model, list(param_names), checkpointing
        self.saved = {n: p.requires_grad for n, p in model.named_parameters()}
        self.was_training = model.training
        wanted = set(self.names)
        for n, p in model.named_parameters():
            p.requires_grad_(n in wanted)
        if checkpointing:
            # transformers checkpoints layers only in train mode, which changes no number of a
            # Qwen2.5-VL (its dropout rates are 0); it is switched back by restore().
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train(checkpointing)
        home = str(next(model.parameters()).device)
        self.models = [model if d == home and i == 0 else copy.deepcopy(model).to(d) for i, d in enumerate(devices)]
        self.devices = list(devices)

    def mean_gradient(
        self, batches: list[list[Encoded]], collator: Collator, supervised: int, sketch: Sketch
    ) -> torch.Tensor:
        parts: list[torch.Tensor | None] = [None] * len(self.models)
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                model, device = self.models[k], self.devices[k]
                params = dict(model.named_parameters())
                # A bf16 .grad rounds every accumulated batch to 8 mantissa bits: then each
                # batch's gradient is sketched in fp32 and the sketches are summed (the sketch is
                # linear, so this equals the sketch of the sum). fp32 gradients accumulate exactly
                # and are sketched once.
                per_batch = any(params[n].dtype != torch.float32 for n in self.names)
                total = None
                model.zero_grad(set_to_none=True)
                for i, batch in enumerate(mine := batches[k :: len(self.models)]):
                    nll, _ = supervised_nll(model, {key: v.to(device) for key, v in collator(batch).items()})
                    (nll / supervised).backward()
                    if per_batch or i == len(mine) - 1:
                        zeros = torch.zeros_like
                        grads = [params[n].grad if params[n].grad is not None else zeros(params[n]) for n in self.names]
                        part = sketch(grads)
                        total = part if total is None else total.add_(part)
                        model.zero_grad(set_to_none=True)
                parts[k] = total.to(self.devices[0]) if total is not None else None
            except BaseException as err:  # re-raised in the caller's thread
                errors.append(err)

        if len(self.models) == 1:
            work(0)
        else:
            threads = [threading.Thread(target=work, args=(k,)) for k in range(len(self.models))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return torch.stack([p for p in parts if p is not None]).sum(0)

    def restore(self) -> None:
        for n, p in self.model.named_parameters():
            p.requires_grad_(self.saved[n])
            p.grad = None
        if self.checkpointing:
            self.model.gradient_checkpointing_disable()
        self.model.train(self.was_training)


def default_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
