"""mergekit's YAML read by `merit merge`: its parameter rules (filters, gradients, precedence), what it
refuses and how it says so, and the tokenizer the output takes. Equality with mergekit's own outputs is
tested in test_merge_mergekit.py (the ``dev`` extra)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from merit.bench.merge import generate
from merit.cli import main as merit
from pipeline.merge.mergekit_config import Conditional, evaluate, read_config, run_config
from pipeline.merge.spec import MergeSpecError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[Path]]:
    """θ0 and two fine-tunes (a tiny Qwen2, fp32), each with a tokenizer file of its own."""
    base, models = generate(tmp_path_factory.mktemp("tiny"), 2, 0.5, "float32")
    for path in (base, *models):
        (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    return base, models


def write(folder: Path, data: dict) -> Path:
    path = folder / "merge.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def ties(base: Path, models: list[Path], **extra) -> dict:
    entries = [{"model": str(m), "parameters": {"weight": 1.0, "density": 0.5}} for m in models]
    return {"merge_method": "ties", "base_model": str(base), "models": entries, **extra}


def test_a_gradient_interpolates_over_the_layers_and_filters_pick_the_first_match():
    assert evaluate([0.0, 1.0], "x", 0.25) == 0.25
    assert evaluate([0.0, 0.5, 0.3, 0.7, 1.0], "x", 0.5) == 0.3
    assert evaluate([0.0, 0.5, 0.3, 0.7, 1.0], "x", 0.375) == pytest.approx(0.4)  # between 0.5 and 0.3
    assert evaluate(["a", "b", "c"], "x", 0.9) == "b"  # not numbers: a value is picked, never mixed
    setting = [Conditional(filter="self_attn", value=[0.0, 1.0]), Conditional(value=0.5)]
    assert evaluate(setting, "model.layers.3.self_attn.q_proj.weight", 1.0) == 1.0
    assert evaluate(setting, "model.layers.3.mlp.up_proj.weight", 1.0) == 0.5
    assert evaluate([Conditional(filter="mlp", value=1.0)], "model.norm.weight", 0.0) is None  # the next source's


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"modules": {}}, "'modules': merge per module is not supported"),
        ({"tokenizer": {"source": "base"}}, "write 'tokenizer_source"),
        ({"chat_template": "chatml"}, "'chat_template'"),
        ({"parameters": {"densty": 0.5}}, "parameters: ties takes no parameter ['densty']"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(extra, named, tiny, tmp_path):
    base, models = tiny
    with pytest.raises(MergeSpecError, match=named.replace("[", r"\[").replace("]", r"\]").replace("|", r"\|")):
        run_config(read_config(write(tmp_path, ties(base, models, **extra))), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_lora_reference_a_slice_base_and_unknown_keys_are_refused(tiny, tmp_path):
    base, models = tiny
    lora = ties(base, models)
    lora["models"][0]["model"] += "+adapters/one"
    with pytest.raises(MergeSpecError, match="write a merit merge spec with 'models: \\[{adapter"):
        read_config(write(tmp_path, lora))
    sliced = {"merge_method": "ties", "slices": [{"sources": [], "base_model": str(base)}]}
    with pytest.raises(MergeSpecError, match="give base_model once, at the top level"):
        read_config(write(tmp_path, sliced))
    with pytest.raises(MergeSpecError, match="merge_methd"):
        read_config(write(tmp_path, {**ties(base, models), "merge_methd": "ties"}))


def test_out_path_comes_from_the_command_line_where_the_file_has_none(tiny, tmp_path, capsys):
    base, models = tiny
    with pytest.raises(MergeSpecError, match="give --out-path"):
        run_config(read_config(write(tmp_path, ties(base, models))))
    merit(["merge", str(write(tmp_path, ties(base, models))), "--out-path", str(tmp_path / "out")])
    assert "into " + str(tmp_path / "out") in capsys.readouterr().out
    assert load_file(str(tmp_path / "out" / "model.safetensors"))


def test_slices_taking_different_layers_need_passthrough(tiny, tmp_path):
    base, models = tiny
    sources = [{"model": str(models[0]), "layer_range": [0, 1]}, {"model": str(models[1]), "layer_range": [1, 2]}]
    data = {"merge_method": "ties", "base_model": str(base), "slices": [{"sources": sources}]}
    with pytest.raises(MergeSpecError, match="write it with merge_method: passthrough"):
        run_config(read_config(write(tmp_path, data)), str(tmp_path / "out"))


def test_tokenizer_source_base_model_or_union(tiny, tmp_path):
    base, models = tiny
    (models[1] / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "c": 1}}}))
    try:
        with pytest.raises(MergeSpecError, match=f"tokenizers of \\['{models[1]}'\\] differ"):
            run_config(read_config(write(tmp_path, ties(base, models, tokenizer_source="union"))), str(tmp_path / "u"))
        run_config(
            read_config(write(tmp_path, ties(base, models, tokenizer_source=str(models[1])))), str(tmp_path / "m")
        )
        assert (tmp_path / "m" / "tokenizer.json").read_text() == (models[1] / "tokenizer.json").read_text()
        run_config(read_config(write(tmp_path, ties(base, models))), str(tmp_path / "b"))
        assert (tmp_path / "b" / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    finally:
        (models[1] / "tokenizer.json").write_text((base / "tokenizer.json").read_text())


def test_per_model_density_trims_each_task_vector_to_its_own_share(tiny, tmp_path):
    """TIES with densities 0.1 and 0.9 against both at 0.5: the merged τ differs, and where the second
    model's sign wins alone it keeps 90 % of its entries."""
    base, models = tiny
    uneven = ties(base, models)
    for entry, density in zip(uneven["models"], (0.1, 0.9)):
        entry["parameters"]["density"] = density
    run_config(read_config(write(tmp_path, uneven)), str(tmp_path / "uneven"))
    run_config(read_config(write(tmp_path, ties(base, models))), str(tmp_path / "even"))
    name = "model.layers.0.mlp.up_proj.weight"
    theta0 = load_file(str(base / "model.safetensors"))[name]
    merged = {k: load_file(str(tmp_path / k / "model.safetensors"))[name] - theta0 for k in ("uneven", "even")}
    assert not torch.allclose(merged["uneven"], merged["even"])
    assert (merged["uneven"] != 0).float().mean() > (merged["even"] != 0).float().mean()
