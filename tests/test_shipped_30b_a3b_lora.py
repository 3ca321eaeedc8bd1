"""The shipped ``configs/qwen3_vl_30b_a3b_lora.yaml`` run end to end with only sizes, paths and the device
overridden, on a tiny model of its family stored as the hub stores Qwen3-VL-30B-A3B-Instruct: named by its hub
id and found in a hub-shaped cache, a random Qwen3-VL-MoE with the 30B-A3B's structure (8 experts a layer,
2 a token, untied head, DeepStack mergers at three vision blocks) at tiny widths, in bf16, each expert stored
(in, out) as the hub's files do. Its LoRA branches adapt the attention (the experts are not linear layers);
every merge, the diagnostics and the report are written, each merged model in the hub's layout. The
benchmarks are another test's (tests/test_shipped_3b.py names the paper's eight)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hub_snapshot, run_shipped_lora
from transformers import AutoModelForImageTextToText

from pipeline.config import load_config
from pipeline.merge import CheckpointReader, ModelView
from pipeline.models import build_tiny_model
from pipeline.models.saving import save_as_hub

pytestmark = pytest.mark.release  # a shipped config of a large model's shape: make test-release

ROOT = Path(__file__).parent.parent
CONFIG = ROOT / "configs" / "qwen3_vl_30b_a3b_lora.yaml"
FUSED = "model.language_model.layers.0.mlp.experts.gate_up_proj"


def theta0_snapshot(root: Path) -> Path:
    """A random Qwen3-VL-MoE with the 30B-A3B's structure at tiny widths, stored in bf16 as the hub's files are."""
    cfg = load_config(
        None, ["model.name_or_path=tiny:qwen3_vl_moe", "model.tiny.num_experts=8", "model.tiny.vision_depth=17"]
    )
    model, processor = build_tiny_model(cfg.model, seed=0)
    save_as_hub(root / "download", model.to(torch.bfloat16), {}, processor)
    return hub_snapshot(root / "hf", "Qwen/Qwen3-VL-30B-A3B-Instruct", root / "download")


@pytest.fixture(scope="module")
def shipped(prefect_api, tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped-30b-a3b-lora")
    snapshot = theta0_snapshot(root)
    # two or three of these tiny examples a packed micro batch
    run_dir, settings = run_shipped_lora(CONFIG, root, snapshot, "model.max_pixels=16384", "train.max_tokens=256")
    return run_dir, snapshot, settings


def test_the_shipped_30b_a3b_lora_config_reaches_its_report_with_every_merge_in_the_hubs_layout(shipped):
    run_dir, snapshot, settings = shipped
    ran = load_config(run_dir / "config.yaml")
    assert ran == load_config(CONFIG, [*settings, f"model.revision={snapshot.name}"])  # the file, overridden only
    hub = CheckpointReader(snapshot)
    assert hub.info[FUSED].shape == (8, 64, 48)  # (experts, in, out)
    for merge in ("token_average", "iso_c", "ties"):
        merged = CheckpointReader(run_dir / "merged" / merge)
        assert {n: i.shape for n, i in merged.info.items()} == {n: i.shape for n, i in hub.info.items()}, merge
        assert torch.equal(merged.get(FUSED), hub.get(FUSED))  # LoRA on the attention leaves the experts θ0's
        assert (
            AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / merge).config.model_type == "qwen3_vl_moe"
        )
    attention = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        ModelView.open(run_dir / "merged" / "iso_c").get(attention), ModelView.open(snapshot).get(attention)
    )
    distances = json.loads((run_dir / "eval" / "diagnostics.json").read_text())["distance_from_theta0"]
    assert {"merged-token_average", "merged-iso_c", "merged-ties", "merged-token_average_adapter"} <= distances.keys()
    assert all(0 < d["relative"] < 0.1 for d in distances.values())
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert {f"merged-{m}" for m in ("token_average", "iso_c", "ties", "token_average_adapter")} <= {
        m["name"] for m in report["models"]
    }
    assert "experts fused (experts, in, out)" in (run_dir / "report" / "report.md").read_text()
