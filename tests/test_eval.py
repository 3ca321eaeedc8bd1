"""Held-out evaluation on a tiny demo run: the metric against HF's own loss, batching
invariance, caching by checkpoint identity and config, and the errors."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from merit.cli import main as merit
from pipeline.checkpoint import save_pretrained_checkpoint
from pipeline.config import load_config
from pipeline.data import IGNORE_INDEX, Collator, Encoder, load_split, prepare_data
from pipeline.eval import evaluate_model
from pipeline.eval import heldout as heldout_module
from pipeline.layout import EVAL
from pipeline.models import load_model, load_processor, processor_for

ROOT = Path(__file__).parent.parent
SOURCES = ["colour_name", "add_digits", "caption"]  # an image task, a text task, a longer answer
KEYS = {
    "model",
    "checkpoint",
    "checkpoint_id",
    "config_digest",
    "sources",
    "loss",
    "macro_loss",
    "token_accuracy",
    "accuracy",
    "roles",
    "seconds",
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("eval-run")
    settings = [
        "--set",
        f"data.sources=[{{name: builtin, format: builtin, tasks: [{', '.join(SOURCES)}]}}]",
        "--set",
        "data.builtin.examples_per_source=16",
        "--set",
        "data.heldout_fraction=0.5",
    ]
    assert merit(["init", str(ROOT / "configs/demo.yaml"), "--run-dir", str(run), *settings]) == 0
    assert merit(["prepare", "--run-dir", str(run)]) == 0  # calibration is not needed here
    return run


def config(run_dir: Path, *overrides: str):
    return load_config(run_dir / "config.yaml", ["eval.device=cpu", *overrides])


@pytest.fixture
def loads(monkeypatch):
    """Counts model loads."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0])
        return load_model(*args, **kwargs)

    monkeypatch.setattr(heldout_module, "load_model", counting)
    return calls


def reference(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per-source loss and token accuracy from HF's own forward, one example at a time (its
    ``.loss`` is then the mean over that example's supervised tokens), token-weighted."""
    cfg = config(run_dir)
    model = load_model(run_dir / "init", cfg.model).eval()
    processor = load_processor(run_dir / "init", cfg.model)
    encoder, collator = Encoder(processor, cfg.data.max_length), Collator(processor.tokenizer.pad_token_id)
    out = {}
    for src, items in load_split(cfg, run_dir, "heldout").items():
        nll, correct, tokens = 0.0, 0, 0
        for example in items:
            batch = collator([encoder(example)])
            with torch.no_grad():
                pred = model(**batch)
            targets = batch["labels"][0, 1:]
            keep = targets != IGNORE_INDEX
            nll += pred.loss.item() * int(keep.sum())
            correct += int((pred.logits[0, :-1].argmax(-1)[keep] == targets[keep]).sum())
            tokens += int(keep.sum())
        out[src] = {"loss": nll / tokens, "token_accuracy": correct / tokens, "tokens": tokens, "examples": len(items)}
    return out


def test_loss_and_accuracy_match_the_models_own_loss_at_any_batch_size(run_dir):
    expected = reference(run_dir)
    assert set(expected) == set(SOURCES) and all(s["examples"] == 8 for s in expected.values())
    for size in (1, 7):  # 7: a padded batch of 7 examples of different lengths, then a batch of 1
        result = evaluate_model(config(run_dir, f"eval.batch_size={size}"), run_dir, f"bs{size}", str(run_dir / "init"))
        trained = {src: got for src, got in result["sources"].items() if got["role"] == "trained"}
        assert set(trained) == set(expected)  # the warm-up's and the eval sources besides
        for src, want in expected.items():
            got = result["sources"][src]
            assert got["tokens"] == want["tokens"] and got["examples"] == want["examples"]
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
            assert got["token_accuracy"] == pytest.approx(want["token_accuracy"], abs=1e-9)
        total = sum(s["tokens"] for s in expected.values())
        assert result["loss"] == pytest.approx(
            sum(s["loss"] * s["tokens"] for s in expected.values()) / total, abs=1e-5
        )
        assert result["macro_loss"] == pytest.approx(
            sum(s["loss"] for s in expected.values()) / len(expected), abs=1e-5
        )


def test_result_is_written_and_cached_until_checkpoint_or_config_change(run_dir, tmp_path, loads):
    cfg, init = config(run_dir, "eval.max_examples_per_source=2"), str(run_dir / "init")
    first = evaluate_model(cfg, run_dir, "m", init)
    assert json.loads((run_dir / EVAL / "m.json").read_text()) == first
    assert set(first) == KEYS and first["model"] == "m" and first["checkpoint"] == init
    assert math.isfinite(first["loss"]) and math.isfinite(first["macro_loss"]) and 0 <= first["token_accuracy"] <= 1
    assert all(s["examples"] == 2 and s["tokens"] > 0 and math.isfinite(s["loss"]) for s in first["sources"].values())
    assert len(first["checkpoint_id"]) == 64  # the manifest's sha256
    assert loads == [init]

    assert evaluate_model(cfg, run_dir, "m", init) == first and loads == [init]  # cached: not loaded
    again = evaluate_model(cfg, run_dir, "m", init, force=True)
    assert len(loads) == 2 and again["loss"] == pytest.approx(first["loss"], abs=1e-6)

    torch.manual_seed(0)
    model = load_model(init, cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    other = str(save_pretrained_checkpoint(tmp_path / "perturbed", model, load_processor(init, cfg.model)))
    changed = evaluate_model(cfg, run_dir, "m", other)
    assert loads[-1] == other and changed["checkpoint_id"] != first["checkpoint_id"]
    assert len(loads) == 3 and abs(changed["loss"] - first["loss"]) > 1e-3
    board = EventAccumulator(str(run_dir / EVAL / "tensorboard" / "m"))  # TensorBoard's own reader
    board.Reload()  # three evaluations of "m": the latest replaces the others
    assert [(e.step, e.value) for e in board.Scalars("heldout/loss")] == [(0, pytest.approx(changed["loss"]))]
    assert {f"heldout_loss/{source}" for source in changed["sources"]} <= set(board.Tags()["scalars"])

    fewer = evaluate_model(
        config(run_dir, "eval.max_examples_per_source=1"), run_dir, "m", other
    )  # eval config changed
    assert len(loads) == 4 and all(s["examples"] == 1 for s in fewer["sources"].values())


def test_sources_without_heldout_examples(run_dir, tmp_path, loads):
    # Two built-in tasks, one held out at fraction 0: it is skipped; with both at 0 nothing is left.
    sources = (
        "[{name: a, format: builtin, tasks: [colour_name], heldout_fraction: 0},"
        " {name: b, format: builtin, tasks: [add_digits]}]"
    )
    run = tmp_path / "partial"
    shutil.copytree(run_dir / "init", run / "init")
    cfg = config(run_dir, f"data.sources={sources}")
    prepare_data(cfg, run, processor_for(cfg, run))
    evaluated = evaluate_model(cfg, run, "init", str(run / "init"))["sources"]
    assert {src for src, got in evaluated.items() if got["role"] == "trained"} == {"add_digits"}

    cfg = config(run_dir, "data.heldout_fraction=0", f"data.sources={sources}")
    prepare_data(cfg, run, processor_for(cfg, run), force=True)
    with pytest.raises(ValueError, match=rf"{re.escape(str(run))}.*data\.heldout_fraction is 0"):
        evaluate_model(cfg, run, "none", str(run / "init"))
    assert len(loads) == 1  # the failure comes before loading the model
