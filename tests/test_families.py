"""Every model family, at tiny width from its own config class: built offline as the hub stores it,
trained on a real example, merged without dropping a tensor, each expert's matrices merged alone."""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BRANCH_SOURCES, branch_spec, restyled_copy, small_config
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from pipeline.config import SHIPPED_DEEPSPEED, TrainSection
from pipeline.data.builtin import make_example
from pipeline.data.encode import Collator, Encoder
from pipeline.data.example import Example
from pipeline.data.packed import PackedCollator
from pipeline.merge import CheckpointReader, MergeInputError, MergeSpec, merge_checkpoints
from pipeline.merge.io import TensorInfo, check_complete
from pipeline.merge.layout import ModelView
from pipeline.models import init_model, load_model, parameter_groups
from pipeline.models.attention import packed_attention, prepare_for_packing
from pipeline.models.families import UnsupportedModelError, get_family, supported
from pipeline.models.kernels import patch as patch_with_liger
from pipeline.models.kernels import use_liger
from pipeline.models.loading import DTYPES
from pipeline.models.loss import decoder_states, supervised_nll
from pipeline.models.saving import save_like
from pipeline.train import train_branch

ROOT = Path(__file__).parent.parent
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl"]


def test_the_registry_declares_every_supported_family():
    assert supported() == sorted(FAMILIES)
    with pytest.raises(UnsupportedModelError, match="model type 'llama4'.*adding-a-model-family"):
        get_family("llama4")
    with pytest.raises(ValueError, match="tiny:gemma9"):
        small_config("model.name_or_path=tiny:gemma9")


@pytest.fixture(scope="module", params=FAMILIES)
def theta0(request, tmp_path_factory):
    """(config, θ0's folder) of one family's tiny model, built as the init stage builds it."""
    name = "tiny" if request.param == "qwen2_5_vl" else f"tiny:{request.param}"
    cfg = small_config(f"model.name_or_path={name}")
    run_dir = tmp_path_factory.mktemp(request.param)
    return request.param, cfg, init_model(cfg, run_dir)["path"]


IMAGE_SIZES = [(20, 20), (33, 200), (500, 60), (224, 224), (1200, 900), (97, 301)]  # (width, height)


def test_prepares_token_ids_from_image_sizes_are_the_processors_on_every_family(theta0):
    """prepare's path (each image's size from its header, the processor's own count and spelling of
    its tokens, nothing decoded) gives the full path's ids and labels, equal, whatever the size,
    several images to an example, and truncation."""
    from PIL import Image

    _, _, path = theta0
    processor = AutoProcessor.from_pretrained(path)
    images = [Image.new("RGB", size, (40 * i, 120, 200)) for i, size in enumerate(IMAGE_SIZES)]

    def example(index: int, pictures: list) -> Example:
        question = [{"type": "image"}] * len(pictures) + [{"type": "text", "text": "What is shown?"}]
        answer = [{"type": "text", "text": "Shapes in colours."}]
        return Example(
            "s",
            index,
            "sizes",
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            pictures,
        )

    examples = [example(i, [image]) for i, image in enumerate(images)] + [example(9, images[:3]), example(10, [])]
    for max_length in (4096, 40):  # 40: some cut inside or after their images
        encoder = Encoder(processor, max_length)
        counted = encoder.encode_counted(examples)
        for ex, fast in zip(examples, counted, strict=True):
            full = encoder(ex)
            assert torch.equal(fast.input_ids, full.input_ids) and torch.equal(fast.labels, full.labels), ex.index
            assert fast.truncated == full.truncated
        assert any(enc.truncated for enc in counted) == (max_length == 40)


def test_a_tiny_model_is_its_familys_own_class_and_trains_on_an_image_example(theta0):
    model_type, cfg, path = theta0
    assert AutoConfig.from_pretrained(path).model_type == model_type
    model, processor = load_model(path, cfg.model), AutoProcessor.from_pretrained(path)
    groups = parameter_groups(model)
    unique = {id(p) for p in model.parameters()}
    assert sum(len({id(p) for p in g}) for g in groups.values()) == len(unique)  # the parts cover it once
    assert all(groups.values())
    example = make_example("colour_name", 0, seed=0, image_size=64)
    encoded = Encoder(processor, 512)(example)
    assert int((encoded.input_ids == processor.image_token_id).sum()) > 0
    model.train()
    out = model(**Collator(processor.tokenizer.pad_token_id)([encoded]))  # as a training step feeds it
    out.loss.backward()
    assert torch.isfinite(out.loss)
    trained = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    vision = get_family(model_type).vision.removeprefix("model.")
    assert any(vision in n for n in trained)  # the image reached the model through its vision tower
    if model_type.endswith("_moe"):  # the experts and the router learn from the example
        assert any(".mlp.experts." in n for n in trained) and any(n.endswith("mlp.gate.weight") for n in trained)


