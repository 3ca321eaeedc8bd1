"""Every LoRA adapter PEFT 0.21 writes for Qwen2.5-VL merges as PEFT merges it, or is refused by name.

Each row of the matrix saves two adapters with PEFT (ranks 2 and 3, alphas 5 and 7 unless the row says
otherwise, every trained tensor random) on a tiny Qwen2.5-VL with tied embeddings, and merges them with
``merge_checkpoints`` (what ``merit merge`` runs), token-weighted 1 : 2. The result must be Σ_k w_k W_k, W_k
PEFT's ``merge_and_unload`` of adapter k on θ0: the same tensors (lm_head written where PEFT unties it, with
``tie_word_embeddings`` as PEFT leaves it), θ0's tensors bit for bit where no W_k changes them, and elsewhere
ΔW within 1e-6 of PEFT's. What cannot be merged as ΔW over θ0 is refused with the option's name. The rows whose
merge can be an adapter are also written as one (``out_format: adapter``), which PEFT must load as the same model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, VeloraConfig, get_peft_model
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from pipeline.diloco.payload import AdapterPayload, stored_delta
from pipeline.merge import CheckpointReader, MergeSpec, ModelView, merge_checkpoints
from pipeline.merge.adapter import AdapterError, pattern_key
from pipeline.models.adapter import merge_adapter

pytestmark = pytest.mark.filterwarnings("ignore")  # PEFT's warnings about tied layers and tiny ranks

WEIGHTS = (1 / 3, 2 / 3)  # tokens 100 and 200
RANKS = ({"r": 2, "lora_alpha": 5}, {"r": 3, "lora_alpha": 7})
EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
TARGETS = ["q_proj", "v_proj", "o_proj", "qkv"]  # the language model's and the vision blocks' attention
TOLERANCE = 1e-6  # relative to ΔW: fp32 rounding of θ0 + ΔW is ~1e-7 of it, as the factors are scaled here


def tiny_model(tied: bool) -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(0)
    text = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
        "tie_word_embeddings": tied,
    }
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
    vision["fullatt_block_indexes"] = [0]
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def thetas(tmp_path_factory) -> dict[str, Path]:
    """θ0 tied (lm_head stored once, as transformers saves it) and an untied twin."""
    root = tmp_path_factory.mktemp("theta0")
    for kind in ("tied", "untied"):
        tiny_model(kind == "tied").save_pretrained(root / kind)
    return {kind: root / kind for kind in ("tied", "untied")}


def load_theta0(base: Path) -> Qwen2_5_VLForConditionalGeneration:
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(base).eval()


def randomize(model, seed: int) -> None:
    """Every trained tensor random, large enough that ΔW dominates θ0's entries (PEFT's DoRA magnitudes
    kept near the weight norms they start from)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(param * (1 + 0.1 * noise) if "magnitude" in name else 0.3 * noise)


def edit_config(folder: Path, **fields) -> None:
    """Hand-edit a saved adapter's config (fields PEFT would need data, scipy or GPTQ to write)."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))


@dataclass
class Row:
    """Two adapters' LoraConfig options (RANKS added where not given) and how they are saved."""

    options: tuple[dict, dict]
    base: str = "tied"
    convert: bool = False  # PiSSA / OLoRA: saved converted to an adapter over θ0
    edits: tuple[dict, dict] = field(default_factory=lambda: ({}, {}))  # adapter_config.json fields (... deletes)


def row(*options: dict, **kwargs) -> Row:
    return Row(tuple(RANKS[k] | o for k, o in enumerate(options)), **kwargs)


