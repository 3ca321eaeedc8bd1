"""LoRA branches: PEFT adapters trained by real DeepSpeed processes, loaded by PEFT, resumed
after SIGKILL, and the bad settings refused before training."""

import json
from pathlib import Path

import pytest
import torch
from conftest import BRANCH_SOURCES, branch_spec, prepared_run, sigkill_after_checkpoint
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from pipeline.checkpoint import verify_checkpoint, write_manifest
from pipeline.config import load_config
from pipeline.data import Collator, Encoder, load_split
from pipeline.merge.adapter import AdapterError
from pipeline.models import load_model, load_processor
from pipeline.models.adapter import adapter_base
from pipeline.preflight import PreflightError, check_run
from pipeline.train import BranchSpec, train_branch
from pipeline.train.lora import apply_lora, lora_targets, merged_state

ROOT = Path(__file__).parent.parent
SOURCES = BRANCH_SOURCES
LORA = ["train.finetuning_type=lora", "train.lora_rank=4", "train.lr=1e-2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return prepared_run(tmp_path_factory.mktemp("lora-run"))


def spec(run_dir: Path, out: Path, *overrides: str) -> BranchSpec:
    return branch_spec(run_dir, out, *LORA, *overrides)


def linear_modules(model: torch.nn.Module) -> set[str]:
    """What `all` adapts when nothing is frozen: every linear layer but lm_head and the projector."""
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return {n for n in linears if n != "lm_head" and ".visual.merger." not in n}


def batch(run_dir: Path, cfg, processor) -> dict[str, torch.Tensor]:
    examples = [ex for exs in load_split(cfg, run_dir, "heldout", SOURCES).values() for ex in exs][:4]
    return Collator(processor.tokenizer.pad_token_id)(Encoder(processor, cfg.data.max_length).encode_batch(examples))


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def trained(run_dir, tmp_path_factory):
    """A LoRA branch trained straight through: ZeRO-2, one rank."""
    branch = spec(run_dir, tmp_path_factory.mktemp("lora") / "straight")
    return branch, train_branch(branch, echo=False)


def test_a_lora_branch_is_a_peft_adapter_that_peft_loads_and_the_project_merges(run_dir, trained):
    branch, result = trained
    out = Path(branch.out_dir)
    final = out / "final"
    manifest = verify_checkpoint(final)
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, str(run_dir / "init"))
    assert not list(final.glob("model*.safetensors"))  # the adapter only: θ0 is not copied
    init = AutoModelForImageTextToText.from_pretrained(run_dir / "init")
    # `all`: every linear layer of the parts that train (nothing is frozen in the demo) but lm_head and the projector.
    assert set(manifest["lora"]["modules"]) == linear_modules(init)
    shapes = [m.weight.shape for n, m in init.named_modules() if n in linear_modules(init)]
    assert manifest["lora"]["trainable_parameters"] == sum(4 * (i + o) for o, i in shapes)
    assert manifest["finetuning_type"] == "lora" and manifest["step"] == result.steps == 12
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] - 0.2
    assert "LoRA rank 4 (alpha 8)" in (out / "train.log").read_text()

    cfg, processor = branch.config, load_processor(final, branch.config.model)
    inputs = batch(run_dir, cfg, processor)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(init, final).eval()(**inputs).logits
        ours = load_model(final, cfg.model).eval()(**inputs).logits  # θ0 + ΔW, merged
        before = AutoModelForImageTextToText.from_pretrained(run_dir / "init").eval()(**inputs).logits
    assert (theirs - ours).abs().max() <= 1e-4
    assert (theirs - before).abs().max() > 1e-2  # the adapter changed the model


