"""The shipped ``configs/qwen2_5_vl_7b_lora.yaml`` run end to end, as a user would start it, with only
sizes, paths and the device overridden: θ0 named by its hub id and found in a hub-shaped cache (a
random Qwen2.5-VL with the 7B model's structure, untied embeddings and head, at tiny widths, in
bf16), data in Vision-FLAN's layout, LoRA branches of rank 16 in bf16 on one process each, the
merges on ΔW, one written as a model and one as a PEFT adapter. The benchmarks are another test's
(tests/test_shipped_3b.py names the paper's eight; the LoRA flow test runs lmms-eval on adapters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hub_snapshot, run_shipped_lora
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration

from pipeline.checkpoint import read_manifest
from pipeline.config import load_config
from pipeline.merge import CheckpointReader
from pipeline.models import build_tiny_processor
from pipeline.models.tiny import tiny_config

pytestmark = pytest.mark.release  # a shipped config of a large model's shape: make test-release

ROOT = Path(__file__).parent.parent
CONFIG = ROOT / "configs" / "qwen2_5_vl_7b_lora.yaml"


def theta0_snapshot(root: Path) -> Path:
    """A random Qwen2.5-VL with the 7B's structure (untied embeddings and head, GQA, windowed
    vision blocks with full attention every 8th) at tiny widths, saved in bf16 as downloaded."""
    cfg = load_config(None, ["model.tiny.vision_depth=8", "model.tiny.vision_window=112"])
    processor = build_tiny_processor(cfg.model, seed=0)
    config = tiny_config(cfg.model, processor.tokenizer)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    folder = root / "download"
    model.to(torch.bfloat16).save_pretrained(folder)
    processor.save_pretrained(folder)
    return hub_snapshot(root / "hf", "Qwen/Qwen2.5-VL-7B-Instruct", folder)


@pytest.fixture(scope="module")
def shipped(prefect_api, tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped-7b-lora")
    snapshot = theta0_snapshot(root)
    # two or three of these tiny examples a packed micro batch
    run_dir, settings = run_shipped_lora(CONFIG, root, snapshot, "model.max_pixels=12544", "train.max_tokens=128")
    return run_dir, snapshot, settings


def test_the_shipped_7b_lora_config_trains_adapters_and_merges_their_delta_w(shipped):
    run_dir, snapshot, settings = shipped
    ran = load_config(run_dir / "config.yaml")
    assert ran == load_config(CONFIG, [*settings, f"model.revision={snapshot.name}"])  # the file, overridden only
    assert (ran.train.finetuning_type, ran.train.lora_rank, ran.train.processes) == ("lora", 16, 1)

    theta0 = AutoModelForImageTextToText.from_pretrained(snapshot)
    finals = [run_dir / "branches" / str(k) / "final" for k in range(2)]
    adapted = set()
    for final in finals:
        config = json.loads((final / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (16, 32, str(snapshot))
        stored = load_file(final / "adapter_model.safetensors")
        assert {t.dtype for t in stored.values()} == {torch.bfloat16}  # trained in DeepSpeed's bf16
        adapted = set(read_manifest(final)["lora"]["modules"])
        PeftModel.from_pretrained(theta0, final)  # PEFT's own loader
    # `all` with the vision tower and the projector frozen: q, k, v, o, gate, up, down of each language block.
    assert all(m.startswith("model.language_model.layers.") for m in adapted)
    assert len(adapted) == 7 * theta0.config.text_config.num_hidden_layers

    # The model merge and the adapter merge of the same weighted average: the same ΔW.
    merged = CheckpointReader(run_dir / "merged" / "token_average")
    base = CheckpointReader(snapshot)
    assert merged.info.keys() == base.info.keys() and "lm_head.weight" in merged.info  # untied: both kept
    model = AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / "token_average")
    assert model.lm_head.weight.dtype == torch.bfloat16
    # ΔW of every adapted module as PEFT forms it (α / r = 2) from the branches' adapters, weighted by tokens.
    tokens = [m["tokens"] for m in read_manifest(run_dir / "merged" / "token_average")["spec"]["models"]]
    delta_w = dict.fromkeys(adapted, 0.0)
    for final, n in zip(finals, tokens):
        stored = load_file(final / "adapter_model.safetensors")
        for m in adapted:
            b, a = (stored[f"base_model.model.{m}.lora_{x}.weight"].double() for x in "BA")
            delta_w[m] = delta_w[m] + n / sum(tokens) * 2.0 * b @ a
    # The snapshot's bf16 weights (θ0 above now holds the branches' LoRA layers, PEFT's loader injected them)
    theta = {n: t.double() for n, t in AutoModelForImageTextToText.from_pretrained(snapshot).state_dict().items()}
    # The bf16 model: θ0 + ΔW rounded once to bf16, so each weight within half a bf16 step (≤ 2⁻⁸ of
    # it) of θ0 + ΔW; ΔW (~1e-4 … 1e-3 against weights ~2e-2) is larger than that step, so a dropped
    # ΔW, or one of the wrong sign, fails.
    state = model.state_dict()
    for m, delta in delta_w.items():
        want = theta[f"{m}.weight"] + delta
        assert ((state[f"{m}.weight"].double() - want).abs() <= want.abs() * 2**-8).all(), m
    # The adapter output: one rank-32 adapter (the two of rank 16 side by side, nothing truncated),
    # its factors in bf16: its ΔW, merged by PEFT in fp32, within bf16's rounding of the factors
    # (relative 2⁻⁸ each, 1e-2 on the product's norm) of the expected one.
    out = run_dir / "merged" / "token_average_adapter"
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 32
    fp32 = AutoModelForImageTextToText.from_pretrained(snapshot, dtype=torch.float32)
    merged_state = PeftModel.from_pretrained(fp32, out).merge_and_unload().state_dict()
    for m, delta in delta_w.items():
        got = merged_state[f"{m}.weight"].double() - theta[f"{m}.weight"]
        assert torch.linalg.norm(got - delta) <= 1e-2 * torch.linalg.norm(delta), m
    untouched = [n for n in merged_state if n.removesuffix(".weight") not in delta_w]
    assert all(torch.equal(merged_state[n].double(), theta[n]) for n in untouched)
    assert read_manifest(out)["format"] == "adapter"

    report = json.loads((run_dir / "report" / "report.json").read_text())
    names = {m["name"] for m in report["models"]}
    assert {f"merged-{m}" for m in ("token_average", "iso_c", "ties", "token_average_adapter")} <= names
    branches = {b["name"]: b for b in report["branches"]}
    assert branches["branch-0"]["lora"]["rank"] == 16 and branches["joint"]["adapter_mb"] > 0
    text = (run_dir / "report" / "report.md").read_text()
    assert "LoRA branches: rank 16, alpha 32" in text and "Merged on ΔW" in text
