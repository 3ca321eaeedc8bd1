"""Muon as the inner optimizer (``train.optimizer: muon``): which tensors it steps, a killed branch
resuming to the same weights, and DeepSpeed's ZeRO stages agreeing on a Muon step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import branch_spec, prepared_run, sigkill_after_checkpoint
from safetensors.torch import load_file

from pipeline.config import TrainSection
from pipeline.train import train_branch

ROOT = Path(__file__).parent.parent
MUON = "train.optimizer=muon"

# Builds a rank's engine as the trainer does (one gloo rank) and prints Muon's and AdamW's tensors.
SPLIT = """
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from pipeline.train.engine import build_engine, init_distributed, muon_split, takes_muon
from pipeline.train.spec import BranchSpec
init_distributed()
engine = build_engine(BranchSpec.load(sys.argv[1]), 1)
muon, adamw = muon_split(engine.model)
groups = [(g.get("use_muon"), g["lr"]) for g in engine.engine.optimizer.param_groups]
ours = [n for n, p in engine.model.named_parameters() if p.requires_grad and takes_muon(n, p)]
print(json.dumps({"muon": muon, "adamw": adamw, "groups": groups, "ours": ours}))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return prepared_run(tmp_path_factory.mktemp("muon-run"))


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "final" / "model.safetensors")


@pytest.mark.parametrize("zero", [0, 3])  # ZeRO-2: the resume test below
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(run_dir, tmp_path, zero):
    spec = branch_spec(run_dir, tmp_path / "split", MUON, f"train.deepspeed=zero{zero}")
    port = str(29650 + zero)
    out = subprocess.run(
        [sys.executable, "-c", SPLIT, str(spec.save(tmp_path / "spec.json")), port],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    split = json.loads(out.stdout.strip().splitlines()[-1])
    muon, adamw = set(split["muon"]), set(split["adamw"])
    matrices = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # every hidden matrix of the decoder, the vision blocks and the projector; not one vector
    assert {n for n in muon if "language_model" in n} == {
        f"model.language_model.layers.{i}.{part}.{m}.weight"
        for i in range(2)
        for part, m in [("self_attn", m) for m in matrices[:4]] + [("mlp", m) for m in matrices[4:]]
    }
    assert any(n.startswith("model.visual.blocks.") and n.endswith("attn.qkv.weight") for n in muon)
    assert any(n.startswith("model.visual.merger.mlp.") for n in muon)
    assert not any(n.endswith(".bias") or "norm" in n or "embed" in n or "lm_head" in n for n in muon)
    # AdamW: the embeddings (tied with lm_head), norms, biases and the vision tower's patch embedding
    assert {
        "model.language_model.embed_tokens.weight",
        "model.language_model.norm.weight",
        "model.visual.patch_embed.proj.weight",
    } <= adamw
    assert any(n.endswith("self_attn.q_proj.bias") for n in adamw)
    assert muon.isdisjoint(adamw) and len(muon) + len(adamw) == len(split["muon"]) + len(split["adamw"])
    assert split["ours"] == split["muon"]  # the rule the benchmarks' optimizers use is DeepSpeed's
    # the two halves' lrs at step 0 of the warm-up: Muon's and AdamW's scaled alike by the schedule
    t = spec.train
    ratio = dict(split["groups"])
    assert ratio[True] / ratio[False] == pytest.approx(t.muon_lr / t.lr)


@pytest.mark.release  # a second kind of branch killed (test_train's, test_lora's)
def test_a_muon_branch_sigkilled_resumes_to_the_same_weights(run_dir, tmp_path):
    reference = train_branch(branch_spec(run_dir, tmp_path / "straight", MUON, "train.processes=2"), echo=False)
    killed = branch_spec(run_dir, tmp_path / "killed", MUON, "train.processes=2")
    sigkill_after_checkpoint(killed.save(tmp_path / "killed" / "spec.json"), 2, step=4)
    assert not (tmp_path / "killed" / "final").exists()
    resumed = train_branch(killed, echo=False)
    assert resumed.resumed and resumed.tokens_seen == reference.tokens_seen
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    theta0 = load_file(run_dir / "init" / "model.safetensors")
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], theta0["model.layers.0.mlp.up_proj.weight"])
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    log = (tmp_path / "straight" / "train.log").read_text()
    assert "Muon on " in log and "no gradient clipping" in log


def test_muon_is_refused_for_lora():
    with pytest.raises(ValueError, match="train.optimizer muon is for full fine-tuning"):
        TrainSection(optimizer="muon", finetuning_type="lora")
