import json

import pytest
import torch
from conftest import small_config
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from pipeline.checkpoint import CheckpointError, verify_checkpoint
from pipeline.data import Collator, Encoder, load_sources
from pipeline.models import apply_freeze, build_tiny_model, count_parameters, load_model, parameter_groups
from pipeline.models.tiny import SPECIAL_TOKENS


def mixed_batch(processor, cfg):
    """Two image examples and two text-only examples in one batch."""
    examples = load_sources(cfg.data, cfg.run.seed).examples
    chosen = [
        examples["colour_name"][0],
        examples["add_digits"][0],
        examples["count_digits"][1],
        examples["uppercase"][2],
    ]
    encoder = Encoder(processor, cfg.data.max_length)
    return Collator(processor.tokenizer.pad_token_id)([encoder(ex) for ex in chosen])


def test_checkpoint_reloads_through_auto_classes(tiny_run):
    _cfg, run_dir = tiny_run
    path = run_dir / "init"
    manifest = verify_checkpoint(path)
    assert manifest["step"] == 0 and "model.safetensors" in manifest["files"]
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert processor.chat_template and "<|im_start|>" in processor.chat_template
    ids = processor.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(len(SPECIAL_TOKENS)))  # every Qwen special token is one real token
    # Tied embeddings are stored once on disk (the layout the merge library works on).
    keys = set(load_file(path / "model.safetensors"))
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert any(k.startswith("model.visual.") or k.startswith("visual.") for k in keys)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()


def test_build_is_deterministic_for_a_seed(tiny_run):
    cfg, _ = tiny_run
    (a, pa), (b, pb) = build_tiny_model(cfg.model, 0), build_tiny_model(cfg.model, 0)
    c, _ = build_tiny_model(cfg.model, 1)
    assert pa.tokenizer.backend_tokenizer.to_str() == pb.tokenizer.backend_tokenizer.to_str()
    for (name, x), y, _z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
    assert any(not torch.equal(x, z) for x, z in zip(a.state_dict().values(), c.state_dict().values()))


def test_reloaded_model_gives_the_same_loss_and_trains_one_step(tiny_run, processor):
    cfg, run_dir = tiny_run
    batch = mixed_batch(processor, cfg)
    assert batch["pixel_values"].shape[0] == 2 * 64  # two 112x112 images, 8x8 patches each
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    built, _ = build_tiny_model(cfg.model, cfg.run.seed)
    model = load_model(run_dir / "init", cfg.model)
    with torch.no_grad():
        assert torch.allclose(built(**batch).loss, model(**batch).loss)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(**batch).loss
    loss.backward()
    groups = parameter_groups(model)
    for group in ("vision_tower", "multi_modal_projector", "language_model"):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in groups[group] if p.dim() > 1), group
    optimizer.step()
    assert torch.isfinite(loss)
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p)]
    assert len(changed) == len(before)


@pytest.mark.parametrize(
    "flag, frozen_group",
    [
        ("freeze_vision_tower", "vision_tower"),
        ("freeze_multi_modal_projector", "multi_modal_projector"),
        ("freeze_language_model", "language_model"),
    ],
)
def test_freeze_policy(tiny_run, flag, frozen_group):
    cfg, run_dir = tiny_run
    model = load_model(run_dir / "init", small_config(f"model.freeze.{flag}=true").model)
    groups = parameter_groups(model)
    for group, params in groups.items():
        assert all(p.requires_grad == (group != frozen_group) for p in params), group
    counts = count_parameters(model)
    assert counts["trainable"] == counts["total"] - sum(
        p.numel() for p in {id(p): p for p in groups[frozen_group]}.values()
    )
    apply_freeze(model, cfg.model.freeze)
    assert all(p.requires_grad for p in model.parameters())


def test_load_model_refuses_a_corrupt_checkpoint(tiny_run, tmp_path):
    cfg, run_dir = tiny_run
    copy = tmp_path / "init"
    copy.mkdir()
    for f in (run_dir / "init").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(copy, cfg.model)


def test_load_model_leaves_transformers_hub_kernels_off_unless_asked(tiny_run):
    """transformers kernelizes a model by default, with code the Hub sends (offline on a GPU: a crash)."""
    cfg, run_dir = tiny_run
    assert load_model(run_dir / "init", cfg.model).use_kernels is False
    asked = cfg.model.model_copy(update={"use_kernels": True})
    assert load_model(run_dir / "init", asked).use_kernels is True


def test_manifest_records_parameter_counts(tiny_run):
    _, run_dir = tiny_run
    manifest = json.loads((run_dir / "init" / "manifest.json").read_text())
    assert manifest["parameters"]["total"] == manifest["parameters"]["trainable"] > 100_000
