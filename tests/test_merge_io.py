"""The streaming driver on tiny Qwen2.5-VL checkpoints on disk, and every refusal."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from merit.cli import main as merit
from pipeline.checkpoint import verify_checkpoint
from pipeline.merge import CheckpointReader, MergeInputError, MergeSpec, merge_checkpoints
from pipeline.merge.io import INDEX

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def branches(tiny_run, tmp_path_factory):
    """θ0 and three perturbed 'branches' of the tiny model; the second is sharded."""
    _, run_dir = tiny_run
    root = tmp_path_factory.mktemp("branches")
    init = run_dir / "init"
    processor = AutoProcessor.from_pretrained(init)
    paths = []
    for k in range(3):
        model = AutoModelForImageTextToText.from_pretrained(init)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        path = root / f"b{k}"
        model.save_pretrained(path, max_shard_size="200KB" if k == 1 else "1GB")
        processor.save_pretrained(path)
        paths.append(path)
    return init, paths


def disk_tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {name: reader.get(name) for name in reader.info}


def spec(tmp_path, base, paths, **fields) -> MergeSpec:
    data = {
        "base_model": str(base),
        "models": [{"path": str(p), "tokens": 100 * (i + 1)} for i, p in enumerate(paths)],
        "method": "weighted_average",
        "out_path": str(tmp_path / "merged"),
    }
    return MergeSpec.model_validate(data | fields)


def test_weighted_merge_matches_the_formula_and_loads(branches, tmp_path):
    base, paths = branches
    assert (paths[1] / INDEX).is_file()  # a sharded input
    report = merge_checkpoints(spec(tmp_path, base, paths), progress=False)
    merged = disk_tensors(tmp_path / "merged")
    inputs = [disk_tensors(p) for p in paths]
    for name, tensor in merged.items():
        expected = (1 * inputs[0][name] + 2 * inputs[1][name] + 3 * inputs[2][name]) / 6
        torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-6)
    assert report.tensors == len(merged) and set(report.methods.values()) == {"weighted_average"}
    assert report.bytes_read == 3 * sum(t.numel() * 4 for t in merged.values())  # the base is not read
    manifest = verify_checkpoint(tmp_path / "merged")
    assert manifest["kind"] == "merge" and manifest["spec"]["method"] == "weighted_average"
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    batch = processor(text=["<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"], return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**batch, labels=batch["input_ids"]).loss)


def test_rules_per_group_sharded_output_and_bf16(branches, tmp_path):
    base, paths = branches
    rules = [
        {"group": "embeddings", "method": "weighted_average"},
        {"group": "vision_tower", "method": "ties", "params": {"density": 0.5}},
        {"pattern": "*", "method": "iso_c"},
    ]
    report = merge_checkpoints(
        spec(tmp_path, base, paths, method=None, rules=rules, out_dtype="bfloat16", max_shard_size=150_000),
        progress=False,
    )
    assert report.methods["model.embed_tokens.weight"] == "weighted_average"
    assert report.methods["visual.blocks.0.attn.qkv.weight"] == "ties"
    assert report.methods["model.layers.0.mlp.up_proj.weight"] == "iso_c"
    out = tmp_path / "merged"
    index = json.loads((out / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    for shard in set(index["weight_map"].values()):
        assert (out / shard).stat().st_size < 150_000 + 8192  # one tensor never exceeds the limit here
    merged = disk_tensors(out)
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    model = AutoModelForImageTextToText.from_pretrained(out, dtype="auto")  # in the dtype its config names
    assert model.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    verify_checkpoint(out)


def test_bf16_branches_over_an_fp32_base_merge_into_bf16(branches, tmp_path):
    """Branches trained in bf16 on GPUs, θ0 in fp32: computed in fp32, written in the branches' dtype."""
    base, paths = branches
    low = []
    for k, path in enumerate(paths[:2]):
        dst = tmp_path / f"bf16-{k}"
        shutil.copytree(path, dst, ignore=shutil.ignore_patterns("*.safetensors", INDEX))
        save_file({n: t.bfloat16() for n, t in disk_tensors(path).items()}, dst / "model.safetensors")
        low.append(dst)
    for method in ("weighted_average", "ties", "iso_c"):
        merge_checkpoints(spec(tmp_path, base, low, method=method, out_path=str(tmp_path / method)), progress=False)
        merged, inputs = disk_tensors(tmp_path / method), [disk_tensors(p) for p in low]
        assert {t.dtype for t in merged.values()} == {torch.bfloat16}, method
        if method == "weighted_average":
            name = "model.layers.0.mlp.up_proj.weight"
            expected = (inputs[0][name].float() + 2 * inputs[1][name].float()) / 3
            torch.testing.assert_close(merged[name], expected.bfloat16())
        AutoModelForImageTextToText.from_pretrained(tmp_path / method)


