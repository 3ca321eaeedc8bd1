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
from conftest import hub_snapshot, vision_flan_corpus
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration

from flows.merit import merit
from pipeline.checkpoint import read_manifest
from pipeline.config import load_config
from pipeline.merge import CheckpointReader
from pipeline.models import build_tiny_processor
from pipeline.models.tiny import tiny_config

ROOT = Path(__file__).parent.parent
CONFIG = ROOT / "configs" / "qwen2_5_vl_7b_lora.yaml"
TASKS = ["colour_name", "colour_complement", "count_digits", "count_words"]


def overrides(annotation: Path, images: Path) -> list[str]:
    return [
        f"data.sources.0.path={annotation}",  # paths
        f"data.sources.0.images_dir={images}",
        f"train.deepspeed={ROOT}/configs/deepspeed/zero2.json",
        "model.min_pixels=3136",  # sizes
        "model.max_pixels=12544",
        "calibration.n_per_source=4",
        "calibration.batch_size=2",
        "calibration.r=1",  # K = 2
        "train.micro_batch=1",
        "train.grad_accum=2",
        "train.loader_workers=1",
        "eval.batch_size=4",
        "eval.max_examples_per_source=2",
        "eval.benchmarks=[]",
        "flow.retry_delay_s=0",
        "merge.device=cpu",  # the device
    ]


def theta0_snapshot(root: Path) -> Path:
    """A random Qwen2.5-VL with the 7B's structure (untied embeddings and head, GQA, windowed
    vision blocks with full attention every 8th) at tiny widths, saved in bf16 as downloaded."""
    cfg = load_config(None, ["model.tiny.vision_depth=8", "model.tiny.vision_window=112"])
    processor = build_tiny_processor(cfg.model, seed=0)
    config = tiny_config(cfg.model.tiny, processor.tokenizer)
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
    annotation, images = vision_flan_corpus(root / "vision-flan", TASKS, per_task=12)
    run_dir, settings = root / "run", overrides(annotation, images)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(root / "hf"))
        env.setenv("HF_HUB_OFFLINE", "1")
        state = merit(config=str(CONFIG), overrides=settings, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
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
    # `all` with the vision tower frozen: the language blocks and the projector, not the head.
    assert adapted and not any(".visual.blocks." in m for m in adapted) and "lm_head" not in adapted
    assert any(".visual.merger." in m for m in adapted) and any(".language_model." in m for m in adapted)

    # The model merge and the adapter merge of the same weighted average: the same ΔW.
    merged = CheckpointReader(run_dir / "merged" / "token_average")
    base = CheckpointReader(snapshot)
    assert merged.info.keys() == base.info.keys() and "lm_head.weight" in merged.info  # untied: both kept
    model = AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / "token_average")
    assert model.lm_head.weight.dtype == torch.bfloat16
    as_adapter = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(snapshot, dtype=torch.float32),
        run_dir / "merged" / "token_average_adapter",
    ).merge_and_unload()
    for name, tensor in as_adapter.state_dict().items():
        expected = model.state_dict()[name].float()
        assert torch.allclose(tensor, expected, atol=2e-2, rtol=1e-2), name  # bf16 rounding of θ0 + ΔW
    manifest = read_manifest(run_dir / "merged" / "token_average_adapter")
    assert manifest["format"] == "adapter" and set(manifest["truncation_error"].values()) == {0.0}

    report = json.loads((run_dir / "report" / "report.json").read_text())
    names = {m["name"] for m in report["models"]}
    assert {f"merged-{m}" for m in ("token_average", "iso_c", "ties", "token_average_adapter")} <= names
    branches = {b["name"]: b for b in report["branches"]}
    assert branches["branch-0"]["lora"]["rank"] == 16 and branches["joint"]["adapter_mb"] > 0
    text = (run_dir / "report" / "report.md").read_text()
    assert "LoRA branches: rank 16, alpha 32" in text and "Merged on ΔW" in text