def branches(path: str, tmp_path, n: int = 2) -> list[str]:
    """θ0 plus a different random change of every float tensor, saved as a branch is (θ0's layout)."""
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(path)
    theta = {k: v.clone() for k, v in model.state_dict().items()}
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        state = {
            name: t + 0.01 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t
            for name, t in theta.items()
        }
        model.load_state_dict(state)
        out.append(str(save_like(tmp_path / f"branch{k}", model, path, processor, step=1)))
    return out


def merge(theta0: str, paths: list[str], out: str, method: str, weights=(1.0, 3.0), **params) -> CheckpointReader:
    models = [{"path": p, "weight": w} for p, w in zip(paths, weights)]
    spec = MergeSpec(base_model=theta0, models=models, method=method, params=params, out_path=out)
    merge_checkpoints(spec, progress=False)
    return CheckpointReader(out)


def test_a_merge_holds_exactly_theta0s_tensors_and_the_average_is_exact(theta0, tmp_path):
    model_type, cfg, path = theta0
    paths = branches(path, tmp_path)
    merged = merge(path, paths, str(tmp_path / "avg"), "weighted_average")
    base = CheckpointReader(path)
    assert {n: i.shape for n, i in merged.info.items()} == {n: i.shape for n, i in base.info.items()}
    assert [CheckpointReader(p).info.keys() for p in paths] == [base.info.keys()] * 2  # branches as θ0 stores
    inputs = [CheckpointReader(p) for p in paths]
    for name in base.info:
        expected = 0.25 * inputs[0].get(name).float() + 0.75 * inputs[1].get(name).float()
        assert torch.allclose(merged.get(name).float(), expected, rtol=0, atol=1e-6), name
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "avg", dtype=DTYPES[cfg.model.dtype])
    assert loaded.config.model_type == model_type


def test_a_merged_lora_adapter_is_pefts_merged_model_under_every_familys_tensor_names(theta0, tmp_path):
    """LoRA on every linear layer (vision tower, projector, language model): the merge library finds each
    adapted module's tensor under the family's on-disk name and adds PEFT's ΔW to it."""
    model_type, _, path = theta0
    peft = get_peft_model(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32), all_linear())
    g = torch.Generator().manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data = 0.1 * torch.randn(p.shape, generator=g)
    peft.save_pretrained(tmp_path / "adapter")
    base = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    theta = {k: v.clone() for k, v in base.state_dict().items()}
    reference = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    spec = {"base_model": path, "models": [{"adapter": str(tmp_path / "adapter")}], "out_path": str(tmp_path / "m")}
    merge_checkpoints(MergeSpec.model_validate(spec | {"method": "weighted_average"}), progress=False)
    ours = AutoModelForImageTextToText.from_pretrained(tmp_path / "m", dtype=torch.float32).state_dict()
    changed = [n for n in theta if not torch.equal(reference[n], theta[n])]
    parts = {get_family(model_type).vision, *get_family(model_type).projector, "model.language_model"}
    assert all(any(n.startswith(part) for n in changed) for part in parts)  # every part adapted
    for name in theta:
        delta = reference[name] - theta[name]
        torch.testing.assert_close(ours[name] - theta[name], delta, rtol=0, atol=1e-6 * (1 + delta.abs().max()))


