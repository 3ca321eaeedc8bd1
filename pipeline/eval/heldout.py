"""Score one model on the held-out split of every prepared source.

The loss is the instruction-tuning objective itself: next-token cross-entropy averaged over the
supervised (assistant answer) tokens. Per source the NLL is summed and the tokens counted, so
the loss is token-weighted over its examples and independent of batching and padding.
``token_accuracy`` is the share of those tokens that greedy (argmax) prediction gets right.
Results go to ``run_dir/eval/<name>.json`` and are reused while the weights and config match.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pipeline.checkpoint import checkpoint_id, write_json_atomic
from pipeline.config import RunConfig
from pipeline.data import Collator, Encoder, load_split
from pipeline.layout import EVAL
from pipeline.models import load_model, load_processor
from pipeline.models.loss import pieces_for, supervised_hidden


def evaluate_model(
    cfg: RunConfig, run_dir: str | Path, name: str, checkpoint: str, force: bool = False
) -> dict[str, Any]:
    """Write ``run_dir/eval/<name>.json`` (per-source and overall loss and token accuracy) and
    return it; an up-to-date result is returned without loading the model."""
    run_dir = Path(run_dir)
    path = run_dir / EVAL / f"{name}.json"
    # Batch size and device change no figure: only the weights, the data and the example cap do.
    digest = cfg.digest("run", "model", "data") + f"/{cfg.eval.max_examples_per_source}"
    identity = {"checkpoint_id": checkpoint_id(checkpoint), "config_digest": digest}
    if path.is_file() and not force:
        cached = json.loads(path.read_text())
        if all(cached.get(k) == v for k, v in identity.items()):
            return cached
    result = score_heldout(cfg, run_dir, name, checkpoint) | identity
    write_json_atomic(path, result)
    return result


def score_heldout(cfg: RunConfig, run_dir: str | Path, name: str, checkpoint: str) -> dict[str, Any]:
    """Per-source and overall held-out loss and token accuracy of one checkpoint (not cached)."""
    start = time.perf_counter()
    limit = cfg.eval.max_examples_per_source
    heldout = {src: items[:limit] for src, items in load_split(cfg, run_dir, "heldout").items() if items}
    if not heldout:
        raise ValueError(f"{run_dir}: no held-out examples to evaluate on (data.heldout_fraction is 0)")
    device = cfg.eval.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    model = load_model(checkpoint, cfg.model).to(device).eval()
    processor = load_processor(checkpoint, cfg.model)
    encoder, collator = Encoder(processor, cfg.data.max_length), Collator(processor.tokenizer.pad_token_id)
    size = cfg.eval.batch_size
    sources = {}
    with (
        torch.no_grad(),
        tqdm(total=sum(map(len, heldout.values())), desc=f"eval {name}", unit="ex", leave=False) as bar,
    ):
        for src, items in heldout.items():
            nll, correct, tokens = 0.0, 0, 0
            for i in range(0, len(items), size):
                batch = encoder.encode_batch(items[i : i + size])
                b_nll, b_correct, b_tokens = _score(model, collator(batch), device)
                nll, correct, tokens = nll + b_nll, correct + b_correct, tokens + b_tokens
                bar.update(len(batch))
            if tokens == 0:
                raise ValueError(
                    f"source '{src}': no supervised tokens in its held-out examples (cut by data.max_length?)"
                )
            sources[src] = {
                "loss": nll / tokens,
                "token_accuracy": correct / tokens,
                "tokens": tokens,
                "examples": len(items),
            }
    total = sum(s["tokens"] for s in sources.values())
    return {
        "model": name,
        "checkpoint": str(checkpoint),
        "sources": sources,
        "loss": sum(s["loss"] * s["tokens"] for s in sources.values()) / total,
        "macro_loss": sum(s["loss"] for s in sources.values()) / len(sources),
        "token_accuracy": sum(s["token_accuracy"] * s["tokens"] for s in sources.values()) / total,
        "seconds": time.perf_counter() - start,
    }


def _score(model: Any, batch: dict[str, torch.Tensor], device: str) -> tuple[float, int, int]:
    """Summed NLL, correct argmax predictions and supervised targets of one batch: only the
    supervised positions are projected onto the vocabulary, a chunk at a time, in fp32."""
    hidden, targets = supervised_hidden(model, {k: v.to(device) for k, v in batch.items()})
    nll, correct, pieces = 0.0, 0, pieces_for(len(targets))
    for h, t in zip(hidden.tensor_split(pieces), targets.tensor_split(pieces)):
        logits = model.lm_head(h).float()
        nll += F.cross_entropy(logits, t, reduction="sum").item()
        correct += int((logits.argmax(-1) == t).sum())
    return nll, correct, len(targets)