ROWS = {
    "plain": row({"target_modules": TARGETS}, {"target_modules": [*TARGETS, "up_proj", "down_proj"]}),
    "rslora": row({"target_modules": TARGETS, "use_rslora": True}, {"target_modules": TARGETS}),
    "patterns": row(
        {"target_modules": TARGETS, "alpha_pattern": {"q_proj|v_proj": 3}},
        {"target_modules": TARGETS, "rank_pattern": {r"layers\.0\.self_attn\.q_proj": 4}, "use_rslora": True},
        edits=({"lora_alpha": ...}, {}),  # a config without lora_alpha: PEFT's default 8
    ),
    "lora_bias": row(
        {"target_modules": ["q_proj", "qkv"], "lora_bias": True},
        {"target_modules": ["q_proj", "v_proj"], "lora_bias": True},
    ),
    "fan_in_fan_out": row({"target_modules": TARGETS, "fan_in_fan_out": True}, {"target_modules": TARGETS}),
    "modules_to_save": row({"target_modules": TARGETS}, {"target_modules": TARGETS, "modules_to_save": ["merger"]}),
    "bias": row({"target_modules": ["q_proj"], "bias": "all"}, {"target_modules": TARGETS, "bias": "lora_only"}),
    "untie": row({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, {"target_modules": TARGETS}),
    "untie_and_tied_lm_head": row(
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, {"target_modules": ["lm_head", "q_proj"]}
    ),
    "untie_by_embedding": row(
        {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]}, {"target_modules": ["q_proj"]}
    ),
    "ensure_weight_tying": row(
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"], "ensure_weight_tying": True},
        {"target_modules": ["v_proj"], "modules_to_save": ["lm_head"], "ensure_weight_tying": True},
    ),
    "lm_head_lora_tied": row({"target_modules": ["lm_head", "q_proj"]}, {"target_modules": ["lm_head"]}),
    "lm_head_untied_theta0": row(
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, {"target_modules": ["lm_head"]}, base="untied"
    ),
    "embedding": row({"target_modules": ["embed_tokens", "q_proj"]}, {"target_modules": ["embed_tokens"]}),
    "conv3d": row({"target_modules": ["patch_embed.proj"]}, {"target_modules": ["patch_embed.proj", "qkv"]}),
    "trainable_tokens": row(
        {"target_modules": ["q_proj"], "trainable_token_indices": [1, 5]},
        {"target_modules": ["v_proj"], "trainable_token_indices": {"embed_tokens": [5, 9]}},
    ),
    "target_parameters": row(
        {"target_modules": [], "target_parameters": ["q_proj.weight"]}, {"target_modules": ["q_proj", "v_proj"]}
    ),
    "pissa_converted": row(
        {"target_modules": TARGETS, "init_lora_weights": "pissa"},
        {"target_modules": TARGETS, "init_lora_weights": "pissa_niter_4"},
        convert=True,
    ),
    "olora_converted": row(
        {"target_modules": TARGETS, "init_lora_weights": "olora"},
        {"target_modules": ["q_proj"], "init_lora_weights": "olora"},
        convert=True,
    ),
    "inits": row(  # orthogonal (even rank) and MiCA draw A and B from θ0 but do not change it
        {"target_modules": TARGETS, "init_lora_weights": "orthogonal", "r": 2},
        {"target_modules": TARGETS, "init_lora_weights": "mica"},
    ),
    "velora": row({"target_modules": TARGETS, "velora_config": VeloraConfig()}, {"target_modules": TARGETS}),
    "mixed": row(
        {"target_modules": TARGETS},
        {"target_modules": ["q_proj", "qkv"], "use_rslora": True, "lora_bias": True, "modules_to_save": ["merger"]},
    ),
}
# Written as an adapter too; the others are refused there (WRITTEN_AS_MODEL_ONLY) or not adapters over θ0
AS_ADAPTER = ["plain", "rslora", "patterns", "lora_bias", "fan_in_fan_out", "modules_to_save", "bias", "untie"]
AS_ADAPTER += ["lm_head_lora_tied", "target_parameters", "pissa_converted", "inits", "mixed"]
WRITTEN_AS_MODEL_ONLY = {
    "untie_and_tied_lm_head": r"\['lm_head'\] both saved whole and adapted",
    "ensure_weight_tying": "saves the tied embedding model.language_model.embed_tokens.weight whole",
    "embedding": "adapts model.language_model.embed_tokens, an embedding",
    "conv3d": "adapts model.visual.patch_embed.proj, a conv",
    "trainable_tokens": "replaces rows of model.language_model.embed_tokens.weight",
}


