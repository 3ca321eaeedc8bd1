"""LoRA adapters as merge inputs and outputs, on the tiny model: every method combines ΔW = s·B A
(the same result as on the full checkpoints θ0 + ΔW_k), and a merge written as an adapter is
PEFT's own ``cat`` for the linear methods."""

import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from pipeline.checkpoint import verify_checkpoint
from pipeline.config import load_config
from pipeline.data import Collator, Encoder, load_split, prepare_data
from pipeline.merge import CheckpointReader, MergeInputError, MergeSpec, merge_checkpoints
from pipeline.merge.adapter import AdapterError
from pipeline.models import init_model, load_model, processor_for

ATTENTION = ["q_proj", "v_proj", "o_proj", "qkv"]  # the language model's and the vision blocks'
# Ranks, alphas and scaling rules all differ, so a mix-up of the adapters' scalings cannot pass: the first
# has a v_proj rank and a q_proj / qkv alpha of their own (PEFT's patterns, the key's alternation grouped),
# the second rsLoRA (alpha / √r). The first is not rsLoRA: PEFT's ``cat`` takes its scaling rule.
LORAS = (
    {"r": 2, "lora_alpha": 5, "rank_pattern": {"self_attn.v_proj": 3}, "alpha_pattern": {"q_proj|qkv": 3}},
    {"r": 4, "lora_alpha": 5, "use_rslora": True},
    {"r": 3, "lora_alpha": 7},
)
Q_PROJ_SCALING = (3 / 2, 5 / 4**0.5, 7 / 3)  # alpha / r of each adapter's q_proj, by hand


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """θ0 (with a little prepared data), three LoRA adapters of different ranks, alphas, scaling rules
    and targets (random B, so ΔW ≠ 0; the third also saves the projector whole), and the same three as
    full checkpoints θ0 + ΔW_k, merged by PEFT."""
    root = tmp_path_factory.mktemp("adapters")
    cfg, run_dir = load_config(None, ["data.builtin.examples_per_source=4"]), root / "run"
    init_model(cfg, run_dir)
    prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    init = run_dir / "init"
    processor = AutoProcessor.from_pretrained(init)
    folders, fulls = [], []
    for k, options in enumerate(LORAS):
        model = AutoModelForImageTextToText.from_pretrained(init)
        lora = LoraConfig(
            **options,
            target_modules=ATTENTION if k != 1 else ["up_proj", "down_proj", "q_proj"],
            modules_to_save=["merger"] if k == 2 else None,
            base_model_name_or_path=str(init),
        )
        peft = get_peft_model(model, lora)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for param in peft.parameters():
                if param.requires_grad:
                    param.copy_(0.05 * torch.randn(param.shape, generator=g))
        folder = root / f"adapter{k}"
        peft.save_pretrained(folder)
        processor.save_pretrained(folder)
        full = root / f"full{k}"
        PeftModel.from_pretrained(
            AutoModelForImageTextToText.from_pretrained(init), folder
        ).merge_and_unload().save_pretrained(full)
        processor.save_pretrained(full)
        folders.append(folder)
        fulls.append(full)
    return cfg, run_dir, init, folders, fulls


def spec(tmp_path, init, entries, name="merged", **fields) -> MergeSpec:
    models = [{kind: str(path), "tokens": 100 * (i + 1)} for i, (kind, path) in enumerate(entries)]
    data = {"base_model": str(init), "models": models, "method": "weighted_average", "out_path": str(tmp_path / name)}
    return MergeSpec.model_validate(data | fields)


