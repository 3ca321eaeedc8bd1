"""Exact-match accuracy by batched greedy generation, and the result's per-role figures, on a tiny
run with a source of every role and a tiny model trained in process until it memorises the
held-out examples of the fine-tuning sources."""

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from pipeline.checkpoint import save_pretrained_checkpoint
from pipeline.config import RunConfig, load_config
from pipeline.data import Collator, Encoder, Example, load_split, prepare_data
from pipeline.eval import evaluate_model
from pipeline.eval.generate import Generator, normalise
from pipeline.eval.heldout import Heldout, score_model, source_roles
from pipeline.models import init_model, load_model, load_processor, processor_for
from pipeline.models.loss import mean_nll

TRAINED = ["colour_name", "add_digits"]  # an image task and a text task
SOURCES = [
    "data.sources=[{name: ft, format: builtin, tasks: [colour_name, add_digits]}]",
    "warmup.sources=[{name: skills, format: builtin, tasks: [skill_add]}]",
    "eval.sources=[{name: u, format: builtin, tasks: [unseen_shape_sentence], role: unseen},"
    " {name: r, format: builtin, tasks: [skill_colour], role: retention}]",
]


def tiny_run(run_dir, *overrides: str) -> RunConfig:
    """θ0 (the tiny model) and the prepared data of a run with a source of every role."""
    cfg = load_config(None, ["data.builtin.examples_per_source=8", "data.heldout_fraction=0.5", *SOURCES, *overrides])
    init_model(cfg, run_dir)
    prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    return cfg


def train(
    cfg: RunConfig,
    start: str,
    examples: list[Example],
    steps: int,
    lr: float = 3e-3,
    until: Callable[[torch.nn.Module], bool] | None = None,
) -> torch.nn.Module:
    """A model trained from ``start`` on ``examples`` (one full batch, the project's loss) for
    ``steps``, or until ``until(model)`` holds (checked every 50 steps)."""
    torch.manual_seed(0)
    model, processor = load_model(start, cfg.model), load_processor(start, cfg.model)
    batch = Collator(processor.tokenizer.pad_token_id)(Encoder(processor, cfg.data.max_length).encode_batch(examples))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        mean_nll(model, batch).backward()
        optimizer.step()
        if until is not None and step % 50 == 0:
            if until(model.eval()):
                break
            model.train()
    return model.eval()


def with_eval(cfg: RunConfig, **settings) -> RunConfig:
    return cfg.model_copy(update={"eval": cfg.eval.model_copy(update=settings)})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("accuracy-run")
    return tiny_run(run_dir, "eval.device=cpu", "eval.batch_size=8"), run_dir


@pytest.fixture(scope="module")
def memorised(run, tmp_path_factory):
    """A checkpoint that has learnt the fine-tuning sources' held-out examples by heart."""
    cfg, run_dir = run
    examples = [ex for items in load_split(cfg, run_dir, "heldout", TRAINED).values() for ex in items]
    processor = load_processor(run_dir / "init", cfg.model)
    references = [normalise(ex.answer()) for ex in examples]

    def answers_every_one(model: torch.nn.Module) -> bool:
        generate = Generator(model, Encoder(processor, cfg.data.max_length), max_new_tokens=16)
        return [normalise(answer) for _, answer in generate(examples)] == references

    # To a criterion, not for a fixed number of steps: how many steps memorising takes depends on
    # the machine's floating-point path (its BLAS kernels), not only on the seed.
    model = train(cfg, str(run_dir / "init"), examples, steps=3000, until=answers_every_one)
    assert answers_every_one(model), "3,000 steps did not memorise the held-out examples"
    return str(save_pretrained_checkpoint(tmp_path_factory.mktemp("memorised") / "final", model, processor))


def answered(example: Example, answer: str) -> Example:
    """The example with another reference answer (and no cached token ids)."""
    turn = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
    return replace(example, messages=[*example.messages[:-1], turn], token_ids=None)


def test_normalise():
    assert normalise("  The answer is\n  Three. ") == "the answer is three"
    assert normalise("RED!?") == normalise("red") == "red"
    assert normalise("3.5 . ") == "3.5"  # only end punctuation goes
    assert normalise("¿yes") == "¿yes" and normalise("a,\tb") == "a, b"
    assert normalise(" ... ") == ""