def save_adapter(folder: Path, base: Path, options: dict, seed: int, convert: bool) -> Path:
    peft = get_peft_model(load_theta0(base), LoraConfig(**options))
    if convert:
        peft.save_pretrained(folder.with_name(folder.name + "-initial"))
    randomize(peft, seed)
    initial = {"path_initial_model_for_weight_conversion": str(folder.with_name(folder.name + "-initial"))}
    peft.save_pretrained(folder, **(initial if convert else {}))
    return folder


def peft_merged(base: Path, adapter: Path, out: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """PEFT's merge_and_unload of an adapter on θ0, as saved (checkpoint names), and whether it is tied."""
    PeftModel.from_pretrained(load_theta0(base), adapter).merge_and_unload().save_pretrained(out)
    return load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())["tie_word_embeddings"]


@dataclass
class Built:
    base: Path
    adapters: list[Path]
    references: list[dict[str, torch.Tensor]]  # PEFT's merged models
    tied: bool  # whether PEFT leaves every merged model tied


@pytest.fixture(scope="module")
def built(thetas, tmp_path_factory):
    """The adapters of a row and PEFT's merged models, built once per module."""
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            spec, root = ROWS[name], tmp_path_factory.mktemp(name)
            base, adapters, references, tied = thetas[spec.base], [], [], True
            for k, (options, edits) in enumerate(zip(spec.options, spec.edits)):
                adapter = save_adapter(root / f"adapter{k}", base, options, seed=k, convert=spec.convert)
                edit_config(adapter, **edits)
                reference, tied_k = peft_merged(base, adapter, root / f"peft{k}")
                adapters.append(adapter)
                references.append(reference)
                tied &= tied_k
            cache[name] = Built(base, adapters, references, tied)
        return cache[name]

    return get


def merge(base: Path, adapters: list[Path], out: Path, **fields) -> Path:
    models = [{"adapter": str(a), "tokens": 100 * (k + 1)} for k, a in enumerate(adapters)]
    spec = {"base_model": str(base), "models": models, "method": "weighted_average", "out_path": str(out)}
    merge_checkpoints(MergeSpec.model_validate(spec | fields), progress=False)
    return out


def read(folder: Path) -> tuple[dict[str, torch.Tensor], bool]:
    reader = CheckpointReader(folder)
    return {n: reader.get(n) for n in reader.info}, json.loads((folder / "config.json").read_text())[
        "tie_word_embeddings"
    ]


def assert_merges_as(ours: dict[str, torch.Tensor], references: list[dict[str, torch.Tensor]], theta0: dict) -> None:
    """``ours`` is Σ_k w_k W_k: θ0's tensor bit for bit where every W_k is θ0's, else ΔW within TOLERANCE of
    Σ_k w_k (W_k − θ0) (a tied W_k's lm_head is its embedding)."""
    assert ours.keys() == set().union(*references)
    for name, tensor in ours.items():
        base = theta0.get(name, theta0[EMBEDDING]).double()
        models = [ref.get(name, ref[EMBEDDING]).double() for ref in references]
        if all(torch.equal(m, base) for m in models):
            assert torch.equal(tensor.double(), base), name
            continue
        expected = sum(w * (m - base) for w, m in zip(WEIGHTS, models))
        atol = TOLERANCE * expected.abs().max().item()
        torch.testing.assert_close(tensor.double() - base, expected, rtol=TOLERANCE, atol=atol, msg=name)


@pytest.mark.parametrize("name", list(ROWS))
def test_a_merge_of_two_adapters_is_the_weighted_sum_of_pefts_merged_models(built, tmp_path, name):
    case = built(name)
    ours, tied = read(merge(case.base, case.adapters, tmp_path / "merged"))
    assert_merges_as(ours, case.references, load_file(case.base / "model.safetensors"))
    assert tied == case.tied


