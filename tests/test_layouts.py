"""Checkpoints as the hub stores them and as other tools write them: every layout transformers reads is read
as the same model, every checkpoint the project writes keeps its source's layout and its unloaded tensors,
and a merge as transformers loads it does not depend on the layouts of its inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import restyled_copy, small_config
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText

from pipeline.config import TrainSection
from pipeline.merge import CheckpointReader, MergeInputError, MergeSpec, merge_checkpoints
from pipeline.merge.layout import InMemory, ModelView
from pipeline.models import build_tiny_model, init_model
from pipeline.models.saving import save_like
from pipeline.train.lora import apply_lora

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl"]
STYLES = {"qwen3_vl_moe": ["fused_in_out", "fused"], "qwen3_5_moe": ["fused", "per_expert"]}
LAYER = "model.language_model.layers.0.mlp"


def tiny(family: str):
    return small_config("model.name_or_path=" + ("tiny" if family == "qwen2_5_vl" else f"tiny:{family}"))


@pytest.fixture(scope="module")
def thetas(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny θ0 as the init stage writes it: as the hub stores that family."""
    return {f: Path(init_model(tiny(f), tmp_path_factory.mktemp(f))["path"]) for f in ["qwen3_vl_moe", "qwen3_5_moe"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_transformers_reads_is_read_as_the_model_transformers_loads(family, tmp_path):
    """The hub's spelling and expert layout, transformers' own, experts one by one or (in, out), two shards:
    transformers loads each to the same model, and the view's tensors are that model's, bit for bit."""
    model, _ = build_tiny_model(tiny(family).model, seed=0)
    held = model.state_dict()
    source = tmp_path / "memory"  # the tensors as the model holds them, names and all (transformers 4.5x's spelling)
    source.mkdir()
    save_file(
        {n: t.contiguous() for n, t in held.items() if n != "lm_head.weight" or not model.config.tie_word_embeddings},
        source / "model.safetensors",
    )
    model.config.save_pretrained(source)
    keys = None
    for style in [None, *STYLES.get(family, [])]:
        folder = restyled_copy(source, tmp_path / f"as-{style}", experts=style, shards=2)
        view = ModelView.open(folder)
        assert keys is None or view.info.keys() == keys, style
        keys = view.info.keys()
        loaded = AutoModelForImageTextToText.from_pretrained(folder).state_dict()
        assert all(torch.equal(view.get_loaded(n), loaded[n]) for n in view.loaded()), style
        assert view.loaded().keys() | {"lm_head.weight"} >= loaded.keys()
    memory = ModelView.open(source)
    assert memory.info.keys() == keys and all(torch.equal(memory.get(k), view.get(k)) for k in keys)
    model.save_pretrained(tmp_path / "saved")  # transformers' own split of fused experts (Qwen3.5-MoE: one by one)
    saved = ModelView.open(tmp_path / "saved")
    assert saved.info.keys() == keys and all(torch.equal(memory.get(k), saved.get(k)) for k in keys)


def test_a_fused_tensor_that_neither_layout_fits_is_refused_naming_it(tmp_path):
    model, _ = build_tiny_model(tiny("qwen3_vl_moe").model, seed=0)
    held = dict(model.state_dict())
    held[f"{LAYER}.experts.down_proj"] = torch.zeros(4, 64, 25)
    with pytest.raises(
        MergeInputError,
        match=rf"{LAYER}.experts.down_proj is \(4, 64, 25\): .* loads it as \(experts, 64, 24\) or \(experts, 24, 64\)",
    ):
        ModelView(InMemory(held), model.config.to_dict())


def perturbed(view: ModelView, seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    """θ0 as the model holds it plus a random change of every float tensor."""
    g = torch.Generator().manual_seed(seed)
    return {n: view.get_loaded(n).float() + scale * torch.randn(i.shape, generator=g) for n, i in view.loaded().items()}


@pytest.mark.parametrize("style", ["hub", "per_expert"])
def test_a_model_written_like_its_source_keeps_its_layout_and_carries_the_mtp_head_unchanged(thetas, tmp_path, style):
    """What a branch writes (θ0 + a change, as the model holds it) lands in θ0's stored layout, tensor for
    tensor, Qwen3.5's mtp head copied bit for bit; transformers loads it to the weights written."""
    source = (
        thetas["qwen3_5_moe"]
        if style == "hub"
        else restyled_copy(thetas["qwen3_5_moe"], tmp_path / "per", "per_expert", 2)
    )
    view = ModelView.open(source)
    assert len(view.layout.carried) == 19 and all(n.startswith("mtp.") for n in view.layout.carried)
    model = AutoModelForImageTextToText.from_pretrained(source)
    state = perturbed(view, 0)
    out = save_like(tmp_path / "branch", model, source, state=state, step=1)
    written, files = CheckpointReader(out), CheckpointReader(source)
    assert {n: i.shape for n, i in written.info.items()} == {n: i.shape for n, i in files.info.items()}
    assert all(torch.equal(written.get(n), files.get(n)) for n in view.layout.carried)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["carried"] == view.layout.carried and manifest["source"] == str(source)
    loaded = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    state.pop(f"{LAYER}.experts.down_proj")
    with pytest.raises(MergeInputError, match=rf"4 missing \['{LAYER}.experts.0.down_proj.weight'"):
        save_like(tmp_path / "broken", model, source, state=state)
    assert not (tmp_path / "broken").exists()


METHODS = {
    "weighted_average": {},
    "task_arithmetic": {"scale": 0.8},
    "iso_c": {},
    "tsv": {},
    "iso_cts": {},
    "ties": {"density": 0.3},
    "dare_ties": {"density": 0.5},
    "della": {"density": 0.5},
    "breadcrumbs": {"density": 0.5, "gamma": 0.05},
    "sce": {"select_topk": 0.5},
    "model_stock": {},
    "slerp": {"t": 0.3},
    "nuslerp": {},
    "karcher": {},
    "fisher": {},
}


@pytest.fixture(scope="module")
def layouts(thetas, tmp_path_factory):
    """θ0 of a Qwen3.5-MoE as the hub stores it (experts fused, untied head, mtp, two shards) and the same
    weights with the experts one matrix each; in each, two branches and their Fisher values, written as the
    project writes them (θ0's layout)."""
    root = tmp_path_factory.mktemp("layouts")
    hub = restyled_copy(thetas["qwen3_5_moe"], root / "hub", shards=2)
    out = {"hub": hub, "per_expert": restyled_copy(hub, root / "per_expert", "per_expert", 2)}
    model = AutoModelForImageTextToText.from_pretrained(hub)
    sets = {}
    for style, theta0 in out.items():
        view = ModelView.open(theta0)
        branches = [save_like(root / style / f"b{k}", model, theta0, state=perturbed(view, k)) for k in range(2)]
        fishers = []
        for k in range(2):
            g = torch.Generator().manual_seed(10 + k)
            values = {n: torch.rand(i.shape, generator=g) + 0.1 for n, i in view.loaded().items()}
            fishers.append(save_like(root / style / f"f{k}", model, theta0, state=values))
        sets[style] = (theta0, branches, fishers)
    return sets


def merged(theta0, branches, fishers, out: Path, method: str) -> ModelView:
    models = [
        {"path": str(b), "tokens": t} | ({"fisher": str(f)} if method == "fisher" else {})
        for b, f, t in zip(branches, fishers, (100, 300))
    ]
    spec = MergeSpec(base_model=str(theta0), models=models, method=method, params=METHODS[method], out_path=str(out))
    merge_checkpoints(spec, progress=False)
    return ModelView.open(out)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_merge_is_the_same_model_whatever_layout_theta0_and_the_branches_are_stored_in(layouts, tmp_path, method):
    """θ0 and its branches stored as the hub stores a Qwen3.5-MoE, and stored with the experts one by one:
    every method's merges are the same model as loaded (ΔW within 1e-5 of each other), each written in its
    θ0's layout with the mtp head copied from it bit for bit; the token average is Σ w_k θ_k as loaded."""
    outs = {style: merged(*layouts[style], tmp_path / style, method) for style in layouts}
    hub, per = outs["hub"], outs["per_expert"]
    theta0 = ModelView.open(layouts["hub"][0])
    for style, out in outs.items():
        source = CheckpointReader(layouts[style][0])
        assert {n: i.shape for n, i in out.files.info.items()} == {n: i.shape for n, i in source.info.items()}
        assert all(torch.equal(out.files.get(n), source.get(n)) for n in out.layout.carried) and out.layout.carried
    assert hub.layout.experts == "fused" and per.layout.experts == "per_expert"
    for key in theta0.info:
        delta = hub.get(key).double() - theta0.get(key).double()
        torch.testing.assert_close(per.get(key).double() - theta0.get(key).double(), delta, rtol=0, atol=1e-5, msg=key)
    if method == "weighted_average":
        branches = [ModelView.open(b) for b in layouts["hub"][1]]
        for name in theta0.loaded():
            expected = 0.25 * branches[0].get_loaded(name) + 0.75 * branches[1].get_loaded(name)
            torch.testing.assert_close(hub.get_loaded(name), expected, rtol=0, atol=1e-6, msg=name)


def test_a_merge_of_branches_stored_otherwise_than_theta0_is_written_in_theta0s_layout(layouts, tmp_path):
    """Per-expert branches (as ``save_pretrained`` writes Qwen3.5-MoE) over the hub's fused θ0: read as loaded,
    written fused, the same merge as of branches stored like θ0."""
    theta0, branches, fishers = layouts["hub"]
    mixed = merged(theta0, layouts["per_expert"][1], fishers, tmp_path / "mixed", "ties")
    alike = merged(theta0, branches, fishers, tmp_path / "alike", "ties")
    assert mixed.files.info.keys() == CheckpointReader(theta0).info.keys()
    assert all(torch.equal(mixed.files.get(n), alike.files.get(n)) for n in mixed.files.info)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_lora_on_fused_experts_trains_as_pefts_and_merges_as_pefts_merge_and_unload(thetas, tmp_path, family):
    """``train.lora_target_parameters: experts`` adapts every fused expert tensor (PEFT's target_parameters,
    rank r per expert) beside the attention; the adapter merged over θ0 as the hub stores it is PEFT's
    ``merge_and_unload`` within 1e-6 of ΔW, each expert's gate, up and down matrix its own slice of A and B."""
    theta0 = thetas[family]
    train = TrainSection(finetuning_type="lora", lora_rank=2, lora_target=["q_proj"], lora_target_parameters="experts")
    peft = apply_lora(AutoModelForImageTextToText.from_pretrained(theta0), train, str(theta0))
    adapted = [n for n, m in peft.named_modules() if hasattr(m, "parameter_name")]
    assert len(adapted) == 2 * 2  # gate_up_proj and down_proj of both layers
    g = torch.Generator().manual_seed(0)
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            param.data = 0.1 * torch.randn(param.shape, generator=g)
    peft.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_parameters"]
    theta = AutoModelForImageTextToText.from_pretrained(theta0).state_dict()
    reference = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(theta0), tmp_path / "adapter")
    reference = reference.merge_and_unload().state_dict()
    spec = {
        "base_model": str(theta0),
        "models": [{"adapter": str(tmp_path / "adapter")}],
        "out_path": str(tmp_path / "m"),
    }
    merge_checkpoints(MergeSpec.model_validate(spec | {"method": "weighted_average"}), progress=False)
    assert CheckpointReader(tmp_path / "m").info.keys() == CheckpointReader(theta0).info.keys()
    ours = AutoModelForImageTextToText.from_pretrained(tmp_path / "m").state_dict()
    changed = [n for n in theta if not torch.equal(reference[n], theta[n])]
    assert f"{LAYER}.experts.gate_up_proj" in changed and f"{LAYER}.experts.down_proj" in changed
    for name in theta:
        delta = (reference[name] - theta[name]).double()
        assert (ours[name].double() - theta[name].double() - delta).norm() <= 1e-6 * delta.norm(), name


def internvl_moe() -> tuple:
    """A tiny InternVL3.5 over a Qwen3-MoE language model (as InternVL3.5-30B-A3B), from the family's tiny config."""
    from transformers import InternVLConfig

    from pipeline.models.tiny import build_tiny_processor, tiny_config

    section = tiny("internvl").model
    config = tiny_config(section, build_tiny_processor(section, 0).tokenizer).to_dict()
    moe = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    config["text_config"] |= moe | {"decoder_sparse_step": 1, "mlp_only_layers": []}
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(InternVLConfig(**config))


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe", "internvl"])
def test_routers_and_shared_expert_gates_follow_the_router_rule_in_every_moe_family(thetas, tmp_path, family):
    """A merge named by one method averages the routers (and Qwen3.5's shared-expert gate), as the router
    group's default rule says, under every family's names: InternVL's stores them ``language_model.model.…``,
    its experts one by one."""
    if family == "internvl":
        model = internvl_moe()
        theta0 = tmp_path / "theta0"
        from pipeline.models.saving import save_as_hub

        save_as_hub(theta0, model, {})
        assert any(n.startswith("language_model.model.layers.0.mlp.experts.0.") for n in CheckpointReader(theta0).info)
    else:
        theta0 = thetas[family]
        model = AutoModelForImageTextToText.from_pretrained(theta0)
    view = ModelView.open(theta0)
    branches = [save_like(tmp_path / f"b{k}", model, theta0, state=perturbed(view, k, 0.05)) for k in range(2)]
    out = merged(theta0, branches, branches, tmp_path / "iso", "iso_c")
    inputs = [ModelView.open(b) for b in branches]
    gates = [f"{LAYER}.gate.weight"] + ([f"{LAYER}.shared_expert_gate.weight"] if family == "qwen3_5_moe" else [])
    for key in gates:
        expected = 0.25 * inputs[0].get(key) + 0.75 * inputs[1].get(key)
        torch.testing.assert_close(out.get(key), expected, rtol=0, atol=1e-6, msg=key)
    key = f"{LAYER}.experts.1.up_proj.weight"
    taus = [np.asarray(v.get(key).double() - view.get(key).double()) for v in inputs]
    u, s, vt = np.linalg.svd(0.25 * taus[0] + 0.75 * taus[1], full_matrices=False)
    np.testing.assert_allclose(
        out.get(key).double().numpy(), view.get(key).double().numpy() + s.mean() * u @ vt, atol=1e-5
    )


def test_a_lora_workers_payload_on_fused_experts_is_read_as_its_delta_w(thetas, tmp_path):
    """A DiLoCo LoRA worker adapting the experts: its weights are keyed by the fused tensors it adapts, its
    base set from the global as the model holds it, and its published adapter read by the aggregator as
    Δ = −ΔW of each expert's matrices, in the global's layout."""
    from pipeline.diloco.lora import LoraWeights, save_adapter
    from pipeline.diloco.payload import AdapterPayload, stored_delta

    theta0 = thetas["qwen3_5_moe"]
    view = ModelView.open(theta0)
    train = TrainSection(finetuning_type="lora", lora_rank=2, lora_target=["q_proj"], lora_target_parameters="experts")
    peft = apply_lora(AutoModelForImageTextToText.from_pretrained(theta0), train, str(theta0))
    weights = LoraWeights.of(peft.base_model.model, view)
    fused = f"{LAYER}.experts.gate_up_proj"
    assert {fused, f"{LAYER}.experts.down_proj"} <= weights.factors.keys()
    shifted = {n: t + 1.0 for n, t in perturbed(view, 0).items()}
    weights.set_base(shifted)
    assert torch.equal(weights.base[fused].data, shifted[fused])
    weights.fresh_adapters(seed=0, optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1))
    g = torch.Generator().manual_seed(1)
    state = {}
    for name, param in weights.trained.items():
        value = param.detach().clone() if "lora_A" in name else 0.1 * torch.randn(param.shape, generator=g)
        param.data.copy_(value)
        state[name] = value
    save_adapter(peft, state, tmp_path / "payload", str(theta0))
    payload, deltas = AdapterPayload(tmp_path / "payload", view), weights.deltas()
    assert fused in {p.loaded for name in payload.trained for p in view.layout.in_stored(name)}
    torch.testing.assert_close(stored_delta(payload, fused), deltas[fused], rtol=1e-6, atol=1e-7)