def tensors(path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {name: reader.get(name) for name in reader.info}


def biggest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


METHODS = [
    ("weighted_average", {}),
    ("task_arithmetic", {"scale": 0.7}),
    ("ties", {"density": 0.3}),
    ("dare", {"density": 0.5}),
    ("tsv", {}),
    ("iso_c", {}),
    ("iso_cts", {}),
    ("breadcrumbs_ties", {"density": 0.8, "gamma": 0.05}),
    ("della", {"density": 0.7, "epsilon": 0.1}),
    ("della_linear", {"density": 0.6, "epsilon": 0.2}),
    ("dare_ties", {"density": 0.6}),
    ("dare_linear", {"density": 0.5}),
    ("breadcrumbs", {"density": 0.8, "gamma": 0.05}),
    ("fisher", {}),
    ("sce", {"select_topk": 0.5}),
    ("multislerp", {}),
    ("karcher", {}),
    ("model_stock", {"filter_wise": True}),
    ("nuslerp", {}),
    ("slerp", {}),
]
TWO_INPUTS = {"nuslerp", "slerp"}


def test_every_registered_method_is_in_the_adapter_comparison():
    from pipeline.merge.registry import METHODS as REGISTERED

    assert {method.name for method in REGISTERED.values()} == {m for m, _ in METHODS}


def fisher_files(init, k: int, folder) -> list[str]:
    """Diagonal Fisher values, random and positive, for every matrix of θ0 (as ``pipeline.fisher`` estimates
    them on LoRA branches: the dense weights), one file per model: the same file beside an adapter and
    beside its full checkpoint."""
    g = torch.Generator().manual_seed(7)
    matrices = {n: t for n, t in tensors(init).items() if t.ndim == 2 and t.is_floating_point()}
    paths = []
    for i in range(k):
        path = folder / str(i)
        path.mkdir(parents=True)
        save_file({n: torch.rand(t.shape, generator=g) for n, t in matrices.items()}, str(path / "model.safetensors"))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("method, params", METHODS, ids=[m for m, _ in METHODS])
def test_every_method_merges_adapters_as_it_merges_their_full_checkpoints(adapters, tmp_path, method, params):
    _, _, init, folders, fulls = adapters
    if method in TWO_INPUTS:
        folders, fulls = folders[:2], fulls[:2]
    fields = {"method": method, "params": params}
    for kind, inputs, name in (("adapter", folders, "a"), ("path", fulls, "f")):
        models = spec(tmp_path, init, [(kind, f) for f in inputs], name).model_dump()["models"]
        if method == "fisher":  # Fisher values differ per model and tensor, so the weights differ per entry
            for entry, fisher in zip(models, fisher_files(init, len(inputs), tmp_path / f"fisher-{name}")):
                entry["fisher"] = fisher
        merge_checkpoints(spec(tmp_path, init, [], name, models=models, **fields), progress=False)
    ours, reference = tensors(tmp_path / "a"), tensors(tmp_path / "f")
    assert biggest_difference(ours, reference) <= 1e-5
    theta0 = tensors(init)
    untouched = [n for n in theta0 if "k_proj" in n or "gate_proj" in n or "norm" in n]
    assert untouched and all(torch.equal(ours[n], theta0[n]) for n in untouched)  # τ = 0 there, θ0 copied
    if method == "fisher":  # the Fisher values weigh the entries: not the plain weighted average
        merge_checkpoints(spec(tmp_path, init, [("adapter", f) for f in folders], "w"), progress=False)
        name = "model.layers.0.self_attn.q_proj.weight"
        assert (ours[name] - tensors(tmp_path / "w")[name]).abs().max() > 1e-4


def test_weighted_average_of_adapters_is_theta0_plus_the_weighted_sum_of_scaled_b_a(adapters, tmp_path):
    _, _, init, folders, _ = adapters
    merge_checkpoints(spec(tmp_path, init, [("adapter", f) for f in folders]), progress=False)
    merged, theta0 = tensors(tmp_path / "merged"), tensors(init)
    weights = torch.tensor([100.0, 200.0, 300.0]) / 600
    name, module = "model.layers.0.self_attn.q_proj.weight", "model.language_model.layers.0.self_attn.q_proj"
    expected = theta0[name].clone()
    for folder, w, scaling in zip(folders, weights, Q_PROJ_SCALING):
        stored = load_file(folder / "adapter_model.safetensors")
        a, b = (stored[f"base_model.model.{module}.lora_{x}.weight"] for x in "AB")
        expected += w * scaling * (b @ a)
    assert (merged[name] - expected).abs().max() <= 1e-6
    # The projector, saved whole by the third adapter only: τ_3 there, 0 for the others.
    whole = load_file(folders[2] / "adapter_model.safetensors")["base_model.model.model.visual.merger.ln_q.weight"]
    name = "visual.merger.ln_q.weight"
    assert (merged[name] - (theta0[name] + weights[2] * (whole - theta0[name]))).abs().max() <= 1e-6
    assert merged.keys() == theta0.keys()


def test_mixed_inputs_an_adapter_and_a_full_checkpoint(adapters, tmp_path):
    _, _, init, folders, fulls = adapters
    fields = {"method": "ties", "params": {"density": 0.3}}
    merge_checkpoints(
        spec(tmp_path, init, [("adapter", folders[0]), ("path", fulls[1])], "m", **fields), progress=False
    )
    merge_checkpoints(spec(tmp_path, init, [("path", fulls[0]), ("path", fulls[1])], "f", **fields), progress=False)
    assert biggest_difference(tensors(tmp_path / "m"), tensors(tmp_path / "f")) <= 1e-5


def heldout_batch(cfg, run_dir, processor):
    examples = [ex for exs in load_split(cfg, run_dir, "heldout").values() for ex in exs][:4]
    return Collator(processor.tokenizer.pad_token_id)(Encoder(processor, cfg.data.max_length).encode_batch(examples))


def test_an_adapter_merged_as_an_adapter_is_pefts_cat_and_its_model_pefts_merged_model(adapters, tmp_path):
    cfg, run_dir, init, folders, _ = adapters
    two = folders[:2]  # PEFT refuses weighted adapters when one of them saves a module whole
    merge_checkpoints(spec(tmp_path, init, [("adapter", f) for f in two], out_format="adapter"), progress=False)
    out = tmp_path / "merged"
    manifest = verify_checkpoint(out)
    assert manifest["format"] == "adapter" and set(manifest["truncation_error"].values()) == {0.0}
    config = json.loads((out / "adapter_config.json").read_text())
    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(init), two[0], adapter_name="a0")
    peft.load_adapter(two[1], adapter_name="a1")
    peft.add_weighted_adapter(["a0", "a1"], [1 / 3, 2 / 3], "cat", combination_type="cat")
    ours = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(init), out, adapter_name="ours")
    compared = 0
    for name, module in peft.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "cat" in module.lora_A:
            theirs = module.get_delta_weight("cat")
            mine = ours.base_model.model.get_submodule(name).get_delta_weight("ours")
            assert (theirs - mine).abs().max() <= 1e-6, name
            compared += 1
    assert compared == len(config["target_modules"]) > 0
    processor = AutoProcessor.from_pretrained(out)  # the processor files travel with the adapter
    batch = heldout_batch(cfg, run_dir, processor)
    peft.set_adapter("cat")
    with torch.no_grad():
        theirs = peft.merge_and_unload(adapter_names=["cat"]).eval()(**batch).logits
        mine = load_model(out, cfg.model).eval()(**batch).logits
    assert (theirs - mine).abs().max() <= 1e-5