@pytest.mark.parametrize("name", AS_ADAPTER)
def test_a_merge_written_as_an_adapter_loads_in_peft_as_the_merged_model(built, tmp_path, name):
    """PEFT's load of the written adapter (its config reset: no inherited initialisation or variant) is the
    dense merge: ΔW within TOLERANCE, the tie as the dense merge leaves it."""
    case = built(name)
    dense, tied = read(merge(case.base, case.adapters, tmp_path / "dense"))
    adapter = merge(case.base, case.adapters, tmp_path / "adapter", out_format="adapter")
    theirs, theirs_tied = peft_merged(case.base, adapter, tmp_path / "peft")
    assert_merges_as(theirs, [dense, dense], load_file(case.base / "model.safetensors"))
    assert theirs_tied == tied


@pytest.mark.parametrize("name", list(WRITTEN_AS_MODEL_ONLY))
def test_what_an_adapter_cannot_hold_is_refused_as_an_adapter_output(built, tmp_path, name):
    case = built(name)
    with pytest.raises(AdapterError, match=f"out_format adapter: .*{WRITTEN_AS_MODEL_ONLY[name]}"):
        merge(case.base, case.adapters, tmp_path / "adapter", out_format="adapter")
    assert not (tmp_path / "adapter").exists()


CONVERT_HINT = r"path_initial_model_for_weight_conversion"
# adapter_config.json edits, or LoraConfig options PEFT saves itself -> the refusal's message
REFUSED = {
    "dora": ({"use_dora": True}, "use_dora is set: DoRA rescales every row"),
    "pissa": ({"init_lora_weights": "pissa"}, f"init_lora_weights 'pissa': PiSSA .*{CONVERT_HINT}"),
    "olora": ({"init_lora_weights": "olora"}, f"init_lora_weights 'olora': OLoRA .*{CONVERT_HINT}"),
    "lora_bias_without_bias": (
        {"lora_bias": True, "target_modules": ["o_proj"]},
        r"lora_bias on model.language_model.layers.0.self_attn.o_proj, whose θ0 module has no bias",
    ),
}
REFUSED_BY_EDIT = {
    "corda": ({"init_lora_weights": "corda"}, f"init_lora_weights 'corda': CorDA .*{CONVERT_HINT}"),
    "lora_ga": ({"init_lora_weights": "lora_ga"}, f"init_lora_weights 'lora_ga': LoRA-GA .*{CONVERT_HINT}"),
    "loftq": ({"init_lora_weights": "loftq"}, "init_lora_weights 'loftq': LoftQ .* cannot convert"),
    "kasa": ({"kasa_config": {"beta": 1e-4}}, "kasa_config is set: KaSA"),
    "bdlora": ({"use_bdlora": {"nblocks": 2}}, "use_bdlora is set: BD-LoRA"),
    "arrow": ({"arrow_config": {"top_k": 2}}, "arrow_config is set: Arrow"),
    "alora": ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens is set: aLoRA"),
    "qalora": ({"use_qalora": True}, "use_qalora is set: QA-LoRA"),
    "layer_replication": ({"layer_replication": [[0, 1], [0, 1]]}, "layer_replication is set"),
    "target_parameters_other": (
        {"target_parameters": ["mlp.experts.gate_up_bias"]},
        r"target_parameters \['mlp.experts.gate_up_bias'\]: only 2-D .weight parameters and fused experts",
    ),
}


@pytest.fixture(scope="module")
def plain(built) -> Built:
    return built("plain")


@pytest.mark.parametrize("name", list(REFUSED))
def test_adapters_that_are_not_delta_w_over_theta0_are_refused_by_name(plain, tmp_path, name):
    options, message = REFUSED[name]
    refused = save_adapter(tmp_path / name, plain.base, {"target_modules": ["q_proj"]} | RANKS[1] | options, 1, False)
    with pytest.raises(AdapterError, match=f"{refused}.*{message}"):
        merge(plain.base, [plain.adapters[0], refused], tmp_path / "merged")


@pytest.mark.parametrize("name", list(REFUSED_BY_EDIT))
def test_options_peft_cannot_merge_or_convert_are_refused_by_name(plain, tmp_path, name):
    fields, message = REFUSED_BY_EDIT[name]
    refused = shutil.copytree(plain.adapters[1], tmp_path / name)
    edit_config(refused, **fields)
    with pytest.raises(AdapterError, match=f"{refused}.*{message}"):
        merge(plain.base, [plain.adapters[0], refused], tmp_path / "merged")