def test_a_tied_lm_head_theta0_stores_twice_is_written_twice_as_the_merged_embedding(branches, tmp_path):
    """A merge keeps θ0's stored tensors: a tied head stored beside the embedding is written too, the merged
    embedding bit for bit (the model ties them: one matrix, merged once)."""
    base, paths = branches
    copies = []
    for p in (base, *paths[:1]):
        dst = tmp_path / p.name
        dst.mkdir()
        tensors = load_file(p / "model.safetensors")
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # stored twice on disk
        save_file(tensors, dst / "model.safetensors")
        (dst / "config.json").write_text((p / "config.json").read_text())
        copies.append(dst)
    merge_checkpoints(spec(tmp_path, copies[0], copies[1:]), progress=False)
    merged = disk_tensors(tmp_path / "merged")
    assert torch.equal(merged["lm_head.weight"], merged["model.embed_tokens.weight"])


def test_cli_merge(branches, tmp_path, capsys):
    base, paths = branches
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {
                "base_model": str(base),
                "models": [{"path": str(p)} for p in paths],
                "method": "ties",
                "params": {"density": 0.3},
                "out_path": str(tmp_path / "m"),
            }
        )
    )
    assert merit(["merge", str(spec_file)]) == 0
    assert "ties:" in capsys.readouterr().out and (tmp_path / "m" / "model.safetensors").is_file()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"models": [{"path": str(paths[0])}], "method": "ties", "out_path": "x"}))
    assert merit(["merge", str(bad)]) == 2 and "need base_model" in capsys.readouterr().err


MERGEKIT_METHODS = {
    "slerp": {},
    "nuslerp": {"nuslerp_flatten": False},
    "multislerp": {},
    "karcher": {},
    "model_stock": {},
    "breadcrumbs": {"density": 0.9, "gamma": 0.01},
    "breadcrumbs_ties": {"density": 0.9, "gamma": 0.01},
    "della": {"density": 0.7, "epsilon": 0.1},
    "della_linear": {"density": 0.7, "epsilon": 0.1},
    "sce": {"select_topk": 0.5},
    "dare_ties": {"density": 0.5, "lambda": 0.8},
    "dare_linear": {"density": 0.5},
}


@pytest.mark.parametrize("method", sorted(MERGEKIT_METHODS))
def test_cli_merges_two_branches_with_each_mergekit_method(branches, tmp_path, capsys, method):
    """``merit merge`` as a user runs it on the demo's K = 2 branches, with mergekit's parameter
    names: the output is a whole checkpoint, every tensor between θ0 and the branches' scale."""
    base, paths = branches
    spec_file = tmp_path / "spec.yaml"
    models = [{"path": str(p), "weight": w} for p, w in zip(paths[:2], (0.6, 0.4))]
    spec_file.write_text(
        yaml.safe_dump(
            {
                "base_model": str(base),
                "models": models,
                "method": method,
                "params": MERGEKIT_METHODS[method],
                "out_path": str(tmp_path / "m"),
            }
        )
    )
    assert merit(["merge", str(spec_file)]) == 0
    assert f"{method}:" in capsys.readouterr().out and verify_checkpoint(tmp_path / "m")["kind"] == "merge"
    merged, theta0 = disk_tensors(tmp_path / "m"), disk_tensors(base)
    assert merged.keys() == theta0.keys()
    moved = max(float((merged[n].float() - theta0[n].float()).abs().max()) for n in merged)
    assert 0 < moved < 0.1  # the branches are θ0 + 0.01 · noise (≤ 0.06): the merge stays near


# --- refusals: each names the file or tensor, and leaves no output behind -----------------------