def all_linear() -> LoraConfig:
    return LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_each_experts_gate_up_and_down_merge_alone_and_routers_average(tmp_path_factory, tmp_path, family):
    """Iso-C of a fused expert tensor is Iso-C of each expert's gate, up and down matrix on its own (a
    spectrum over the gate and up halves together, or over all experts, would be another merge); the
    routers, not named by a rule, are averaged."""
    cfg = small_config(f"model.name_or_path=tiny:{family}")
    path = init_model(cfg, tmp_path_factory.mktemp("moe"))["path"]
    paths = branches(path, tmp_path)
    merge(path, paths, str(tmp_path / "iso"), "iso_c")
    base, inputs = ModelView.open(path), [ModelView.open(p) for p in paths]
    merged = ModelView.open(tmp_path / "iso")
    layer, e = "model.language_model.layers.0.mlp", cfg.model.tiny.num_experts - 1
    assert base.layout.experts == ("fused_in_out" if family == "qwen3_vl_moe" else "fused")
    for proj, shape in {"gate_proj": (24, 64), "up_proj": (24, 64), "down_proj": (64, 24)}.items():
        key = f"{layer}.experts.{e}.{proj}.weight"
        assert base.info[key].shape == shape
        taus = [np.asarray(r.get(key).double() - base.get(key).double()) for r in inputs]
        u, s, vt = np.linalg.svd(0.25 * taus[0] + 0.75 * taus[1], full_matrices=False)
        expected = base.get(key).double().numpy() + s.mean() * u @ vt  # Iso-C of this matrix alone
        np.testing.assert_allclose(merged.get(key).double().numpy(), expected, atol=1e-5)
    router = f"{layer}.gate.weight"
    average = 0.25 * inputs[0].get(router) + 0.75 * inputs[1].get(router)
    assert torch.allclose(merged.get(router), average, rtol=0, atol=1e-6)


def test_an_output_missing_or_adding_a_tensor_is_refused_naming_it():
    reference = {
        "model.visual.deepstack_merger_list.0.norm.weight": TensorInfo((8,), torch.float32),
        "model.language_model.layers.0.mlp.experts.down_proj": TensorInfo((4, 8, 2), torch.bfloat16),
    }
    assert check_complete(dict(reference), reference, "merge m", "θ0") == 2
    dropped = {k: v for k, v in reference.items() if "visual" not in k}
    with pytest.raises(MergeInputError, match=r"1 missing \['model.visual.deepstack_merger_list.0.norm.weight'\]"):
        check_complete(dropped, reference, "merge m", "θ0")
    reshaped = reference | {"model.language_model.layers.0.mlp.experts.down_proj": TensorInfo((8, 2), torch.float32)}
    with pytest.raises(MergeInputError, match="1 of another shape"):
        check_complete(reshaped, reference, "merge m", "θ0")


def test_calibration_sketches_the_experts_and_the_router_of_a_mixture_of_experts():
    from calibration.gradients import select_parameters
    from pipeline.models import build_tiny_model

    cfg = small_config("model.name_or_path=tiny:qwen3_vl_moe")
    model = build_tiny_model(cfg.model, 0)[0]
    chosen = select_parameters(model, cfg.calibration.params, cfg.calibration.matrices_only)
    layer = "model.language_model.layers.0."
    assert {f"{layer}mlp.experts.gate_up_proj", f"{layer}mlp.experts.down_proj", f"{layer}mlp.gate.weight"} <= set(
        chosen
    )
    assert not any(n.endswith("norm.weight") for n in chosen)


# The shipped configs' models at tiny widths with their structure: Qwen3-VL-8B untied; 30B-A3B a
# mixture of experts, untied, its DeepStack mergers at three of the vision blocks.
SHIPPED = {
    "qwen3_vl_8b_lora.yaml": ("Qwen/Qwen3-VL-8B-Instruct", "tiny:qwen3_vl", []),
    "qwen3_vl_30b_a3b_lora.yaml": (
        "Qwen/Qwen3-VL-30B-A3B-Instruct",
        "tiny:qwen3_vl_moe",
        ["model.tiny.num_experts=8", "model.tiny.experts_per_token=2", "model.tiny.vision_depth=17"],
    ),
}