def test_nested_target_parameters_and_a_rank_the_config_does_not_give_are_refused(plain, tmp_path):
    nested = shutil.copytree(plain.adapters[1], tmp_path / "nested")
    stored = load_file(nested / "adapter_model.safetensors")
    save_file(
        {k.replace("q_proj.lora_", "q_proj.base_layer.lora_"): v for k, v in stored.items()},
        nested / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterError, match="q_proj.base_layer.lora_A.weight: nested target_parameters"):
        merge(plain.base, [nested], tmp_path / "merged")
    ranked = shutil.copytree(plain.adapters[1], tmp_path / "ranked")
    edit_config(ranked, rank_pattern={"v_proj": 4})
    with pytest.raises(AdapterError, match=r"v_proj.lora_A.weight has rank 3, but .* rank_pattern\['v_proj'\] 4"):
        merge(plain.base, [ranked], tmp_path / "merged")


def test_pattern_matching_is_pefts():
    patterns = {r"q_proj|v_proj": 1, r"layers\.0\.self_attn\.o_proj": 2, "proj": 3}
    for module in ["model.language_model.layers.0.self_attn.v_proj", "model.visual.blocks.0.attn.proj", "a.qkv"]:
        theirs = get_pattern_key(patterns, module)
        assert pattern_key(patterns, module) == (theirs if theirs in patterns else None), module


def test_an_adapter_in_the_transformers_4_layout_merges_the_same_here_and_in_pefts_evaluation(plain, tmp_path):
    """Keys named as the checkpoint names the tensors (``model.layers…``, ``visual.…``): the merge library and
    ``models.adapter.merge_adapter`` (PEFT, with the key mapping) read it as the adapter it was saved from."""
    old = shutil.copytree(plain.adapters[1], tmp_path / "old")
    stored = load_file(old / "adapter_model.safetensors")
    renamed = {
        k.replace("model.model.language_model.", "model.model.").replace("model.model.visual.", "model.visual."): v
        for k, v in stored.items()
    }
    assert renamed.keys() != stored.keys()
    save_file(renamed, old / "adapter_model.safetensors")
    ours, _ = read(merge(plain.base, [plain.adapters[0], old], tmp_path / "old-merged"))
    assert_merges_as(ours, plain.references, load_file(plain.base / "model.safetensors"))
    theirs = merge_adapter(load_theta0(plain.base), old).state_dict()
    expected = PeftModel.from_pretrained(load_theta0(plain.base), plain.adapters[1]).merge_and_unload().state_dict()
    assert all(torch.equal(theirs[n], expected[n]) for n in expected)


def test_pefts_evaluation_merges_dora(plain, tmp_path):
    """``models.adapter.merge_adapter`` leaves DoRA to PEFT (a whole model in memory): no longer refused."""
    dora = save_adapter(tmp_path / "dora", plain.base, {"target_modules": ["q_proj"], "use_dora": True}, 1, False)
    merged = merge_adapter(load_theta0(plain.base), dora).state_dict()
    theta0 = load_theta0(plain.base).state_dict()
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[name], theta0[name])


def test_dilocos_payload_reader_is_the_same_adapter_reader(plain, tmp_path):
    """A LoRA worker's payload is read as Δ = θ − θ_k = −τ, the adapter's τ of the merge."""
    payload = AdapterPayload(plain.adapters[1], ModelView.open(plain.base))
    reference, theta0 = plain.references[1], load_file(plain.base / "model.safetensors")
    assert set(payload.trained) == {n for n in theta0 if not torch.equal(reference[n], theta0[n])}
    for name in payload.trained:
        delta = stored_delta(payload, name)
        expected = (theta0[name] - reference[name]).double()
        atol = TOLERANCE * expected.abs().max().item()
        torch.testing.assert_close(delta.double(), expected, rtol=TOLERANCE, atol=atol, msg=name)
