"""Every method this library shares with mergekit, run by both on the same tiny checkpoints,
compared tensor by tensor (mergekit 0.1.5, in the ``dev`` extra).

Tolerance: the merged task vector within 1e-6 of its largest entry, plus the roundings at θ's
scale that a file of θ cannot separate from τ: each library adds θ0 back in fp32 (mergekit's
Model Stock as t · mean + (1 − t) · θ0, three roundings), so up to 4 ulps of θ. The random-mask
methods (DARE, DELLA) run at density 1, where no entry is dropped, and again below 1 with mergekit's
``torch.bernoulli`` replaced by this library's draws (``SameDraws``) and mergekit's L1 rescale
(``rescale_norm: l1``): the two libraries draw their masks from different generators
(``torch.bernoulli`` there, seeded SFC64 draws here), so below density 1 their own outputs differ
(``test_own_masks_differ_from_mergekit``) and only the rest of the merge can be compared
(docs/concepts/merge-methods.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from merit.bench.merge import checkpoint_shapes, qwen2_config
from merit.cli import main as merit
from pipeline.merge import MergeSpec, merge_checkpoints
from pipeline.merge.methods.dare import LEVELS, draws, drop_level
from pipeline.merge.registry import TensorContext

mergekit = pytest.importorskip("mergekit", reason="mergekit is a test dependency (pip install -e '.[dev]')")
from mergekit.config import MergeConfiguration  # noqa: E402
from mergekit.merge import MergeOptions, run_merge  # noqa: E402

WEIGHTS = [0.5, 0.3, 0.2]
# name: (our method, our params, mergekit's method, mergekit's per-model params, mergekit's shared
# params, models, whether mergekit gets θ0 as its base model, whether ours weighs by WEIGHTS)
CASES = {
    "linear": ("weighted_average", {}, "linear", {}, {}, 3, False, True),
    "task_arithmetic": ("task_arithmetic", {"lambda": 0.7}, "task_arithmetic", {}, {"lambda": 0.7}, 3, True, True),
    "ties": ("ties", {"density": 0.3}, "ties", {"density": 0.3}, {}, 3, True, True),
    "ties_sum": (
        "ties",
        {"density": 0.5, "normalize": False},
        "ties",
        {"density": 0.5},
        {"normalize": False},
        3,
        True,
        True,
    ),
    "dare_linear": ("dare_linear", {}, "dare_linear", {"density": 1.0}, {}, 3, True, True),
    "dare_ties": ("dare_ties", {}, "dare_ties", {"density": 1.0}, {}, 3, True, True),
    "breadcrumbs": (
        "breadcrumbs",
        {"density": 0.8, "gamma": 0.05},
        "breadcrumbs",
        {"density": 0.8, "gamma": 0.05},
        {},
        3,
        True,
        True,
    ),
    "breadcrumbs_ties": (
        "breadcrumbs_ties",
        {"density": 0.6, "gamma": 0.1},
        "breadcrumbs_ties",
        {"density": 0.6, "gamma": 0.1},
        {},
        3,
        True,
        True,
    ),
    "della": ("della", {}, "della", {"density": 1.0}, {}, 3, True, True),
    "della_linear": ("della_linear", {}, "della_linear", {"density": 1.0}, {}, 3, True, True),
    # below density 1: mergekit's masks replaced by merit's (share_draws), mergekit's L1 rescale
    "dare_linear_masks": (
        "dare_linear",
        {"density": 0.6, "rescale_norm": "l1"},
        "dare_linear",
        {"density": 0.6},
        {},
        3,
        True,
        True,
    ),
    "dare_ties_masks": (
        "dare_ties",
        {"density": 0.7, "rescale_norm": "l1"},
        "dare_ties",
        {"density": 0.7},
        {},
        3,
        True,
        True,
    ),
    "della_masks": (
        "della",
        {"density": 0.6, "epsilon": 0.1, "rescale_norm": "l1"},
        "della",
        {"density": 0.6, "epsilon": 0.1},
        {},
        3,
        True,
        True,
    ),
    "della_linear_masks": (
        "della_linear",
        {"density": 0.5, "epsilon": 0.2, "rescale_norm": "l1"},
        "della_linear",
        {"density": 0.5, "epsilon": 0.2},
        {},
        3,
        True,
        True,
    ),
    "nuslerp": ("nuslerp", {}, "nuslerp", {}, {}, 2, True, True),
    "nuslerp_rows": ("nuslerp", {"nuslerp_flatten": False}, "nuslerp", {}, {"nuslerp_flatten": False}, 2, True, True),
    "nuslerp_columns": (
        "nuslerp",
        {"nuslerp_flatten": False, "nuslerp_row_wise": True},
        "nuslerp",
        {},
        {"nuslerp_flatten": False, "nuslerp_row_wise": True},
        2,
        True,
        True,
    ),
    "multislerp": ("multislerp", {}, "multislerp", {}, {}, 3, True, True),
    "model_stock": ("model_stock", {}, "model_stock", None, {}, 3, True, False),
    "model_stock_rows": (
        "model_stock",
        {"filter_wise": True},
        "model_stock",
        None,
        {"filter_wise": True},
        3,
        True,
        False,
    ),
    "sce": ("sce", {"select_topk": 0.5}, "sce", None, {"select_topk": 0.5}, 3, True, False),
    "sce_all": ("sce", {}, "sce", None, {}, 3, True, False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, list[Path]]:
    """θ0 (a tiny tied Qwen2, fp32) and three fine-tunes of it: far enough apart that SLERP takes
    its arc (cos Ω < 0.9995), the third correlated with the first (τ_3 = τ_1 + noise) so that the
    angles differ and the Karcher mean is not the normalised average, every entry distinct."""
    folder = tmp_path_factory.mktemp("mergekit")
    config = qwen2_config(0.5, "float32")
    g = torch.Generator().manual_seed(0)
    base = {n: torch.randn(s, generator=g) for n, s in checkpoint_shapes(config).items()}
    first = {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in base.items()}
    second = {n: 0.2 * torch.randn(t.shape, generator=g) for n, t in base.items()}
    third = {n: first[n] + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()}
    paths = []
    for name, tau in [("base", None), ("m1", first), ("m2", second), ("m3", third)]:
        path = folder / name
        path.mkdir()
        save_file({n: t + tau[n] if tau else t for n, t in base.items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths[0], paths[1:]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def run_mergekit(method: str, per_model: dict | None, shared: dict, base: Path | None, models: list[Path], out: Path):
    entries = []
    for path, weight in zip(models, WEIGHTS):
        entry: dict = {"model": str(path)}
        if per_model is not None:
            entry["parameters"] = {"weight": weight, **per_model}
        entries.append(entry)
    config = {"merge_method": method, "models": entries, "dtype": "float32", "parameters": shared}
    if base is not None:
        config["base_model"] = str(base)
    run_merge(
        MergeConfiguration.model_validate(config), str(out), MergeOptions(copy_tokenizer=False, write_model_card=False)
    )
    return tensors(out)


def run_ours(method: str, params: dict, base: Path | None, models: list[Path], weights: list[float], out: Path):
    spec = MergeSpec(
        base_model=str(base) if base else None,
        models=[{"path": str(p), "weight": w} for p, w in zip(models, weights)],
        method=method,
        params=params,
        out_path=str(out),
    )
    merge_checkpoints(spec, progress=False)
    return tensors(out)


def assert_same_merge(ours: dict, theirs: dict, base: dict | None) -> None:
    assert set(ours) <= set(theirs), sorted(set(ours) - set(theirs))
    for name, mine in ours.items():
        other = theirs[name].float()
        origin = base[name] if base is not None else torch.zeros_like(other)
        tau = other - origin
        rounding = 4 * torch.finfo(torch.float32).eps * other.abs().max()
        error = (mine - other).abs().max()
        assert error <= 1e-6 * tau.abs().max() + rounding, f"{name}: {error:.3g} off, |τ| ≤ {tau.abs().max():.3g}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_equal_to_mergekit(case, checkpoints, tmp_path, monkeypatch):
    ours_method, params, theirs_method, per_model, shared, k, with_base, weighted = CASES[case]
    base, models = checkpoints
    base, models = (base if with_base else None), models[:k]
    if theirs_method.startswith(("dare", "della")) and per_model["density"] < 1:  # mergekit given merit's masks
        share_draws(monkeypatch, theirs_method.split("_")[0], base, models)
    theirs = run_mergekit(theirs_method, per_model, shared, base, models, tmp_path / "theirs")
    weights = WEIGHTS[:k] if weighted else [1.0] * k  # mergekit's karcher, model_stock and sce weigh equally
    ours = run_ours(ours_method, params, base, models, weights, tmp_path / "ours")
    assert_same_merge(ours, theirs, tensors(base) if base else None)


@pytest.mark.parametrize("case", ["dare_linear_masks", "della_masks"])
def test_own_masks_differ_from_mergekit(case, checkpoints, tmp_path):
    """Below density 1, each library with its own draws: the masks differ (``torch.bernoulli`` on
    mergekit's global generator there, SFC64 seeded by tensor, model and position here), so the
    merges do; the cases above agree once mergekit is given merit's masks."""
    ours_method, params, theirs_method, per_model, shared, k, _, _ = CASES[case]
    base, models = checkpoints
    torch.manual_seed(0)
    theirs = run_mergekit(theirs_method, per_model, shared, base, models[:k], tmp_path / "theirs")
    ours = run_ours(ours_method, params, base, models[:k], WEIGHTS[:k], tmp_path / "ours")
    with pytest.raises(AssertionError):
        assert_same_merge(ours, theirs, tensors(base))


def test_slerp_equal_to_mergekit(checkpoints, tmp_path):
    """mergekit's SLERP runs from its base model to the other input; ours between the two inputs,
    over θ0 (which it only subtracts and adds back), t the second input's weight or ``t``."""
    base, (first, second, _) = checkpoints
    config = {
        "merge_method": "slerp",
        "base_model": str(first),
        "models": [{"model": str(first)}, {"model": str(second)}],
        "parameters": {"t": 0.3},
        "dtype": "float32",
    }
    options = MergeOptions(copy_tokenizer=False, write_model_card=False)
    run_merge(MergeConfiguration.model_validate(config), str(tmp_path / "theirs"), options)
    theirs = tensors(tmp_path / "theirs")
    by_weights = run_ours("slerp", {}, base, [first, second], [0.7, 0.3], tmp_path / "weights")
    by_t = run_ours("slerp", {"t": 0.3}, base, [first, second], [0.5, 0.5], tmp_path / "t")
    for ours in (by_weights, by_t):
        assert_same_merge(ours, theirs, tensors(first))


def test_karcher_equal_to_mergekit(checkpoints, tmp_path):
    """Karcher without a base on the three task vectors saved as models (mergekit's karcher
    averages whatever it is given, a base included): their angles are wide (θ0 + τ_k would be
    nearly parallel, and one step would reach the mean), so the iteration matters."""
    base, models = checkpoints
    theta0 = tensors(base)
    folders = []
    for path in models:
        folder = tmp_path / f"tau-{path.name}"
        folder.mkdir()
        save_file({n: t - theta0[n] for n, t in tensors(path).items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text((path / "config.json").read_text())
        folders.append(folder)
    theirs = run_mergekit("karcher", None, {}, None, folders, tmp_path / "theirs")
    ours = run_ours("karcher", {}, None, folders, [1.0] * 3, tmp_path / "ours")
    assert_same_merge(ours, theirs, None)
    one_step = run_ours("karcher", {"max_iter": 1}, None, folders, [1.0] * 3, tmp_path / "one")
    with pytest.raises(AssertionError):
        assert_same_merge(one_step, theirs, None)


def test_bench_merge_times_both_commands_beside_the_whole_command_floor(capsys):
    """``merit bench merge --mergekit`` runs mergekit's real command beside ``merit merge`` and the
    floor (``merit merge`` averaging every file the method reads), and prints mergekit's seconds
    over each; the start-up row (tiny checkpoints) has no floor."""
    mergekit_yaml = f"{sys.executable} -m mergekit.scripts.run_yaml --no-copy-tokenizer"
    args = ["bench", "merge", "--k", "2", "--size-mb", "1", "--repeats", "1", "--methods", "ties"]
    merit([*args, "--mergekit", mergekit_yaml])
    out = capsys.readouterr().out
    floor = next(line for line in out.splitlines() if line.strip().startswith("floor (whole command, warm)"))
    over_models, with_base = (float(word) for word in floor.split() if word.replace(".", "").isdigit())
    ties = next(line.split() for line in out.splitlines() if line.strip().startswith("ties, K = 2"))
    mine, theirs, ratio, ceiling = (float(x) for x in ties[-4:])
    assert quotient_of(ratio, theirs, mine)
    assert quotient_of(ceiling, theirs, with_base)  # TIES reads θ0: the floor over the K + 1 files
    assert over_models > 0 and with_base > 0
    startup = next(line.split() for line in out.splitlines() if "start-up (tiny)" in line)
    assert len(startup) == 2 + 3  # label words, then merit, mergekit and their ratio: no floor


def quotient_of(printed: float, numerator: float, denominator: float) -> bool:
    """Whether a ratio printed to 2 decimals is the quotient of two seconds printed to 2 decimals
    (the bench divides the unrounded ones)."""
    low, high = (numerator - 0.005) / (denominator + 0.005), (numerator + 0.005) / (denominator - 0.005)
    return low - 0.005 <= printed <= high + 0.005


# --- mergekit's YAML run by `merit merge` --------------------------------------------------------------------

EXAMPLES = Path(__file__).parent.parent / "configs" / "merge" / "mergekit"


@pytest.fixture(scope="module")
def run_layout(checkpoints, tmp_path_factory) -> Path:
    """The tiny checkpoints where a run directory keeps θ0 and its branches: the example YAMLs' paths."""
    root = tmp_path_factory.mktemp("layout")
    base, models = checkpoints
    demo = root / "runs" / "demo"
    (demo / "warmup").mkdir(parents=True)
    (demo / "warmup" / "final").symlink_to(base)
    for k, path in enumerate(models):
        (demo / "branches" / str(k)).mkdir(parents=True)
        (demo / "branches" / str(k) / "final").symlink_to(path)
    return root


class SameDraws:
    """``torch`` as mergekit's sparsifiers see it, except that ``bernoulli`` gives the keep masks merit
    draws for the tensor and model being sparsified (found by its task vector): both libraries drop the
    same entries, so what the comparison sees is everything after the masks (rescale, consensus, sums)."""

    def __init__(self, deltas: dict[bytes, tuple[str, int]], method: str):
        self.deltas, self.method, self.current = deltas, method, None

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor:
        name, k = self.current
        random = draws(TensorContext(name, 0), k, 0, probs.numel()).view(probs.shape)
        if self.method == "dare":  # merit keeps the entries whose draw reaches the drop level
            keep = random >= drop_level(1 - float(probs.flatten()[0]))
        else:  # DELLA keeps an entry whose uniform draw is under its keep probability
            keep = random.float().add_(LEVELS // 2).div_(LEVELS) < probs
        return keep.to(probs.dtype)

    def sparsify(self, original):
        def sparsify(delta: torch.Tensor, **kwargs):
            self.current = self.deltas[delta.float().numpy().tobytes()]
            return original(delta, **kwargs)

        return sparsify


def share_draws(monkeypatch, method: str, base: Path, models: list[Path]) -> None:
    import mergekit.merge_methods.generalized_task_arithmetic as gta
    import mergekit.sparsify

    theta0 = tensors(base)
    deltas = {
        (t - theta0[name]).numpy().tobytes(): (name, k)
        for k, path in enumerate(models)
        for name, t in tensors(path).items()
    }
    same = SameDraws(deltas, method)
    monkeypatch.setattr(mergekit.sparsify, "torch", same)
    monkeypatch.setattr(gta, "sparsify", same.sparsify(gta.sparsify))


def run_mergekit_yaml(data: dict, out: Path) -> dict[str, torch.Tensor]:
    config = MergeConfiguration.model_validate({k: v for k, v in data.items() if k != "out_path"})
    options = MergeOptions(copy_tokenizer=False, write_model_card=False)
    if data.get("slices"):
        # mergekit 0.1.5 writes a frankenmerge's tensors, then cannot save its config: it changes
        # num_hidden_layers but not the layer_types that transformers derived from it, which
        # transformers 5 refuses. The tensors are compared; merit's config is loaded below.
        with pytest.raises(Exception, match="layer_types"):
            run_merge(config, str(out), options)
    else:
        run_merge(config, str(out), options)
    return tensors(out)


@pytest.mark.parametrize("example", sorted(p.stem for p in EXAMPLES.glob("*.yaml")))
def test_mergekit_example_equals_mergekit(example, run_layout, monkeypatch):
    """Each example YAML, unchanged, through `merit merge` and through mergekit: weights that do not sum
    to 1, per-model densities, a layer gradient with filters, DARE's masks shared (mergekit's draws
    replaced by merit's), a frankenmerge."""
    import yaml

    monkeypatch.chdir(run_layout)
    path = EXAMPLES / f"{example}.yaml"
    data = yaml.safe_load(path.read_text())
    if data["merge_method"].startswith(("dare", "della")):
        models = [Path(m["model"]) for m in data["models"]]
        share_draws(monkeypatch, data["merge_method"].split("_")[0], Path(data["base_model"]), models)
    theirs = run_mergekit_yaml(data, run_layout / f"theirs-{example}")
    merit(["merge", str(path), "--out-path", f"ours-{example}"])
    ours = tensors(run_layout / f"ours-{example}")
    assert set(ours) == set(theirs)
    if example == "passthrough":
        assert all(torch.equal(ours[n], theirs[n]) for n in ours)
        model = transformers.AutoModelForCausalLM.from_pretrained(run_layout / f"ours-{example}")
        assert model.config.num_hidden_layers == 4 == len(model.model.layers)
        return
    base = data.get("base_model")
    assert_same_merge(ours, theirs, tensors(Path(base)) if base else None)


def test_task_arithmetic_yaml_sums_unnormalised(run_layout, monkeypatch):
    """normalize: false adds λ Σ w_k τ_k with the raw weights (a weight of 1 per model adds each τ_k whole)."""
    import yaml

    monkeypatch.chdir(run_layout)
    data = yaml.safe_load((EXAMPLES / "task_arithmetic.yaml").read_text())
    merit(["merge", str(EXAMPLES / "task_arithmetic.yaml"), "--out-path", "sum"])
    theta0 = tensors(Path(data["base_model"]))
    taus = [{n: t - theta0[n] for n, t in tensors(Path(m["model"])).items()} for m in data["models"]]
    weights = [m["parameters"]["weight"] for m in data["models"]]
    for name, merged in tensors(run_layout / "sum").items():
        expected = data["parameters"]["lambda"] * sum(w * tau[name] for w, tau in zip(weights, taus))
        rounding = 4 * torch.finfo(torch.float32).eps * merged.abs().max()  # θ's ulps: the file holds θ, not τ
        torch.testing.assert_close(merged - theta0[name], expected, rtol=1e-5, atol=float(rounding))


RAW_WEIGHTS = [1.0, 0.6, 0.4]  # summing to 2: mergekit's unnormalised sums double
# name: (mergekit's method, per-model parameters (a list: one value per model), shared parameters, models)
YAML_CASES = {
    "linear_sum": ("linear", {}, {"normalize": False}, 3),
    "task_arithmetic_mean": ("task_arithmetic", {}, {"normalize": True, "lambda": 0.7}, 3),
    "ties_sum": ("ties", {"density": [0.3, 0.5, 0.4]}, {"normalize": False}, 3),
    "dare_linear": ("dare_linear", {"density": [0.5, 0.7, 0.6]}, {}, 3),
    "dare_linear_unscaled": ("dare_linear", {"density": [0.5, 0.7, 0.6]}, {"rescale": False, "normalize": True}, 3),
    "breadcrumbs": ("breadcrumbs", {"density": 0.8, "gamma": 0.05}, {}, 3),
    "breadcrumbs_ties": ("breadcrumbs_ties", {"density": 0.6, "gamma": 0.1}, {"normalize": True}, 3),
    "della": ("della", {"density": [0.5, 0.6, 0.7], "epsilon": 0.1}, {}, 3),
    "della_linear": ("della_linear", {"density": [0.5, 0.6, 0.7], "epsilon": 0.1}, {"lambda": 0.8}, 3),
    "nuslerp": ("nuslerp", {}, {}, 2),
    "multislerp": ("multislerp", {}, {}, 3),
    "model_stock": ("model_stock", None, {"filter_wise": True}, 3),
    "sce": ("sce", None, {"select_topk": 0.5}, 3),
}


@pytest.mark.parametrize("case", sorted(YAML_CASES))
def test_mergekit_yaml_equals_mergekit(case, checkpoints, tmp_path, monkeypatch):
    """Every shared method written as mergekit's YAML (raw weights, per-model densities, mergekit's
    defaults) through `merit merge` and through mergekit; DARE's and DELLA's masks shared."""
    import yaml

    method, per_model, shared, k = YAML_CASES[case]
    base, models = checkpoints
    models = models[:k]
    entries = []
    for i, path in enumerate(models):
        entry = {"model": str(path)}
        if per_model is not None:
            values = {key: v[i] if isinstance(v, list) else v for key, v in per_model.items()}
            entry["parameters"] = {"weight": RAW_WEIGHTS[i], **values}
        entries.append(entry)
    data = {"merge_method": method, "models": entries, "parameters": shared, "dtype": "float32"}
    if method != "linear":  # mergekit's linear merges its base model as one more input
        data["base_model"] = str(base)
    if method.startswith(("dare", "della")):
        share_draws(monkeypatch, method.split("_")[0], base, models)
    theirs = run_mergekit_yaml(data, tmp_path / "theirs")
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(data))
    merit(["merge", str(tmp_path / "merge.yaml"), "--out-path", str(tmp_path / "ours")])
    assert_same_merge(tensors(tmp_path / "ours"), theirs, tensors(base) if "base_model" in data else None)