@pytest.mark.parametrize("config", sorted(SHIPPED))
def test_a_shipped_qwen3_config_reads_its_model_from_a_hub_snapshot_and_merges_it_whole(config, tmp_path):
    """θ0 named by its hub id, found in a hub-shaped cache; preflight's model, LoRA, DeepSpeed and
    merge checks pass; LoRA `all` adapts the attention (no router, no expert); the config's merges
    keep every tensor."""
    from conftest import hub_snapshot

    from pipeline import preflight
    from pipeline.config import load_config
    from pipeline.models import apply_freeze, build_tiny_model
    from pipeline.models.saving import save_as_hub
    from pipeline.train.lora import lora_targets

    repo, tiny, widths = SHIPPED[config]
    built = small_config(f"model.name_or_path={tiny}", *widths)
    model, processor = build_tiny_model(built.model, seed=0)
    model.config.tie_word_embeddings = model.config.text_config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    save_as_hub(tmp_path / "download", model.to(torch.bfloat16), {}, processor)  # experts (in, out) as the hub's
    hub_snapshot(tmp_path / "hf", repo, tmp_path / "download")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(tmp_path / "hf"))
        cfg = load_config(ROOT / "configs" / config)
        assert f"({tiny.partition(':')[2]}: " in preflight._theta0(cfg, tmp_path)
        assert preflight._lora(cfg, tmp_path).startswith("LoRA rank 16")
        preflight._deepspeed(cfg, tmp_path)
        preflight._merges(cfg, tmp_path)
        path = preflight.base_path(cfg, tmp_path)
    apply_freeze(model, cfg.model.freeze)
    targets = lora_targets(model, cfg.train)
    assert {t.rsplit(".", 1)[-1] for t in targets} == {"q_proj", "k_proj", "v_proj", "o_proj"} | (
        set() if "moe" in tiny else {"gate_proj", "up_proj", "down_proj"}
    )
    paths = branches(path, tmp_path)
    iso = next(m for m in cfg.merge.methods if m.method == "iso_c")
    merged = merge(path, paths, str(tmp_path / "merged"), iso.method, **iso.params)
    base = CheckpointReader(path)
    assert {n: i.shape for n, i in merged.info.items()} == {n: i.shape for n, i in base.info.items()}
    assert "lm_head.weight" in merged.info and any("deepstack_merger_list" in n for n in merged.info)


def test_preflight_reads_theta0s_layout_from_its_files_and_passes_full_weight_diloco_on_every_moe(tmp_path):
    """θ0's layout is decided from its files and config (no model built): preflight names it, refuses a fused
    tensor of a shape the family does not load, and lets full-weight DiLoCo workers train Qwen3.5-MoE (they
    send Δ as they hold the experts; the aggregator reads it and the globals through the same layout)."""
    from pipeline import preflight

    for family in ("qwen3_5_moe", "qwen3_vl_moe"):
        assert "workers" in preflight._diloco(small_config(f"model.name_or_path=tiny:{family}"), ".")
    built = init_model(small_config("model.name_or_path=tiny:qwen3_5_moe"), tmp_path / "run")["path"]
    cfg = small_config(f"model.name_or_path={built}")
    checked = preflight._theta0(cfg, tmp_path)
    assert "(qwen3_5_moe: " in checked and "experts fused (experts, out, in)" in checked and "(mtp.*)" in checked
    broken = shutil.copytree(built, tmp_path / "broken", ignore=shutil.ignore_patterns("manifest.json", ".*"))
    tensors = load_file(broken / "model.safetensors")
    save_file(
        {n: t.transpose(1, 2).contiguous() if "experts.gate_up" in n else t for n, t in tensors.items()},
        broken / "model.safetensors",
    )  # Qwen3.5-MoE is never stored (in, out)
    with pytest.raises(ValueError, match=r"experts.gate_up_proj is \(4, 64, 48\): .* loads it as \(experts, 48, 64\)"):
        preflight._theta0(small_config(f"model.name_or_path={broken}"), tmp_path)


FUSED = "model.language_model.layers.0.mlp.experts.down_proj"


def test_branches_transformers_saved_merge_over_a_hub_theta0_into_the_hubs_layout(tmp_path_factory, tmp_path):
    """Qwen3-VL-MoE on the hub stores each expert (in, out); transformers loads it transposed and saves (out, in).
    A merge of branches saved by transformers over the hub's θ0 reads both as loaded and writes θ0's layout,
    which transformers loads to the merge."""
    cfg = small_config("model.name_or_path=tiny:qwen3_vl_moe")
    hub = init_model(cfg, tmp_path_factory.mktemp("moe-hub"))["path"]
    assert CheckpointReader(hub).info[FUSED].shape == (4, 24, 64)  # (experts, in, out) as on the hub
    paths = [
        str(restyled_copy(p, tmp_path / f"saved{k}", experts="fused")) for k, p in enumerate(branches(hub, tmp_path))
    ]
    assert CheckpointReader(paths[0]).info[FUSED].shape == (4, 64, 24)  # (experts, out, in), as transformers saves
    for method in ("weighted_average", "iso_c"):
        merged = merge(hub, paths, str(tmp_path / method), method)
        assert merged.info[FUSED].shape == (4, 24, 64)
    inputs, average = [ModelView.open(p) for p in paths], ModelView.open(tmp_path / "weighted_average")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "weighted_average").state_dict()
    expected = 0.25 * inputs[0].get_loaded(FUSED) + 0.75 * inputs[1].get_loaded(FUSED)
    torch.testing.assert_close(loaded[FUSED], expected, rtol=0, atol=1e-6)
    assert torch.equal(average.get_loaded(FUSED), loaded[FUSED])
    delta = ModelView.open(tmp_path / "iso_c").get_loaded(FUSED) - ModelView.open(hub).get_loaded(FUSED)
    assert 0 < delta.abs().max() < 0.1  # θ0 read as loaded, not transposed: the update is a small ΔW