def broken_copy(tmp_path, source: Path, edit) -> Path:
    dst = tmp_path / "broken"
    dst.mkdir()
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.norm.weight"), r"tensor names differ .*missing \['model.norm.weight'\]"),
        (lambda t: t.update({"extra.weight": torch.zeros(2)}), r"extra \['extra.weight'\]"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(3)}), r"tensor model.norm.weight is \(3,\)"),
        (
            lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}),
            r"model.norm.weight .*torch.int32",
        ),
        (
            lambda t: t["model.layers.0.mlp.up_proj.weight"].view(-1).__setitem__(5, float("nan")),
            r"model.layers.0.mlp.up_proj.weight contains NaN",
        ),
        (
            lambda t: t["visual.merger.mlp.0.weight"].view(-1).__setitem__(0, float("inf")),
            r"visual.merger.mlp.0.weight contains NaN or Inf",
        ),
    ],
)
@pytest.mark.parametrize("method", ["weighted_average", "ties"])
def test_refusals_name_the_tensor_and_file(branches, tmp_path, edit, message, method):
    base, paths = branches
    broken = broken_copy(tmp_path, paths[0], edit)
    with pytest.raises(MergeInputError, match=message) as err:
        merge_checkpoints(spec(tmp_path, base, [paths[2], broken], method=method), progress=False)
    assert "broken" in str(err.value)
    assert not (tmp_path / "merged").exists() and not list(tmp_path.glob(".merged*"))


def test_truncated_and_corrupt_files_are_named(branches, tmp_path):
    base, paths = branches
    dst = tmp_path / "trunc"
    dst.mkdir()
    data = (paths[0] / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MergeInputError, match=r"trunc/model.safetensors"):
        merge_checkpoints(spec(tmp_path, base, [dst, paths[1]]), progress=False)
    (dst / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(MergeInputError, match=r"trunc/model.safetensors"):
        merge_checkpoints(spec(tmp_path, base, [dst, paths[1]]), progress=False)
    (dst / "model.safetensors").unlink()
    (dst / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(MergeInputError, match="pickled .bin files are refused"):
        merge_checkpoints(spec(tmp_path, base, [dst, paths[1]]), progress=False)


def test_spec_refusals(branches, tmp_path):
    base, paths = branches
    with pytest.raises(ValueError, match="sum to a positive number"):
        spec(tmp_path, base, paths, models=[{"path": str(p), "weight": 0.0} for p in paths])
    with pytest.raises(ValueError, match="fisher"):
        spec(tmp_path, base, paths, method="fisher")
    with pytest.raises(ValueError, match="either 'method'"):
        spec(tmp_path, base, paths, rules=[{"pattern": "*", "method": "ties"}])
    with pytest.raises(ValueError, match="no merge rule matches"):
        merge_checkpoints(
            spec(tmp_path, base, paths, method=None, rules=[{"group": "embeddings", "method": "linear"}]),
            progress=False,
        )


def test_fisher_helper_and_fisher_merge(branches, tiny_run, processor, tmp_path):
    from pipeline.data import Collator, Encoder, load_sources
    from pipeline.fisher import estimate_fisher

    cfg, _ = tiny_run
    base, paths = branches
    examples = load_sources(cfg.data, 0).examples
    encoder, collate = Encoder(processor, 256), Collator(processor.tokenizer.pad_token_id)
    batches = [collate([encoder(examples[s][0])]) for s in ("colour_name", "add_digits", "caption")]
    fishers = []
    for k, path in enumerate(paths[:2]):
        model = AutoModelForImageTextToText.from_pretrained(path)
        fishers.append(estimate_fisher(model, batches[k:], tmp_path / f"fisher{k}"))
    values = disk_tensors(fishers[0])
    assert set(values) == set(disk_tensors(paths[0]))  # the checkpoint's own on-disk names
    assert all((t >= 0).all() for t in values.values()) and sum(t.sum() for t in values.values()) > 0
    models = [{"path": str(p), "fisher": str(f)} for p, f in zip(paths[:2], fishers)]
    merge_checkpoints(spec(tmp_path, base, paths[:2], models=models, method="fisher"), progress=False)
    merged, thetas = disk_tensors(tmp_path / "merged"), [disk_tensors(p) for p in paths[:2]]
    f = [disk_tensors(x) for x in fishers]
    for name in ("model.layers.0.mlp.up_proj.weight", "visual.blocks.1.attn.qkv.weight"):
        w0, w1 = f[0][name].clamp_min(1e-6) * 0.5, f[1][name].clamp_min(1e-6) * 0.5
        torch.testing.assert_close(
            merged[name], (w0 * thetas[0][name] + w1 * thetas[1][name]) / (w0 + w1), rtol=1e-5, atol=1e-6
        )
    # A tensor some Fisher files have and one lacks is an error naming that file (all lacking: averaged).
    shutil.copytree(fishers[1], tmp_path / "partial")
    weights = tmp_path / "partial" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "model.norm.weight"}, weights)
    models[1]["fisher"] = str(tmp_path / "partial")
    with pytest.raises(MergeInputError, match=r"partial: no Fisher values for tensor model.norm.weight"):
        spec_ = spec(tmp_path, base, paths[:2], models=models, method="fisher", out_path=str(tmp_path / "m2"))
        merge_checkpoints(spec_, progress=False)


