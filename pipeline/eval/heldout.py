"""Score one model on the held-out split of every prepared source.

The loss is the instruction-tuning objective itself: next-token cross-entropy averaged over the
supervised (assistant answer) tokens. Per source the NLL is summed and the tokens counted, so
the loss is token-weighted over its examples and independent of batching and padding.
``token_accuracy`` is the share of those tokens that greedy (argmax) prediction gets right;
``accuracy`` the share of examples whose generated answer matches the reference exactly
(:mod:`pipeline.eval.generate`).

Each source has an eval role from its data role: ``trained`` (the fine-tuning sources),
``unseen`` (eval sources of new tasks and instructions) or ``retention`` (the warm-up's sources,
what θ0 could do before fine-tuning, and eval sources so marked). The headline figures are over
the trained sources; ``roles`` aggregates each role. Results go to ``run_dir/eval/<name>.json``
and are reused while the weights, the data and the eval settings that change figures match.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pipeline.checkpoint import checkpoint_id, write_json_atomic
from pipeline.config import EVALUATED_ROLES, RunConfig
from pipeline.data import Collator, Encoder, Example, active_sources, load_split, read_manifest
from pipeline.data.manifest import MANIFEST_PATH
from pipeline.data.prepare import data_digest
from pipeline.devices import eval_device
from pipeline.eval.generate import Generator, normalise
from pipeline.layout import EVAL
from pipeline.models import load_model, load_processor
from pipeline.models.loss import pieces_for, supervised_hidden
from pipeline.tensorboard import log_evaluation

# The data manifest's role of a source -> its role in evaluation. The warm-up's held-out split
# measures what θ0 could do before fine-tuning: what the branches should retain.
EVAL_ROLE = {"finetune": "trained", "warmup": "retention", "unseen": "unseen", "retention": "retention"}
FIGURES = ("sources", "accuracy", "max_new_tokens", "max_examples_per_source")  # eval settings that change figures
SAMPLES = 3  # generated answers kept per source, for inspection
PROMPT_TAIL = 160  # characters of a sample's prompt kept: the question and the assistant header


def evaluated(cfg: RunConfig, model: str) -> bool:
    """Whether a model of the run is evaluated: every one, the branches unless ``eval.branches`` is off."""
    return cfg.eval.branches or not model.startswith("branch-")


def source_roles(run_dir: str | Path) -> dict[str, str]:
    """The eval role of every prepared source that was not dropped, from the data manifest."""
    roles = {}
    for name, info in active_sources(read_manifest(run_dir), role=None).items():
        role = info.get("role", "finetune")  # a manifest from before roles: fine-tuning sources only
        if role not in EVAL_ROLE:
            raise ValueError(f"{Path(run_dir) / MANIFEST_PATH}: source '{name}' has unknown role {role!r}")
        roles[name] = EVAL_ROLE[role]
    return roles


def eval_digest(cfg: RunConfig, roles: dict[str, str], fields: tuple[str, ...]) -> str:
    """What figures depend on besides the weights: the prepared data (``data_digest``: its config,
    the model section, the warm-up and eval sources), the sources' roles and the given eval
    settings; never batch size or device."""
    settings = cfg.eval.model_dump(mode="json", include=set(fields))
    apart = [dev_share(cfg)] if dev_share(cfg) else []  # examples left to merge.search's dev split
    text = json.dumps([data_digest(cfg), roles, settings, *apart], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dev_share(cfg: RunConfig) -> int:
    """Held-out examples of each trained source kept apart for ``merge.search`` (the last ones of its
    split): its dev split, which the report never scores. None unless a search on held-out loss is
    enabled."""
    search = cfg.merge.search
    return search.max_examples_per_source if search.enabled and not search.tasks else 0


def refuse_short_dev_share(cfg: RunConfig, run_dir: str | Path, heldout: dict[str, int] | None = None) -> None:
    """Refuse trained sources whose held-out split cannot give merge.search its dev share and the
    report at least one example (``heldout``: their held-out counts; default: the data manifest's).
    The merit flow asks right after ``prepare``, before anything trains."""
    if heldout is None:
        heldout = {n: len(i["heldout_indices"]) for n, i in active_sources(read_manifest(run_dir)).items()}
    dev = dev_share(cfg)
    if dev and (short := {src: n for src, n in heldout.items() if 0 < n <= dev}):
        raise ValueError(
            f"{run_dir}: held-out examples of trained sources {short}: merge.search.max_examples_per_source = "
            f"{dev} of each are its dev split, which the report never scores, and the report needs one more: "
            "lower it, or raise data.heldout_fraction"
        )


@dataclass
class Heldout:
    """The held-out examples of every source that has some (up to the eval cap), by source, and
    each source's eval role: the report's part (``report``), or merge.search's dev split (``dev``,
    the trained sources' last :func:`dev_share` examples, never in the report's part)."""

    examples: dict[str, list[Example]]
    roles: dict[str, str]

    @classmethod
    def load(cls, cfg: RunConfig, run_dir: str | Path, roles: dict[str, str], part: str = "report") -> Heldout:
        limit, dev = cfg.eval.max_examples_per_source, dev_share(cfg)
        split = load_split(cfg, run_dir, "heldout", list(roles))
        refuse_short_dev_share(
            cfg, run_dir, {src: len(items) for src, items in split.items() if roles[src] == "trained"}
        )
        examples = {}
        for src, items in split.items():
            apart = dev if roles[src] == "trained" else 0
            mine = items[len(items) - apart :] if part == "dev" else items[: len(items) - apart][:limit]
            if len(mine):
                examples[src] = list(mine)  # read from the store once
        if part == "dev":
            return cls(examples, {src: roles[src] for src in examples})
        if not any(roles[src] == "trained" for src in examples):
            raise ValueError(
                f"{run_dir}: no held-out examples of the fine-tuning sources to evaluate on "
                "(data.heldout_fraction is 0)"
            )
        return cls(examples, {src: roles[src] for src in examples})

    def trained(self) -> Heldout:
        keep = [src for src, role in self.roles.items() if role == "trained"]
        return Heldout({src: self.examples[src] for src in keep}, dict.fromkeys(keep, "trained"))

    def __len__(self) -> int:
        return sum(map(len, self.examples.values()))


def evaluate_model(
    cfg: RunConfig, run_dir: str | Path, name: str, checkpoint: str, force: bool = False
) -> dict[str, Any]:
    """Write ``run_dir/eval/<name>.json`` (per-source, per-role and overall figures) and return it;
    an up-to-date result is returned without loading the model."""
    run_dir = Path(run_dir)
    path = run_dir / EVAL / f"{name}.json"
    roles = source_roles(run_dir)
    identity = {"checkpoint_id": checkpoint_id(checkpoint), "config_digest": eval_digest(cfg, roles, FIGURES)}
    if path.is_file() and not force:
        cached = json.loads(path.read_text())
        if all(cached.get(k) == v for k, v in identity.items()):
            return cached
    result = score_heldout(cfg, run_dir, name, checkpoint) | identity
    write_json_atomic(path, result)
    log_evaluation(run_dir / EVAL / "tensorboard" / name, result)
    return result


def score_heldout(cfg: RunConfig, run_dir: str | Path, name: str, checkpoint: str) -> dict[str, Any]:
    """Per-source, per-role and overall figures of one checkpoint on the held-out split (not cached)."""
    start = time.perf_counter()
    heldout = Heldout.load(cfg, run_dir, source_roles(run_dir))  # first: a run without any fails before loading
    model = load_model(checkpoint, cfg.model).to(eval_device(cfg)).eval()
    sources = score_model(cfg, model, load_processor(checkpoint, cfg.model), heldout, name, cfg.eval.accuracy)
    return {
        "model": name,
        "checkpoint": str(checkpoint),
        "sources": sources,
        **summarise(sources),
        "seconds": time.perf_counter() - start,
    }


def score_model(
    cfg: RunConfig, model: Any, processor: Any, heldout: Heldout, name: str, accuracy: bool
) -> dict[str, dict[str, Any]]:
    """Per-source figures of a model in memory (on its device, in eval mode): loss, token accuracy
    and, with ``accuracy``, exact-match accuracy and a few samples of its answers."""
    encoder = Encoder(processor, cfg.data.max_length)
    generator = Generator(model, encoder, cfg.eval.max_new_tokens) if accuracy else None
    with torch.no_grad(), tqdm(total=len(heldout), desc=f"eval {name}", unit="ex", leave=False) as bar:
        return {
            src: {"role": heldout.roles[src], **_score_source(cfg, model, encoder, generator, src, items, bar)}
            for src, items in heldout.examples.items()
        }


def _score_source(
    cfg: RunConfig, model: Any, encoder: Encoder, generator: Generator | None, src: str, items: list[Example], bar: tqdm
) -> dict[str, Any]:
    collator, size = Collator(encoder.processor.tokenizer.pad_token_id), cfg.eval.batch_size
    nll, correct, tokens, answers = 0.0, 0, 0, []
    for i in range(0, len(items), size):
        batch = items[i : i + size]
        b_nll, b_correct, b_tokens = _score(model, collator(encoder.encode_batch(batch)))
        nll, correct, tokens = nll + b_nll, correct + b_correct, tokens + b_tokens
        if generator:
            answers += generator(batch)
        bar.update(len(batch))
    if tokens == 0:
        raise ValueError(f"source '{src}': no supervised tokens in its held-out examples (cut by data.max_length?)")
    figures = {"loss": nll / tokens, "token_accuracy": correct / tokens}
    if not generator:
        return figures | {"tokens": tokens, "examples": len(items)}
    right = sum(normalise(answer) == normalise(ex.answer()) for ex, (_, answer) in zip(items, answers))
    samples = [
        {"prompt": prompt[-PROMPT_TAIL:], "prediction": answer, "reference": ex.answer()}
        for ex, (prompt, answer) in zip(items[:SAMPLES], answers)
    ]
    return figures | {"accuracy": right / len(items), "tokens": tokens, "examples": len(items), "samples": samples}


def summarise(sources: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Overall figures over the trained sources (loss and token accuracy token-weighted, macro loss
    and accuracy plain means) and per role present its token-weighted loss, macro accuracy and
    number of sources."""
    by_role = {role: [s for s in sources.values() if s["role"] == role] for role in EVALUATED_ROLES}
    roles = {role: _aggregate(group) for role, group in by_role.items() if group}
    trained = by_role["trained"]
    overall = {
        "loss": roles["trained"]["loss"],
        "macro_loss": _mean(trained, "loss"),
        "token_accuracy": _weighted(trained, "token_accuracy"),
    }
    if "accuracy" in roles["trained"]:
        overall["accuracy"] = roles["trained"]["accuracy"]
    return overall | {"roles": roles}