@pytest.mark.parametrize("layout", ["hub", "saved"])
def test_a_zero3_branch_of_a_moe_with_partitioned_experts_keeps_theta0s_layout_and_merges(tmp_path, layout):
    """ZeRO-3 partitions only tensors above its persistence threshold (1e5 entries by default, more than a tiny
    expert tensor holds): lowered here, every expert tensor is partitioned, as a real model's are. Under ZeRO-3
    transformers transposes an expert tensor it compares with a partition of shape (0,) (loading and saving
    alike): the branch starts from θ0 as loaded in either layout, and its final weights are written in θ0's
    layout, which merges with θ0 and loads."""
    from merit.cli import main as merit

    run = tmp_path / "run"
    settings = ["model.name_or_path=tiny:qwen3_vl_moe", "data.builtin.examples_per_source=8", "warmup.steps=0"]
    assert merit(["init", str(ROOT / "configs/demo.yaml"), "--run-dir", str(run), *sets(settings)]) == 0
    assert merit(["prepare", "--run-dir", str(run)]) == 0
    built = str(run / "init")
    init = built if layout == "hub" else str(restyled_copy(built, tmp_path / "saved", experts="fused"))
    zero3 = json.loads((SHIPPED_DEEPSPEED / "zero3.json").read_text())
    zero3["zero_optimization"]["stage3_param_persistence_threshold"] = 1000  # an expert tensor: 4 × 48 × 64
    (tmp_path / "zero3.json").write_text(json.dumps(zero3))
    settings = [f"train.deepspeed={tmp_path / 'zero3.json'}", "train.processes=2", "train.steps=2"]
    branch = branch_spec(run, tmp_path / "branch", *settings, "train.checkpoint_every=2", sources=BRANCH_SOURCES[:2])
    result = train_branch(branch.model_copy(update={"init": init}), echo=False)
    assert result.steps == 2
    log = (tmp_path / "branch" / "train.log").read_text()
    # every tensor over 1,000 entries is partitioned, an expert tensor's 12,288 (4 × 48 × 64) among them
    assert re.search(r"ZeRO-3 partitions \d+ of \d+ tensors .* at most 1,000 entries stay whole", log), log[-2000:]
    final = tmp_path / "branch" / "final"
    trained, theta0 = CheckpointReader(final), CheckpointReader(init)
    assert {n: i.shape for n, i in trained.info.items()} == {n: i.shape for n, i in theta0.info.items()}
    delta = ModelView.open(final).get_loaded(FUSED) - ModelView.open(init).get_loaded(FUSED)
    assert 0 < delta.abs().max() < 0.1  # θ0's values, trained a little: loaded and written right
    merged = merge(init, [str(final), str(final)], str(tmp_path / "merged"), "ties", weights=(1.0, 1.0))
    assert merged.info.keys() == theta0.info.keys()
    assert AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").config.model_type == "qwen3_vl_moe"


def sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def test_a_generation_that_raises_passes_through_internvl_hfs_except_exception():
    """lmms-eval's internvl_hf answers "" when generate raises (then scored as a wrong answer): the
    project's class raises what its ``except Exception`` does not catch, so the job fails instead."""
    from pipeline.eval.lmms_adapted import GenerationFailed, failing_loudly

    def out_of_memory(**kwargs):
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(GenerationFailed, match="CUDA out of memory"):
        try:
            failing_loudly(out_of_memory)(max_new_tokens=8)
        except Exception:  # what internvl_hf's generate_until does
            pytest.fail("caught as an ordinary exception: the job would score an empty answer")


MIXED = [("caption", 0), ("add_digits", 1), ("colour_name", 2), ("reverse_word", 3)]  # images, text, of 28-51 tokens


def packed_model(path: str, cfg, attention: str):
    """θ0 loaded for packed micro batches as a branch loads it, with ``attention``."""
    model = load_model(path, cfg.model, attn_implementation=packed_attention(TrainSection(packed_attention=attention)))
    prepare_for_packing(model)
    return model