NONLINEAR = {
    "ties": {"density": 0.3},
    "breadcrumbs_ties": {"density": 0.8, "gamma": 0.05},
    "della": {"density": 0.7, "epsilon": 0.1},
    "sce": {"select_topk": 0.5},
    "model_stock": {},
    "multislerp": {},
    "karcher": {},
}


@pytest.mark.parametrize("method", list(NONLINEAR))
def test_a_nonlinear_merge_written_as_an_adapter_is_its_delta_w_truncated_by_svd(adapters, tmp_path, method):
    """Every method that is not linear in the inputs reaches ``out_format: adapter`` through its merged
    ΔW: at full rank the adapter loads as the model the same merge writes (random masks included:
    the same seed and tensor names draw the same ones); at rank 2 the error is recorded."""
    cfg, _, init, folders, _ = adapters
    entries = [("adapter", f) for f in folders]
    fields = {"method": method, "params": NONLINEAR[method]}
    merge_checkpoints(spec(tmp_path, init, entries, "model", **fields), progress=False)
    merge_checkpoints(
        spec(tmp_path, init, entries, "full", **fields, out_format="adapter", adapter_rank=512), progress=False
    )
    full = verify_checkpoint(tmp_path / "full")
    assert max(full["truncation_error"].values()) <= 1e-5  # every singular value kept: exact
    as_model = load_model(tmp_path / "full", cfg.model).state_dict()
    reference = AutoModelForImageTextToText.from_pretrained(tmp_path / "model").state_dict()
    assert biggest_difference(as_model, reference) <= 1e-5
    assert json.loads((tmp_path / "full" / "adapter_config.json").read_text())["modules_to_save"] == ["merger"]
    if method == "ties":
        merge_checkpoints(
            spec(tmp_path, init, entries, "low", **fields, out_format="adapter", adapter_rank=2), progress=False
        )
        assert min(verify_checkpoint(tmp_path / "low")["truncation_error"].values()) > 0.05  # not of rank 2