@pytest.mark.parametrize("example", sorted((ROOT / "configs" / "merge").glob("*.yaml")), ids=lambda p: p.name)
def test_example_merge_specs_validate(example):
    spec = MergeSpec.from_yaml(example)
    assert spec.base_model and len(spec.models) >= 2 and spec.out_path


def test_a_killed_merge_leaves_no_output_and_the_rerun_completes(tmp_path):
    """Failure injection: SIGKILL `merit merge` while it writes; nothing that looks whole is left,
    and running the same spec again completes (the killed writer's leftovers are removed)."""
    import os
    import signal
    import time

    from merit.bench.merge import generate

    base, models = generate(tmp_path, 3, size_mb=48)
    out = tmp_path / "merged"
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {
                "base_model": str(base),
                "models": [{"path": str(p)} for p in models],
                "method": "ties",
                "out_path": str(out),
                "max_shard_size": 8_000_000,
            }
        )
    )
    command = [sys.executable, "-m", "merit", "merge", str(spec_file)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(p.glob("*.safetensors") for p in tmp_path.glob(".merged.tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the merge ended before it could be killed"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and list(tmp_path.glob(".merged.tmp-*"))
    rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert verify_checkpoint(out)["kind"] == "merge" and not list(tmp_path.glob(".merged.tmp-*"))


def test_stream_checkpoint_writes_shards_and_a_side_checkpoint_that_load(tmp_path, monkeypatch):
    """The one streaming writer of merges and DiLoCo rounds: tensors produced one at a time land
    in planned shards that safetensors and the index read back exactly, the side checkpoint
    (a round's momentum) beside them, with the sha256 of every file. Each tensor (512 bytes) is
    written in pieces of 100 bytes, the last one shorter, as a large tensor is in 1 MB pieces."""
    from pipeline.checkpoint import sha256_file
    from pipeline.merge import io
    from pipeline.merge.io import TensorInfo, stream_checkpoint

    monkeypatch.setattr(io, "WRITE_PIECE", 100)

    torch.manual_seed(0)
    values = {f"layer{i}.weight": torch.randn(16, 8) for i in range(4)} | {"norm.weight": torch.ones(8)}
    momentum = {name: -value for name, value in values.items() if name.startswith("layer")}
    plan = {name: TensorInfo(tuple(v.shape), v.dtype) for name, v in values.items()}
    side = {name: plan[name] for name in momentum}
    produced = []

    def produce(name):
        produced.append(name)
        return (values[name], momentum[name]) if name in momentum else values[name]

    written = stream_checkpoint(tmp_path, plan, produce, max_shard_bytes=600, side=("outer", side))
    assert produced == list(plan)  # one call a tensor, in planned order
    assert len(set(written.weight_maps[""].values())) == 4 and len(set(written.weight_maps["outer"].values())) == 4
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["weight_map"] == written.weight_maps[""]
    for sub, expected in (("", values), ("outer", momentum)):
        for name, file in written.weight_maps[sub].items():
            path = tmp_path / sub / file
            assert torch.equal(load_file(path)[name], expected[name])
            assert written.sha256[str(Path(sub) / file)] == sha256_file(path)
    assert written.bytes_written == sum(v.numel() * 4 for v in (*values.values(), *momentum.values()))
    (tmp_path / "again").mkdir()
    with pytest.raises(RuntimeError, match=r"layer0.weight: no outer tensor produced"):
        stream_checkpoint(tmp_path / "again", plan, lambda name: values[name], 600, side=("outer", side))