def mixed_examples(path: str) -> tuple[list, Collator]:
    processor = AutoProcessor.from_pretrained(path)
    examples = [make_example(source, i, seed=0, image_size=64) for source, i in MIXED]
    return Encoder(processor, 512).encode_batch(examples), Collator(processor.tokenizer.pad_token_id)


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_a_packed_micro_batch_trains_as_its_examples_one_at_a_time(theta0, attention):
    """Examples with and without images, packed into one row: the loss summed over their supervised
    tokens and every tensor's gradient are those of the examples run alone, unpacked (the loss in
    fp32; the gradients in float64, where rounding cannot hide a difference of attention or positions)."""
    model_type, cfg, path = theta0
    model = packed_model(path, cfg, attention)
    encoded, padded = mixed_examples(path)
    assert {e.pixel_values is None for e in encoded} == {True, False} and len({e.num_tokens for e in encoded}) > 2
    row = PackedCollator(model.config)(encoded)
    packed, count = supervised_nll(model, row)
    alone = [supervised_nll(model, padded([e])) for e in encoded]
    assert count == sum(n for _, n in alone) == sum(e.num_supervised for e in encoded)
    assert packed.item() == pytest.approx(sum(nll.item() for nll, _ in alone), rel=1e-5)

    if model_type.endswith("_moe"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    model.double()

    def gradients(batches) -> dict[str, torch.Tensor]:
        model.zero_grad()
        for batch in batches:
            supervised_nll(model, batch)[0].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference, together = gradients([padded([e]) for e in encoded]), gradients([row])
    assert together.keys() == reference.keys()
    for name, grad in reference.items():
        assert (together[name] - grad).norm() <= 1e-5 * grad.norm(), name


def test_an_example_in_a_packed_row_sees_nothing_of_its_neighbours(theta0):
    """Change one example's tokens and another's image: every other example's hidden states are
    bit for bit the same (attention, positions, the vision tower and linear attention stay inside
    each example), and the changed ones' are not."""
    _, cfg, path = theta0
    model = packed_model(path, cfg, "varlen")
    encoded, _ = mixed_examples(path)
    collate = PackedCollator(model.config)
    changed = [replace(e) for e in encoded]
    changed[1] = replace(
        encoded[1],
        input_ids=torch.cat([encoded[1].input_ids[:5], encoded[1].input_ids[5:15].flip(0), encoded[1].input_ids[15:]]),
    )
    changed[2] = replace(encoded[2], pixel_values=encoded[2].pixel_values + 0.5)
    with torch.no_grad():
        before, after = (decoder_states(model, collate(items))[0] for items in (encoded, changed))
    edges = np.cumsum([0] + [e.num_tokens for e in encoded])
    same = [torch.equal(before[a:b], after[a:b]) for a, b in pairwise(edges)]
    assert same == [True, False, False, True]


@pytest.fixture
def transformers_restored():
    """Liger's patches also replace classes and functions in transformers' modeling modules, for the
    whole process (a branch's): put every one back for the tests that follow."""
    modules = {name: dict(vars(m)) for name, m in sys.modules.items() if name.startswith("transformers.models.")}
    yield
    for name, saved in modules.items():
        vars(sys.modules[name]).clear()
        vars(sys.modules[name]).update(saved)
    for name in [n for n in sys.modules if n.startswith("transformers.models.") and n not in modules]:
        del sys.modules[name]  # imported by a patch, and patched: imported afresh when next needed


def test_liger_is_off_without_a_gpu_and_its_patch_for_the_family_reaches_the_models_norms(
    theta0, transformers_restored
):
    """On a CPU ``auto`` trains without Liger and says why, ``true`` refuses. Liger's own patch for
    the family, applied to the instance (what a GPU branch runs), replaces the forward of every
    RMSNorm of the language model, or fails to import before touching anything (liger-kernel
    0.8.5's Qwen2.5-VL and Qwen3-VL patches import an output class transformers 5.25 renamed)."""
    _, cfg, path = theta0
    model = load_model(path, cfg.model)
    assert use_liger(TrainSection(), model) == "off (there is no GPU: Liger's kernels are Triton GPU kernels)"
    with pytest.raises(ValueError, match="train.liger_kernel is true, but there is no GPU"):
        use_liger(TrainSection(liger_kernel=True), model)
    norms = [m for n, m in model.named_modules() if "language_model" in n and type(m).__name__.endswith("RMSNorm")]
    try:
        patch_with_liger(model)
    except ImportError as err:
        assert "liger_kernel" in str(err) and not any("forward" in vars(m) for m in model.modules())
    else:
        assert norms and all("forward" in vars(m) for m in norms)
