"""LoRA DiLoCo workers: each round a fresh PEFT adapter on the global weights, sent as an adapter
folder and aggregated as ΔW = −(alpha / r)·B A (θ − θ_k for a saved module). A real flow with
DeepSpeed workers (ZeRO-2, one rank), checked against the payloads by hand, killed and resumed;
the aggregator on fabricated adapters against the same Δ as dense payloads; the refused settings."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from test_diloco import AVERAGE, DEMO, OVERRIDES, kill_flow_when, run_flow
from transformers import AutoModelForImageTextToText

from pipeline.checkpoint import read_manifest, write_manifest
from pipeline.config import ConfigError, DilocoMethod, load_config
from pipeline.diloco.asynchronous import Arrival, apply_arrival
from pipeline.diloco.lora import LoraWeights, save_adapter
from pipeline.diloco.payload import open_payload
from pipeline.diloco.plan import diloco_plan
from pipeline.diloco.rounds import aggregate_round, delta_dir, global_dir
from pipeline.merge import CheckpointReader, ModelView
from pipeline.merge.io import MergeInputError
from pipeline.preflight import check_run
from pipeline.report.collect import diloco_runs
from pipeline.report.diloco import payload_kind
from pipeline.train.lora import apply_lora

# Rank 4 on every linear layer but lm_head, and the post-attention norms trained whole
# (modules_to_save): both kinds of tensors an adapter payload holds.
LORA = [
    "train.finetuning_type=lora",
    "train.lora_rank=4",
    "train.lr=1e-2",
    "train.additional_target=post_attention_layernorm",
    "diloco.rounds=2",
    "eval.accuracy=false",  # held-out loss only: the flows' evaluation in a few seconds
]
VARIANT = "avg-iid"
ASYNC_METHOD = "diloco.methods=[{name: a, method: weighted_average}]"


def checkpoint_name(key: str) -> tuple[str, str]:
    """(θ's tensor name, kind) of an adapter key, mapped here by hand (Qwen2.5-VL's layout)."""
    inner = key.removeprefix("base_model.model.")
    for module, stored in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if inner.startswith(module):
            inner = stored + inner[len(module) :]
    for kind in ("lora_A", "lora_B"):
        if f".{kind}." in inner:
            return inner.replace(f".{kind}.", "."), kind
    return inner.replace(".modules_to_save.", "."), "whole"


def sent_payloads(run_dir: Path) -> list[Path]:
    """The workers' last payloads, kept in their last checkpoint (the published ones are retired)."""
    folders = []
    for worker in sorted((run_dir / "diloco" / VARIANT / "workers").iterdir()):
        tag = json.loads((worker / "checkpoints" / "latest.json").read_text())["tag"]
        folders.append(worker / "checkpoints" / tag / "diloco" / "delta")
    return folders


def tensor_bytes(path: Path) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(path).values())