def test_bad_adapters_and_specs_are_named(adapters, tmp_path):
    _, _, init, folders, fulls = adapters
    with pytest.raises(ValueError, match="out_format adapter needs every model to be an adapter"):
        spec(tmp_path, init, [("adapter", folders[0]), ("path", fulls[1])], out_format="adapter")
    with pytest.raises(
        ValueError, match=r"out_format adapter: the merged ΔW of \['ties'\] is not low-rank; give adapter_rank"
    ):
        spec(tmp_path, init, [("adapter", f) for f in folders], method="ties", out_format="adapter")
    with pytest.raises(ValueError, match="adapters need base_model"):
        MergeSpec.model_validate(
            {"models": [{"adapter": str(folders[0])}], "method": "weighted_average", "out_path": "x"}
        )
    with pytest.raises(ValueError, match="give path or adapter, not both"):
        spec(tmp_path, init, [("path", fulls[0])], models=[{"path": "a", "adapter": "b"}])
    pickled = tmp_path / "pickled"
    shutil.copytree(folders[0], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match=f"{pickled}: no adapter_model.safetensors .*never pickle"):
        merge_checkpoints(spec(tmp_path, init, [("adapter", pickled)]), progress=False)
    wrong = tmp_path / "wrong"
    shutil.copytree(folders[0], wrong)
    stored = load_file(wrong / "adapter_model.safetensors")
    key = next(k for k in stored if k.endswith("layers.0.self_attn.q_proj.lora_A.weight"))
    stored[key] = torch.zeros(stored[key].shape[0], 7)
    save_file(stored, wrong / "adapter_model.safetensors")
    with pytest.raises(
        MergeInputError, match=r"LoRA factors of model.language_model.layers.0.self_attn.q_proj.weight are A \(2, 7\)"
    ):
        merge_checkpoints(spec(tmp_path, init, [("adapter", wrong)]), progress=False)
    stored = load_file(folders[0] / "adapter_model.safetensors")
    stored = {k.replace("layers.0.", "layers.9."): v for k, v in stored.items()}
    save_file(stored, wrong / "adapter_model.safetensors")
    with pytest.raises(
        MergeInputError,
        match=r"adapts model.language_model.layers.9.self_attn.o_proj.weight, which θ0 .* does not have",
    ):
        merge_checkpoints(spec(tmp_path, init, [("adapter", wrong)]), progress=False)
    assert not (tmp_path / "merged").exists()