# ZeRO-3 on 2 ranks: a release test (test_train kills a full branch there)
@pytest.mark.parametrize("zero, processes", [(2, 1), pytest.param(3, 2, marks=pytest.mark.release)])
def test_a_sigkilled_lora_branch_resumes_to_the_same_adapter(run_dir, trained, tmp_path, zero, processes):
    settings = [f"train.deepspeed=zero{zero}", f"train.processes={processes}"]
    settings += ["train.loss_chunk=3"] if zero == 3 else []  # ranks make the same projections (test_train)
    if zero == 2:  # the module's branch has these settings
        straight, reference = Path(trained[0].out_dir), trained[1]
    else:
        straight = tmp_path / "straight"
        reference = train_branch(spec(run_dir, straight, *settings), echo=False)
    killed = spec(run_dir, tmp_path / "killed", *settings)
    sigkill_after_checkpoint(killed.save(tmp_path / "killed" / "spec.json"), processes, step=4)
    latest = tmp_path / "killed" / "checkpoints" / "latest.json"
    # The checkpoint holds the adapters and their optimizer state, not θ0's frozen weights.
    checkpoint = json.loads(latest.read_text())["tag"]
    stored = sum(f.stat().st_size for f in (tmp_path / "killed" / "checkpoints" / checkpoint).rglob("*model_states*"))
    assert 0 < stored < (run_dir / "init" / "model.safetensors").stat().st_size / 2
    resumed = train_branch(killed, echo=False)
    assert resumed.resumed and resumed.tokens_seen == reference.tokens_seen
    a, b = adapter(straight), adapter(tmp_path / "killed")
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_a_lora_warmup_saves_theta0_as_a_model_with_the_adapter_merged(run_dir, tmp_path):
    out = tmp_path / "warmup"
    branch = spec(run_dir, out, "train.steps=4").model_copy(update={"name": "warmup"})
    train_branch(branch, echo=False)
    merged = AutoModelForImageTextToText.from_pretrained(out / "final")
    init = AutoModelForImageTextToText.from_pretrained(run_dir / "init")
    a, b = merged.state_dict(), init.state_dict()
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and all(k.endswith(".weight") and k.removesuffix(".weight") in linear_modules(init) for k in changed)


def test_merged_state_is_peft_merge_and_unload(run_dir):
    cfg = spec(run_dir, run_dir / "unused", "train.additional_target=lm_head").config
    model = AutoModelForImageTextToText.from_pretrained(run_dir / "init")
    peft = apply_lora(model, cfg.train, str(run_dir / "init"))
    with torch.no_grad():
        for param in peft.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)  # B starts at 0: make ΔW non-zero
    ours = merged_state(peft.base_model.model.state_dict(), peft.base_model.model)
    theirs = peft.merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6


def test_lora_targets_follow_the_freeze_options_and_unknown_names_are_named(run_dir):
    cfg = spec(run_dir, run_dir / "unused").config
    model = load_model(run_dir / "init", cfg.model)
    everything = lora_targets(model, cfg.train)
    frozen_vision = cfg.model.model_copy(
        update={"freeze": cfg.model.freeze.model_copy(update={"freeze_vision_tower": True})}
    )
    text = lora_targets(load_model(run_dir / "init", frozen_vision), cfg.train)
    assert set(everything) - set(text) == {n for n in everything if ".visual.blocks." in n}
    assert not any(".visual.merger." in n for n in everything)  # `all` never takes the projector, frozen or not
    listed = cfg.train.model_copy(update={"lora_target": ["q_proj", "v_proj"]})
    assert {n.rsplit(".", 1)[-1] for n in lora_targets(model, listed)} == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match=r"lora_target \['qq_proj'\] match no linear module.*'q_proj'"):
        lora_targets(model, cfg.train.model_copy(update={"lora_target": ["qq_proj", "v_proj"]}))
    assert load_config(None, ["train.lora_target=q_proj, v_proj"]).train.lora_target == ["q_proj", "v_proj"]


def test_an_adapter_without_safetensors_or_with_another_theta0_is_refused(run_dir, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "x"}))
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterError, match="no adapter_model.safetensors .*never pickle"):
        adapter_base(folder)
    save_file({}, folder / "adapter_model.safetensors")
    write_manifest(folder, base_model="the θ0 it was trained on")
    with pytest.raises(AdapterError, match=f"{folder}: trained on a θ0 with identity the θ0 it was trained on, but x"):
        adapter_base(folder)


def test_preflight_refuses_lora_settings_that_would_fail_in_the_branches(tmp_path):
    frozen = [
        f"model.freeze.freeze_{part}=true" for part in ("vision_tower", "multi_modal_projector", "language_model")
    ]
    cases = {
        "train.lora_target=qq_proj": r"lora: train.lora_target \['qq_proj'\] match no linear module",
        "train.additional_target=nope": r"lora: train.additional_target \['nope'\] match no module",
        ";".join(frozen): "lora: train.finetuning_type lora: nothing to adapt",
    }
    for overrides, message in cases.items():
        cfg = load_config(ROOT / "configs/demo.yaml", ["train.finetuning_type=lora", *overrides.split(";")])
        with pytest.raises(PreflightError, match=message):
            check_run(cfg, tmp_path / "run")
    checked = check_run(load_config(ROOT / "configs/demo.yaml", ["train.finetuning_type=lora"]), tmp_path / "run")
    # the tiny model's linear layers (the demo trains everything), lm_head and the projector's 2 aside
    assert checked["lora"] == "LoRA rank 8, alpha 16, on 24 modules"
    diloco = load_config(ROOT / "configs/demo.yaml", ["train.finetuning_type=lora"])
    assert "fresh LoRA adapter" in check_run(diloco, tmp_path / "run", diloco=True)["diloco"]  # LoRA workers