@pytest.fixture(scope="module")
def lora_flow(prefect_api, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora-flow") / "run"
    state = run_flow(run_dir, AVERAGE, *LORA)
    assert state.is_completed(), state.message
    return run_dir


def test_lora_workers_send_adapters_and_plain_averaging_adds_their_weighted_delta_w(lora_flow):
    """η 1, μ 0, weighted average: global 2 = global 1 + Σ_k w_k (alpha / r) B_k A_k on the
    adapted tensors, Σ_k w_k θ_k on the saved ones, and θ0 bit for bit everywhere else."""
    folder = lora_flow / "diloco" / VARIANT
    records = json.loads((folder / "rounds.json").read_text())
    assert [r["round"] for r in records] == [0, 1]
    payloads = sent_payloads(lora_flow)
    init = AutoModelForImageTextToText.from_pretrained(lora_flow / "init")
    theta0 = CheckpointReader(lora_flow / "init")
    for k, payload in enumerate(payloads):
        manifest = read_manifest(payload)
        assert (manifest["lora"], manifest["round"], manifest["base"], manifest["worker"]) == (True, 1, 1, k)
        config = json.loads((payload / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(global_dir_of(lora_flow, 1))
        assert sorted(p.name for p in payload.iterdir() if not p.name.startswith(".")) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "manifest.json",
        ]
    peft = PeftModel.from_pretrained(init, payloads[0])  # PEFT loads it on θ0 (it was trained on global 1)
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in peft.named_parameters())

    # Bytes: each worker sent its adapter's tensors, a small share of a dense payload.
    sent = [tensor_bytes(p / "adapter_model.safetensors") for p in payloads]
    assert records[1]["bytes"]["sent"] == sum(sent) == records[0]["bytes"]["sent"]
    dense = sum(4 * math.prod(info.shape) for info in theta0.info.values())  # a full fine-tune's payload
    assert max(sent) < dense / 10
    [run] = diloco_runs(lora_flow)  # the report says what was sent
    assert payload_kind(run) == "LoRA r4" and payload_kind(run | {"lora_rank": None}) == "dense"

    # The outer step by hand, from the payloads.
    weights = records[1]["weights"]
    before, after = CheckpointReader(global_dir_of(lora_flow, 1)), CheckpointReader(global_dir_of(lora_flow, 2))
    expected, touched = {}, set()
    for w, payload in zip(weights, payloads):
        config = json.loads((payload / "adapter_config.json").read_text())
        scaling = config["lora_alpha"] / config["r"]
        tensors = {checkpoint_name(key): t for key, t in load_file(payload / "adapter_model.safetensors").items()}
        for (name, kind), t in tensors.items():
            touched.add(name)
            if kind == "lora_A":
                delta = scaling * tensors[name, "lora_B"].double() @ t.double()
                expected[name] = expected.get(name, before.get(name).double()) + w * delta
            elif kind == "whole":
                expected[name] = expected.get(name, 0) + w * t.double()
    assert {n for n in touched if "post_attention_layernorm" in n} and len(touched) > 20
    for name in theta0.info:
        if name in expected:
            assert torch.allclose(after.get(name).double(), expected[name], atol=1e-6, rtol=0), name
        else:
            assert torch.equal(after.get(name), theta0.get(name)), name  # never trained: θ0's, bit for bit
    assert all(not torch.equal(after.get(n), before.get(n)) for n in expected)  # every one trained


def global_dir_of(run_dir: Path, r: int) -> Path:
    return run_dir / "diloco" / VARIANT / "global" / str(r)


@pytest.mark.release  # a second kill of a DiLoCo flow (test_diloco_kills)
def test_a_killed_lora_flow_resumes_to_the_same_global_weights(lora_flow, tmp_path):
    """Killed once global 1 exists (the workers training round 2, or done with it: a tiny round
    can finish before the kill lands): each re-run worker resumes its checkpoint (AdamW state, data
    position; the adapter's moments linked after the load and restarted) and redraws the same
    fresh adapter, or re-sends the payload its checkpoint kept, so the run ends as the undisturbed
    one."""
    killed = tmp_path / "killed"
    settings = [*OVERRIDES, AVERAGE, *LORA]
    kill_flow_when(global_dir_of(killed, 1) / "manifest.json", killed, settings)
    assert not global_dir_of(killed, 2).exists()
    assert run_flow(killed, AVERAGE, *LORA).is_completed()
    logs = [(w / "train.log").read_text() for w in (killed / "diloco" / VARIANT / "workers").iterdir()]
    assert all(re.search(r"resumed from step([24]) \(step \1\)", log) for log in logs), logs
    expected, final = CheckpointReader(global_dir_of(lora_flow, 2)), CheckpointReader(global_dir_of(killed, 2))
    assert final.info.keys() == expected.info.keys()
    for name in expected.info:
        assert torch.allclose(final.get(name), expected.get(name), atol=1e-6, rtol=0), name


@pytest.fixture(scope="module")
def lora_plan(lora_flow):
    """The flow's θ0 and data, three LoRA workers."""
    return load_config(lora_flow / "config.yaml", ["diloco.workers=3"]), lora_flow


def fabricate_adapters(plan, whole: bool = True) -> list[dict[str, torch.Tensor]]:
    """Round 0's payloads as the plan's LoRA workers publish them (random A, B ≠ 0 and, with
    ``whole``, the saved norms moved; without, no saved modules), with the tokens and seconds a
    worker records; returns each one's dense Δ."""
    train = plan.workers[0].train
    train = train if whole else train.model_copy(update={"additional_target": []})
    theta, scaling = ModelView.open(plan.init), train.lora_scaling
    peft = apply_lora(AutoModelForImageTextToText.from_pretrained(plan.init), train, plan.init)
    weights = LoraWeights.of(peft.base_model.model, theta)
    peft_name = {id(p): n for n, p in weights.trained.items()}
    generator, deltas = torch.Generator().manual_seed(0), []
    for k in range(plan.size):
        state, delta = {}, {}
        for name, (a, b) in weights.factors.items():
            a_k, b_k = (0.1 * torch.randn(p.shape, generator=generator) for p in (a, b))
            state[peft_name[id(a)]], state[peft_name[id(b)]] = a_k, b_k
            delta[name] = -scaling * (b_k @ a_k)
        for name, param in weights.whole.items():
            state[peft_name[id(param)]] = theta.get_loaded(name) + 0.01 * torch.randn(param.shape, generator=generator)
            delta[name] = theta.get_loaded(name) - state[peft_name[id(param)]]
        folder = delta_dir(plan, 0, k)
        folder.mkdir(parents=True)
        save_adapter(peft, state, folder, plan.init)
        meta = {"tokens": 100 * (k + 1), "seconds": {"inner": 1.0, "load": 0.1, "save": 0.1}, "base": 0}
        write_manifest(folder, kind="diloco_delta", round=0, worker=k, lora=True, steps=[0, 2], **meta)
        deltas.append(delta)
    return deltas


def dense_payloads(plan, deltas: list[dict[str, torch.Tensor]]) -> None:
    """The same Δ as a dense worker publishes it (fp32, the tensors as the model holds them, in θ's order)."""
    order = list(ModelView.open(plan.init).loaded())
    for k, delta in enumerate(deltas):
        folder = delta_dir(plan, 0, k)
        folder.mkdir(parents=True)
        save_file({n: delta[n].contiguous() for n in order if n in delta}, folder / "model.safetensors")
        meta = {"tokens": 100 * (k + 1), "seconds": {"inner": 1.0, "load": 0.1, "save": 0.1}, "base": 0}
        write_manifest(folder, kind="diloco_delta", round=0, worker=k, steps=[0, 2], **meta)


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    x, y = CheckpointReader(a), CheckpointReader(b)
    assert x.info.keys() == y.info.keys()
    for name in x.info:
        assert torch.allclose(x.get(name).float(), y.get(name).float(), atol=atol, rtol=0), name


@pytest.mark.parametrize(("method", "parts"), [("iso_c", 1), ("ties", 2)])
def test_methods_aggregate_adapter_payloads_as_the_same_delta_w_sent_dense(lora_plan, tmp_path, method, parts):
    """Iso-C (and TIES, in two parts) of adapter payloads is Iso-C of −(alpha / r)·B A sent as dense
    Δ: the methods see ΔW, never A and B apart. Tensors no adapter touches stay θ0's, bit for bit;
    a payload's bytes are its factors'."""
    cfg, run_dir = lora_plan
    entry = DilocoMethod(name="m", method=method, outer_lr=1.8, outer_momentum=0.8)
    plan = diloco_plan(cfg, run_dir, entry)
    adapters = plan.model_copy(update={"folder": str(tmp_path / "adapters"), "aggregators": parts})
    dense = plan.model_copy(update={"folder": str(tmp_path / "dense")})
    dense_payloads(dense, fabricate_adapters(adapters))
    records = [aggregate_round(plan, 0, [0, 1, 2]) for plan in (adapters, dense)]
    for sub in ("", "outer"):
        assert_same_weights(global_dir(adapters, 1) / sub, global_dir(dense, 1) / sub, atol=1e-5)
    theta0, merged = CheckpointReader(adapters.init), CheckpointReader(global_dir(adapters, 1))
    trained = set(open_payload(delta_dir(dense, 0, 0), ModelView.open(dense.init)).trained)
    assert {n for n in theta0.info if not torch.equal(merged.get(n), theta0.get(n))} == trained
    sent = sum(tensor_bytes(delta_dir(adapters, 0, k) / "adapter_model.safetensors") for k in range(3))
    assert records[0]["bytes"]["sent"] == sent < records[1]["bytes"]["sent"] / 4
    assert records[0]["bytes"]["received"] == records[1]["bytes"]["received"]  # the global stays dense
    assert records[0]["delta_norms"] == pytest.approx(records[1]["delta_norms"], rel=1e-5)


def test_async_arrivals_of_adapter_payloads_apply_their_delta_w(lora_plan, tmp_path):
    """Async mode: each adapter payload applied as it arrives, the momentum at the window's end,
    as the same Δ sent dense; an adapter with tensors saved whole is refused (its Δ would need the
    global it started from)."""
    cfg, run_dir = lora_plan
    entry = DilocoMethod(name="m", method="weighted_average", outer_lr=0.7, outer_momentum=0.9)
    base = diloco_plan(cfg, run_dir, entry).model_copy(update={"sync": "async"})
    adapters = base.model_copy(update={"folder": str(tmp_path / "adapters")})
    dense = base.model_copy(update={"folder": str(tmp_path / "dense")})
    dense_payloads(dense, fabricate_adapters(adapters, whole=False))
    schedule = [
        Arrival(worker=k, payload=0, base=0, steps=2, tokens=100 * (k + 1), weight=0.2 * (k + 1)) for k in range(3)
    ]
    for plan in (adapters, dense):
        for v in range(3):
            record = apply_arrival(plan, v, schedule)
    assert record["window_closed"]
    for sub in ("", "outer"):
        assert_same_weights(global_dir(adapters, 3) / sub, global_dir(dense, 3) / sub, atol=1e-6)

    saved = base.model_copy(update={"folder": str(tmp_path / "saved")})
    fabricate_adapters(saved)
    with pytest.raises(MergeInputError, match="cannot be applied asynchronously"):
        apply_arrival(saved, 0, schedule)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["diloco.compression=int8"], "diloco.compression int8 with train.finetuning_type lora"),
        (["diloco.compression=int4"], "diloco.compression int4 with train.finetuning_type lora"),
        (["diloco.error_feedback=true"], "diloco.error_feedback with train.finetuning_type lora: a residual"),
        (
            ["diloco.sync=async", "train.additional_target=lm_head", ASYNC_METHOD],
            "train.additional_target with .*async",
        ),
    ],
)
def test_lora_workers_refuse_quantised_payloads_error_feedback_and_saved_modules_in_async(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, ["train.finetuning_type=lora", *settings])
    load_config(DEMO, settings)  # the same settings without LoRA workers


def test_preflight_accepts_lora_workers_and_names_their_adapters(tmp_path):
    for settings in (
        ["diloco.compression=bf16"],
        ["diloco.sync=async", ASYNC_METHOD],
    ):
        cfg = load_config(DEMO, ["train.finetuning_type=lora", *settings])
        checked = check_run(cfg, tmp_path / "run", diloco=True)
        assert "each round a fresh LoRA adapter of rank 8 (alpha 16)" in checked["diloco"]