def _aggregate(group: list[dict[str, Any]]) -> dict[str, Any]:
    figures = {"loss": _weighted(group, "loss")}
    if "accuracy" in group[0]:
        figures["accuracy"] = _mean(group, "accuracy")
    return figures | {"sources": len(group)}


def _weighted(group: list[dict[str, Any]], key: str) -> float:
    return sum(s[key] * s["tokens"] for s in group) / sum(s["tokens"] for s in group)


def _mean(group: list[dict[str, Any]], key: str) -> float:
    return sum(s[key] for s in group) / len(group)


def _score(model: Any, batch: dict[str, torch.Tensor]) -> tuple[float, int, int]:
    """Summed NLL, correct argmax predictions and supervised targets of one batch: only the
    supervised positions are projected onto the vocabulary, a chunk at a time, in fp32."""
    hidden, targets = supervised_hidden(model, {k: v.to(model.device) for k, v in batch.items()})
    nll, correct, pieces = 0.0, 0, pieces_for(len(targets))
    for h, t in zip(hidden.tensor_split(pieces), targets.tensor_split(pieces)):
        logits = model.lm_head(h).float()
        nll += F.cross_entropy(logits, t, reduction="sum").item()
        correct += int((logits.argmax(-1) == t).sum())
    return nll, correct, len(targets)