def test_memorised_answers_match_exactly_and_shuffled_references_do_not(run, memorised):
    cfg, run_dir = run
    result = evaluate_model(cfg, run_dir, "memorised", memorised)
    for src in TRAINED:
        assert result["sources"][src]["accuracy"] == 1.0
        assert result["sources"][src]["token_accuracy"] > 0.9
    assert result["accuracy"] == 1.0

    # The same prompts with their references rotated across the two sources (colours against sums):
    # every answer the model gives is still its memorised one, so none matches.
    heldout = Heldout.load(cfg, run_dir, source_roles(run_dir)).trained()
    examples = [ex for src in TRAINED for ex in heldout.examples[src]]
    half = len(examples) // 2
    references = [ex.answer() for ex in examples[half:] + examples[:half]]
    rotated = [answered(ex, ref) for ex, ref in zip(examples, references)]
    shuffled = Heldout({src: [ex for ex in rotated if ex.source == src] for src in TRAINED}, heldout.roles)
    model, processor = load_model(memorised, cfg.model).eval(), load_processor(memorised, cfg.model)
    scored = score_model(cfg, model, processor, shuffled, "shuffled", accuracy=True)
    assert all(scored[src]["accuracy"] == 0.0 for src in TRAINED)


def test_a_mixed_batch_answers_as_each_example_alone(run, memorised):
    cfg, run_dir = run
    examples = [ex for items in load_split(cfg, run_dir, "heldout", TRAINED).values() for ex in items]
    assert {bool(ex.images) for ex in examples} == {True, False}  # image and text-only prompts together
    model, processor = load_model(memorised, cfg.model).eval(), load_processor(memorised, cfg.model)
    generate = Generator(model, Encoder(processor, cfg.data.max_length), max_new_tokens=16)
    together = generate(examples)
    assert len({len(prompt) for prompt, _ in together}) > 1  # left padding at work
    assert together == [answer for ex in examples for answer in generate([ex])]
    assert [normalise(answer) for _, answer in together] == [normalise(ex.answer()) for ex in examples]


def test_roles_aggregate_the_per_source_figures(run, memorised):
    cfg, run_dir = run
    result = evaluate_model(cfg, run_dir, "roles", memorised)
    sources = result["sources"]
    expected_roles = {
        "colour_name": "trained",
        "add_digits": "trained",
        "skill_add": "retention",  # the warm-up's
        "unseen_shape_sentence": "unseen",
        "skill_colour": "retention",
    }
    assert {src: s["role"] for src, s in sources.items()} == expected_roles
    assert all(
        s["examples"] == (4 if s["role"] == "trained" or src == "skill_add" else 8) for src, s in sources.items()
    )
    for role in ("trained", "unseen", "retention"):
        group = [s for s in sources.values() if s["role"] == role]
        tokens = sum(s["tokens"] for s in group)
        assert result["roles"][role] == pytest.approx(
            {
                "loss": sum(s["loss"] * s["tokens"] for s in group) / tokens,
                "accuracy": sum(s["accuracy"] for s in group) / len(group),
                "sources": len(group),
            }
        )
    trained = [sources[src] for src in TRAINED]
    assert result["loss"] == pytest.approx(result["roles"]["trained"]["loss"])
    tokens = sum(s["tokens"] for s in trained)
    assert result["token_accuracy"] == pytest.approx(sum(s["token_accuracy"] * s["tokens"] for s in trained) / tokens)
    assert result["macro_loss"] == pytest.approx(sum(s["loss"] for s in trained) / 2)
    assert result["accuracy"] == pytest.approx(sum(s["accuracy"] for s in trained) / 2)
    for s in sources.values():
        assert len(s["samples"]) == 3 and set(s["samples"][0]) == {"prompt", "prediction", "reference"}
        assert s["samples"][0]["prompt"].endswith("<|im_start|>assistant\n")


def test_accuracy_off_and_the_cache_identity(run, memorised):
    cfg, run_dir = run
    first = evaluate_model(cfg, run_dir, "cache", memorised)
    assert evaluate_model(with_eval(cfg, batch_size=3), run_dir, "cache", memorised) == first  # no figure changes

    without = evaluate_model(with_eval(cfg, accuracy=False), run_dir, "cache", memorised)
    assert without["config_digest"] != first["config_digest"]
    assert "accuracy" not in without and all("accuracy" not in r for r in without["roles"].values())
    assert all("accuracy" not in s and "samples" not in s for s in without["sources"].values())
    assert without["loss"] == pytest.approx(first["loss"])

    shorter = evaluate_model(with_eval(cfg, max_new_tokens=1), run_dir, "cache", memorised)
    assert shorter["config_digest"] != first["config_digest"]
