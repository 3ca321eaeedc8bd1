"""Branch training through real DeepSpeed processes (gloo on CPU) on the tiny model."""

import json
from pathlib import Path

import pytest
import torch
from conftest import BRANCH_SOURCES, branch_spec, golden_run, prepared_run, sigkill_after_checkpoint
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForImageTextToText

from pipeline.checkpoint import verify_checkpoint
from pipeline.train import BranchFailed, BranchSpec, train_branch

ROOT = Path(__file__).parent.parent
SOURCES = BRANCH_SOURCES


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return prepared_run(tmp_path_factory.mktemp("train-run"))


def spec(run_dir: Path, out: Path, *overrides: str, sources=SOURCES) -> BranchSpec:
    return branch_spec(run_dir, out, *overrides, sources=sources)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "final" / "model.safetensors")


@pytest.mark.parametrize("zero, processes", [(2, 2)])  # ZeRO-0 on 1 rank and ZeRO-3 on 2: below
def test_branch_trains_and_writes_a_loadable_checkpoint(run_dir, tmp_path, zero, processes):
    out = tmp_path / f"z{zero}p{processes}"
    branch = spec(run_dir, out, f"train.deepspeed=zero{zero}", f"train.processes={processes}")
    result = train_branch(branch, echo=False)
    assert result.steps == 12 and result.tokens_seen > 0 and not result.resumed
    manifest = verify_checkpoint(out / "final")
    assert manifest["step"] == 12 and manifest["sources"] == SOURCES and manifest["parent"] == str(run_dir / "init")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # loss falls on these sources
    assert records[-1]["tokens"] == result.tokens_seen and all(r["tokens_per_s"] > 0 for r in records)
    assert {r["threads"] for r in records} == {1}  # the tiny model runs single-threaded in each rank
    board = EventAccumulator(str(out / "tensorboard"))  # TensorBoard's own reader
    board.Reload()
    scalars = board.Scalars("train/loss")  # float32 in the event file
    assert [e.step for e in scalars] == [r["step"] for r in records]
    assert [e.value for e in scalars] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(board.Tags()["scalars"])
    assert (out / "loss.png").stat().st_size > 5_000
    model = AutoModelForImageTextToText.from_pretrained(out / "final")
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    changed = load_file(run_dir / "init" / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(weights(out)["model.layers.0.mlp.up_proj.weight"], changed)
    again = train_branch(branch, echo=False)  # complete: skipped, nothing retrained
    assert again.steps == 12 and again.seconds == 0.0
    with pytest.raises(ValueError, match=f"branch {out.name}: {out} was trained from another"):
        train_branch(branch.model_copy(update={"sources": SOURCES[:2]}), echo=False)  # not silently reused


def test_a_zero3_branch_sigkilled_on_two_ranks_resumes_to_the_same_weights(run_dir, tmp_path):
    # Answers projected 3 positions at a time: the ranks' micro batches need different numbers of
    # projections, and under ZeRO-3 they must still make the same number (gloo aborts otherwise).
    zero3 = ["train.deepspeed=zero3", "train.processes=2", "train.loss_chunk=3"]
    reference = train_branch(spec(run_dir, tmp_path / "straight", *zero3), echo=False)
    killed = spec(run_dir, tmp_path / "killed", *zero3)
    sigkill_after_checkpoint(killed.save(tmp_path / "killed" / "spec.json"), 2, step=4)
    assert not (tmp_path / "killed" / "final").exists()
    resumed = train_branch(killed, echo=False)
    assert resumed.resumed and resumed.tokens_seen == reference.tokens_seen
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    AutoModelForImageTextToText.from_pretrained(tmp_path / "killed" / "final")  # gathered from the partitions
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # records after the checkpoint were rewritten, not duplicated


def test_accumulated_micro_batches_train_as_one_larger_batch_along_the_golden_curve(tmp_path, golden):
    """The loss of a step is its mean over every supervised token of the step: two padded micro
    batches of 4 give the gradient of one batch of 8, up to float rounding (padding differs). On the
    frozen inputs of tests/golden, so only a change of the trainer moves the curves: these two, and
    the packed trainer's own."""
    run_dir = golden_run(tmp_path / "golden-run")
    zero0 = "train.deepspeed=zero0"
    padded = [zero0, "train.steps=8", "train.packing=false"]
    first = spec(run_dir, tmp_path / "one", *padded, "train.micro_batch=8", sources=["golden"])
    one = train_branch(first, echo=False)
    two = spec(run_dir, tmp_path / "two", *padded, "train.micro_batch=4", "train.grad_accum=2", sources=["golden"])
    assert train_branch(two, echo=False).tokens_seen == one.tokens_seen
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 2e-5
    curves = [
        [json.loads(line)["loss"] for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
        for n in ("one", "two")
    ]
    assert curves[0] == pytest.approx(curves[1], rel=1e-5)
    golden("branch_loss", curves[0])  # the trainer's curve on this branch, as it was when recorded
    packed = spec(run_dir, tmp_path / "packed", zero0, "train.steps=8", "train.max_tokens=512", sources=["golden"])
    train_branch(packed, echo=False)
    records = [json.loads(line) for line in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["tokens"] - previous for r, previous in zip(records, [0] + [r["tokens"] for r in records])]
    assert [r["positions"] for r in records] == steps  # no padding: every position a token of an example
    golden("branch_loss_packed", [r["loss"] for r in records])


def held_out_loss(run_dir: Path, checkpoint: Path) -> float:
    """The mean NLL of the branch sources' held-out answers (the demo's held-out split)."""
    from pipeline.config import load_config
    from pipeline.data import Collator, Encoder, load_split
    from pipeline.models import load_model, load_processor
    from pipeline.models.loss import supervised_nll

    cfg = load_config(run_dir / "config.yaml")
    model, processor = load_model(checkpoint, cfg.model).eval(), load_processor(checkpoint, cfg.model)
    encoder, collate = Encoder(processor, cfg.data.max_length), Collator(processor.tokenizer.pad_token_id)
    examples = [ex for exs in load_split(cfg, run_dir, "heldout", SOURCES).values() for ex in exs]
    with torch.no_grad():
        scored = [supervised_nll(model, collate(encoder.encode_batch([ex]))) for ex in examples]
    return sum(nll.item() for nll, _ in scored) / sum(n for _, n in scored)


def test_a_packed_branch_ends_where_a_padded_one_does_within_the_noise_of_the_batches(run_dir, tmp_path):
    """Two epochs of the same examples, packed (about 4 to a micro batch) and padded (4 a batch): the
    packed branch's held-out loss is as far from the padded one's as padded batches of 3 are from
    batches of 4 (the spread another composition of the batches alone makes), or within 2 % of θ0's."""
    budget = ["train.steps=null", "train.epochs=2", "train.checkpoint_every=1000"]
    train_branch(spec(run_dir, tmp_path / "packed", *budget, "train.max_tokens=220"), echo=False)
    for batch in (4, 3):
        padded = ["train.packing=false", f"train.micro_batch={batch}"]
        train_branch(spec(run_dir, tmp_path / f"padded{batch}", *budget, *padded), echo=False)
    start = held_out_loss(run_dir, run_dir / "init")
    packed, padded, other = (held_out_loss(run_dir, tmp_path / n / "final") for n in ("packed", "padded4", "padded3"))
    assert max(packed, padded, other) < start - 1.0  # all three learned the sources
    assert abs(packed - padded) <= max(abs(other - padded), 0.02 * start)


def test_bad_specs_fail_before_launching(run_dir, tmp_path):
    with pytest.raises(ValueError, match=r"unknown sources \['nope'\]"):
        train_branch(spec(run_dir, tmp_path / "a", sources=["nope"]), echo=False)
    with pytest.raises(ValueError, match="init checkpoint .* missing"):
        train_branch(spec(run_dir, tmp_path / "b").model_copy(update={"init": str(tmp_path / "absent")}), echo=False)
    with pytest.raises(Exception, match="train.steps"):
        spec(run_dir, tmp_path / "c", "train.steps=0")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_failing_branch_names_itself(run_dir, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(BranchFailed, match=r"branch failing: training exit code \d+; see .*train.log"):
        train_branch(spec(run_dir, tmp_path / "failing", f"train.deepspeed={broken}"), echo=False)
