"""Each merge method against a plain, independent formula (numpy), on small random tensors."""

import numpy as np
import pytest
import torch

from merit.bench.isoc import spectrum_matrix
from pipeline.merge import Rule, TensorContext, TensorInputs, get_method, merge_state_dicts, merge_tensor, tensor_reader
from pipeline.merge.linalg import iso
from pipeline.merge.methods.dare import draws, drop_level, rescale

SHAPES = {"square": (24, 24), "rect": (40, 17), "vector": (33,)}


def case(k: int, shape, seed=0, zero=False):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    taus = torch.zeros((k, *shape)) if zero else torch.randn((k, *shape), generator=g)
    weights = torch.rand(k, generator=g) + 0.1
    return base, [base + t for t in taus], weights


def merged(method, base, models, weights, **params):
    out = merge_state_dicts(
        [{"t": m} for m in models], weights, [Rule(pattern="*", method=method, params=params)], base={"t": base}
    )
    return out["t"].numpy().astype(np.float64)


def np_inputs(base, models, weights):
    w = weights.double().numpy() / weights.double().sum().item()
    taus = np.stack([(m - base).double().numpy() for m in models])
    return base.double().numpy(), taus, w


def np_polar(x):
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    return u @ vt


PARAMS = [(k, s, zero) for k in (1, 8) for s in SHAPES for zero in (False, True)] + [(3, "rect", False)]


@pytest.mark.parametrize("k, shape, zero", PARAMS)
def test_weighted_average_and_task_arithmetic(k, shape, zero):
    base, models, weights = case(k, SHAPES[shape], zero=zero)
    b, taus, w = np_inputs(base, models, weights)
    thetas = taus + b
    np.testing.assert_allclose(merged("weighted_average", base, models, weights), np.tensordot(w, thetas, 1), atol=1e-5)
    np.testing.assert_allclose(
        merged("task_arithmetic", base, models, weights, scale=0.3), b + 0.3 * np.tensordot(w, taus, 1), atol=1e-5
    )


def np_ties(b, taus, w, density, scale):
    trimmed = np.zeros_like(taus)
    for i, t in enumerate(taus):
        flat = np.abs(t).ravel()
        keep = max(1, int(density * flat.size))
        threshold = np.sort(flat)[::-1][keep - 1]
        trimmed[i] = np.where(np.abs(t) >= threshold, t, 0.0)
    total = np.tensordot(w, trimmed, 1)
    sign = np.sign(total)
    sign[sign == 0] = np.sign(sign.sum())
    out = np.zeros_like(b)
    for idx in np.ndindex(b.shape):
        agree = [i for i in range(len(taus)) if trimmed[i][idx] != 0 and np.sign(trimmed[i][idx]) == sign[idx]]
        if agree:
            out[idx] = sum(w[i] * trimmed[i][idx] for i in agree) / sum(w[i] for i in agree)
    return b + scale * out


@pytest.mark.parametrize("k, shape, zero", PARAMS)
@pytest.mark.parametrize("density", [0.2, 1.0])
def test_ties(k, shape, zero, density):
    base, models, weights = case(k, SHAPES[shape], zero=zero)
    expected = np_ties(*np_inputs(base, models, weights), density, 0.8)
    np.testing.assert_allclose(merged("ties", base, models, weights, density=density, scale=0.8), expected, atol=1e-5)


def test_ties_is_exact_whatever_the_threads_and_blocks():
    """On values whose sums and means fp32 holds exactly (multiples of 1/8, two equal weights):
    ties at the threshold, exact cancellations and a majority sign of −1 in a 1.1 M-entry tensor
    (the bracketed threshold, the chunked passes). TIES equals the reference bit for bit, with one
    thread or two, in one block or four (the radix threshold, a second read per pass)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randint(-16, 16, (1100, 1000), generator=g).float() / 8
    tau = torch.randint(-12, 8, (2, 1100, 1000), generator=g).float() / 8
    tau[1, :, :30] = -tau[0, :, :30]  # kept by both, they cancel exactly: the majority's sign decides
    models, weights = [base + t for t in tau], torch.ones(2)
    rule = [Rule(pattern="*", method="ties", params={"density": 0.3})]

    def run(threads: int, block_bytes: int = 1 << 30) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            inputs = [{"t": m} for m in models]
            return merge_state_dicts(inputs, weights, rule, base={"t": base}, block_bytes=block_bytes)["t"]
        finally:
            torch.set_num_threads(before)

    expected = np_ties_vectorized(*np_inputs(base, models, weights), 0.3).astype(np.float32)
    two = run(2)
    np.testing.assert_array_equal(two.numpy(), expected)
    assert torch.equal(run(1), two) and torch.equal(run(2, block_bytes=4 << 20), two)


def test_ties_on_a_large_tensor_matches_the_reference():
    base, models, weights = case(3, (1200, 1000), seed=2)
    for m in models:  # exact cancellations at some entries exercise the majority-sign rule
        m.view(-1)[:50] = base.view(-1)[:50]
    expected = np_ties_vectorized(*np_inputs(base, models, weights), 0.3)
    np.testing.assert_allclose(merged("ties", base, models, weights, density=0.3), expected, atol=1e-5)


def np_ties_vectorized(b, taus, w, density):
    k, n = len(taus), taus[0].size
    flat = taus.reshape(k, -1)
    keep = max(1, int(density * n))
    thresholds = np.sort(np.abs(flat), axis=1)[:, ::-1][:, keep - 1 : keep]
    trimmed = np.where(np.abs(flat) >= thresholds, flat, 0.0)
    total = (w[:, None] * trimmed).sum(0)
    sign = np.sign(total)
    sign[sign == 0] = np.sign(sign.sum())
    agree = np.sign(trimmed) == sign
    out = (w[:, None] * trimmed * agree).sum(0) / np.maximum((w[:, None] * agree).sum(0), 1e-38)
    return b + out.reshape(b.shape)


@pytest.mark.parametrize("k, shape, zero", PARAMS)
def test_fisher(k, shape, zero):
    base, models, weights = case(k, SHAPES[shape], zero=zero)
    fishers = torch.rand((k, *SHAPES[shape]), generator=torch.Generator().manual_seed(5))
    fishers[0].view(-1)[:3] = 0.0  # floored
    b, taus, w = np_inputs(base, models, weights)
    f = np.maximum(fishers.double().numpy(), 1e-6) * w.reshape(-1, *([1] * len(SHAPES[shape])))
    expected = (f * (taus + b)).sum(0) / f.sum(0)
    method = get_method("fisher")
    for block_bytes in (1 << 30, 64):  # one block, and one row per block
        inputs = TensorInputs(
            "t",
            base.shape,
            [tensor_reader(m) for m in models],
            ["a"] * k,
            base=tensor_reader(base),
            block_bytes=block_bytes,
            fishers=[tensor_reader(f) for f in fishers],
        )
        out = merge_tensor(method, method.validate({}), inputs, weights / weights.sum(), TensorContext("t"))
        np.testing.assert_allclose(out.numpy(), expected, atol=1e-5)


def test_dare_drops_and_rescales_with_a_seed():
    base, models, weights = case(1, (200, 300))
    out = merged("dare", base, models, weights, drop=0.7)
    tau = (models[0] - base).numpy()
    kept = ~np.isclose(out, base.numpy(), atol=0, rtol=0)
    assert abs(kept.mean() - 0.3) < 0.01
    np.testing.assert_allclose((out - base.numpy())[kept], tau[kept] / 0.3, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out, merged("dare", base, models, weights, drop=0.7))

    def seeded(seed, name="t"):
        rule = [Rule(pattern="*", method="dare", params={"drop": 0.7})]
        return merge_state_dicts([{name: m} for m in models], weights, rule, base={name: base}, seed=seed)[name]

    assert torch.equal(seeded(0), seeded(0)) and not torch.equal(seeded(0), seeded(1))
    assert not torch.equal(seeded(0), seeded(0, "other.tensor"))  # masks differ per tensor name


def test_dare_masks_are_each_entrys_draw_across_generator_stretches_and_blocks():
    """A tensor of 2.1 M entries (three generators' stretches) merged whole and one row per block
    (blocks starting inside a stretch): each entry of τ_k is kept exactly where its own draw says."""
    torch.manual_seed(0)
    base = torch.randn(3, 700_000)
    models = [base + torch.randn(3, 700_000) for _ in range(2)]
    rule = [Rule(pattern="*", method="dare", params={"drop": 0.5})]
    ctx = TensorContext("t", 0)
    keep = [draws(ctx, k, 0, base.numel()).view(3, -1) >= drop_level(0.5) for k in range(2)]
    expected = sum(0.5 * (m - base) * kept for m, kept in zip(models, keep)) * rescale(0.5) + base
    for block_bytes in (1 << 30, 3 * 4 * 700_000):  # one block; one row per block
        out = merge_state_dicts([{"t": m} for m in models], [1, 1], rule, base={"t": base}, block_bytes=block_bytes)
        torch.testing.assert_close(out["t"], expected, rtol=0, atol=1e-5)  # a wrong mask: O(1)


@pytest.mark.parametrize("k, shape, zero", PARAMS)
def test_dare_without_drop_is_linear_and_dare_ties_is_ties(k, shape, zero):
    base, models, weights = case(k, SHAPES[shape], zero=zero)
    np.testing.assert_allclose(
        merged("dare", base, models, weights, drop=0.0, scale=0.5),
        merged("task_arithmetic", base, models, weights, scale=0.5),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        merged("dare", base, models, weights, drop=0.0, combine="ties", density=0.2),
        merged("ties", base, models, weights, density=0.2),
        atol=1e-6,
    )


def np_tsv(taus, w):
    k = len(taus)
    rank = max(1, min(taus.shape[1:]) // k)
    us, ss, vs = [], [], []
    for wi, t in zip(w, taus):
        u, s, vt = np.linalg.svd(wi * t, full_matrices=False)
        us.append(u[:, :rank]), ss.append(s[:rank]), vs.append(vt[:rank].T)
    u, v = np_polar(np.concatenate(us, 1)), np_polar(np.concatenate(vs, 1))
    return u @ np.diag(np.concatenate(ss)) @ v.T


def np_iso_cts(taus, w, common=0.8):
    mean = np.tensordot(w, taus, 1)
    r = min(mean.shape)
    n_common = max(1, int(common * r))
    per_task = (r - n_common) // len(taus)
    u, s, vt = np.linalg.svd(mean, full_matrices=False)
    us, ss, vs = [u[:, :n_common]], [s[:n_common]], [vt[:n_common].T]
    for wi, t in zip(w, taus):
        if per_task == 0:
            break
        residual = (np.eye(mean.shape[0]) - us[0] @ us[0].T) @ (wi * t)
        ut, st, vtt = np.linalg.svd(residual, full_matrices=False)
        us.append(ut[:, :per_task]), ss.append(st[:per_task]), vs.append(vtt[:per_task].T)
    return np.concatenate(ss).mean() * np_polar(np.concatenate(us, 1)) @ np_polar(np.concatenate(vs, 1)).T


def np_iso_c(taus, w):
    mean = np.tensordot(w, taus, 1)
    return np.linalg.svd(mean, compute_uv=False).mean() * np_polar(mean)


SPECTRAL = {"iso_c": np_iso_c, "tsv": np_tsv, "iso_cts": np_iso_cts}


def fp32_tolerance(method, taus, w, scale):
    """Where the merge (fp32) may differ from the float64 reference. Iso-CTS keeps singular directions
    down to the smallest of a task's residual (K = 1: its 5th of 24 is ≈ 0.01): an fp32 SVD moves a
    kept direction by about ε ‖A‖ / σ (Davis–Kahan), and the output carries it at scale · mean(S).
    Measured 1.4e-4 on one such case with torch's default kernels and MKL's SSE4.2 path."""
    if method != "iso_cts" or taus.ndim != 3 or not taus.any():
        return 1e-4
    mean = np.tensordot(w, taus, 1)
    s = np.linalg.svd(mean, compute_uv=False)
    n_common = max(1, int(0.8 * len(s)))
    u = np.linalg.svd(mean)[0][:, :n_common]
    per_task = (len(s) - n_common) // len(taus)
    kept = [s[n_common - 1]]
    for wi, t in zip(w, taus):
        if per_task:
            kept.append(np.linalg.svd((np.eye(len(u)) - u @ u.T) @ (wi * t), compute_uv=False)[per_task - 1])
    eps = np.finfo(np.float32).eps
    return 1e-4 + scale * s.mean() * eps * np.linalg.norm(taus, 2, axis=(1, 2)).max() / min(kept)


@pytest.mark.parametrize("method", sorted(SPECTRAL))
@pytest.mark.parametrize("k, shape, zero", PARAMS)
def test_spectral_methods(method, k, shape, zero):
    """2-D: the reference; other shapes: the weighted average. α scales the update."""
    base, models, weights = case(k, SHAPES[shape], zero=zero)
    b, taus, w = np_inputs(base, models, weights)
    expected = b + (1.5 * SPECTRAL[method](taus, w) if taus.ndim == 3 else np.tensordot(w, taus, 1))
    atol = fp32_tolerance(method, taus, w, 1.5)
    np.testing.assert_allclose(merged(method, base, models, weights, scale=1.5), expected, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("kind", ["gaussian", "power_law"])
@pytest.mark.parametrize("shape", [(256, 256), (128, 320)])
def test_newton_schulz_iso_is_within_1e_3_of_exact(kind, shape):
    m = spectrum_matrix(*shape, "gaussian" if kind == "gaussian" else "power1", "cpu")
    exact = iso(m, "svd")
    fast = iso(m, "newton_schulz", "inner")
    assert ((fast - exact).norm() / exact.norm()) < 1e-3
    # The RMS proxy over-estimates mean(S) by the ratio RMS(S) / mean(S): stated, not hidden.
    s = torch.linalg.svdvals(m)
    rms = iso(m, "newton_schulz", "rms")
    assert torch.allclose(rms.norm() / fast.norm(), s.square().mean().sqrt() / s.mean(), rtol=1e-3)


@pytest.mark.parametrize(
    "orthogonaliser, scale", [("svd", "inner"), ("newton_schulz", "inner"), ("newton_schulz", "rms")]
)
def test_iso_of_a_zero_update_is_zero(orthogonaliser, scale):
    """A frozen tensor's update is 0: its Iso is 0 (not 0 / 0)."""
    assert torch.equal(iso(torch.zeros(8, 6), orthogonaliser, scale), torch.zeros(8, 6))


def test_iso_of_a_low_rank_update_keeps_to_its_support():
    """A LoRA merge's update has rank ≤ Σ r: mean(S) over the directions it has, not over min(m, n)."""
    low = torch.randn(64, 2, generator=torch.Generator().manual_seed(0)) @ torch.randn(2, 48)
    u, s, vh = torch.linalg.svd(low)
    expected = s[:2].mean() * u[:, :2] @ vh[:2]
    exact = iso(low, "svd")
    assert (exact - expected).norm() / expected.norm() < 1e-5 and torch.linalg.matrix_rank(exact) == 2
    # Newton–Schulz lifts the null space's rounding noise (the quintic steps) to about 1 %.
    assert (iso(low, "newton_schulz") - expected).norm() / expected.norm() < 2e-2


def test_iso_c_newton_schulz_through_the_rules():
    base, models, weights = case(4, (64, 48))
    exact = merged("iso_c", base, models, weights)
    fast = merged("iso_c", base, models, weights, orthogonaliser="newton_schulz")
    assert np.linalg.norm(fast - exact) / np.linalg.norm(exact - base.numpy()) < 1e-3


def test_every_method_is_odd_so_pseudo_gradients_work():
    """DiLoCo passes Δ = θ0 − θ = −τ: every method must give −f(τ) for −τ."""
    _, models, weights = case(4, (30, 20))
    taus = [{"t": m} for m in models]
    negated = [{"t": -m} for m in models]
    for method in ("weighted_average", "task_arithmetic", "ties", "dare", "tsv", "iso_c", "iso_cts"):
        rule = [Rule(pattern="*", method=method)]
        pos, neg = merge_state_dicts(taus, weights, rule)["t"], merge_state_dicts(negated, weights, rule)["t"]
        torch.testing.assert_close(neg, -pos, atol=1e-5, rtol=1e-5, msg=method)


def test_ties_stays_odd_when_the_majority_is_a_tie():
    taus = [{"t": torch.tensor([1.0, -1.0, 1.0])}, {"t": torch.tensor([-1.0, -1.0, 1.0])}]
    rule = [Rule(pattern="*", method="ties", params={"density": 1.0})]
    pos = merge_state_dicts(taus, [1, 1], rule)["t"]
    neg = merge_state_dicts([{"t": -t["t"]} for t in taus], [1, 1], rule)["t"]
    assert pos.tolist() == [0.0, -1.0, 1.0] and torch.equal(neg, -pos)


def test_merge_state_dicts_leaves_inputs_untouched():
    base, models, weights = case(3, (10, 10))
    copies = [m.clone() for m in models]
    for method in ("weighted_average", "ties", "dare", "iso_c", "tsv", "iso_cts", "task_arithmetic"):
        merge_state_dicts([{"t": m} for m in models], weights, [Rule(pattern="*", method=method)], base={"t": base})
    assert all(torch.equal(a, b) for a, b in zip(models, copies))


def test_in_memory_inputs_are_validated():
    base, models, weights = case(2, (4, 3))
    with pytest.raises(ValueError, match="2 inputs but 1 weights"):
        merged("ties", base, models, weights[:1])
    with pytest.raises(ValueError, match=r"base: tensor t is \(3,\)"):
        merged("ties", base[0], models, weights)
    nan_base = base.clone()
    nan_base[0, 0] = float("nan")
    for method in ("ties", "task_arithmetic"):
        with pytest.raises(ValueError, match="base: tensor t contains NaN"):
            merged(method, nan_base, models, weights, **({"scale": 0.5} if method == "task_arithmetic" else {}))
    nan_model = models[1].clone()
    nan_model[1, 2] = float("inf")
    with pytest.raises(ValueError, match="input 1: tensor t contains NaN or Inf"):
        merged("weighted_average", base, [models[0], nan_model], weights)
    huge = [torch.full((4, 3), 3e38), torch.full((4, 3), 3e38)]  # finite, their scaled sum is not
    with pytest.raises(ValueError, match="tensor t: the merged values overflow float32"):
        merged("task_arithmetic", torch.zeros(4, 3), huge, weights, scale=2.0)
    with pytest.raises(ValueError, match=r"tensor t: a task vector \(θ_k − θ0\) overflows float32"):
        merged("ties", torch.full((4, 3), -3e38), huge, weights)
    with pytest.raises(ValueError, match="input 1: tensor t contains NaN or Inf"):
        merged("ties", base, [models[0], nan_model], weights)
    steps = [{"t": m, "step": torch.tensor([7])} for m in models]
    out = merge_state_dicts(steps, weights, [Rule(pattern="*", method="iso_c")])
    assert out["step"].dtype == torch.int64 and out["step"].tolist() == [7]


def test_bad_params_and_weights_are_refused():
    with pytest.raises(ValueError, match="ties"):
        Rule(pattern="*", method="ties", params={"density": 2.0})
    with pytest.raises(ValueError, match="unknown merge method"):
        Rule(pattern="*", method="nope")
    with pytest.raises(ValueError, match="nothing would be kept"):
        Rule(pattern="*", method="dare", params={"drop": 0.999995})
    with pytest.raises(ValueError, match="positive"):
        merge_state_dicts([{"t": torch.ones(2)}], [0.0], [Rule(pattern="*", method="linear")])


@pytest.mark.parametrize("method", ["ties", "dare"])
def test_a_small_block_budget_gives_the_same_merge(method):
    """A tensor larger than the budget is merged in row blocks (the 7B embedding × K = 8 does not
    fit a GPU in fp32): the result must not depend on the blocking, DARE's masks and TIES' sign
    fix-up, which reaches back into earlier blocks, included."""
    g = torch.Generator().manual_seed(4)
    base = torch.randint(-8, 8, (1200, 1000), generator=g).float() / 8  # θ0 ± 2 stays exact
    tau = -torch.rand(2, 1200, 1000, generator=g)  # mostly negative: the tensor's majority sign is −1
    rows = torch.arange(0, 1200, 100)  # in every block, entries kept by both that cancel exactly
    tau[0, rows, :20], tau[1, rows, :20] = 2.0, -2.0
    models, weights = [base + t for t in tau], torch.tensor([1.0, 1.0])
    params = {"drop": 0.5, "combine": "ties", "density": 0.3} if method == "dare" else {"density": 0.3}
    rule = [Rule(pattern="*", method=method, params=params)]

    def run(block_bytes):
        return merge_state_dicts([{"t": m} for m in models], weights, rule, base={"t": base}, block_bytes=block_bytes)

    whole, blocked = run(1 << 30)["t"], run(4 << 20)["t"]  # one block; 4 blocks of 349 rows
    torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=1e-6)
    if method == "ties":
        assert torch.equal(whole[rows, :20] - base[rows, :20], torch.full((12, 20), -2.0))  # the majority's
        np.testing.assert_allclose(whole.numpy(), np_ties_vectorized(*np_inputs(base, models, weights), 0.3), atol=1e-5)


def test_bf16_models_over_an_fp32_base_merge_in_fp32():
    base, models, weights = case(3, (40, 17), seed=6)
    low = [m.to(torch.bfloat16) for m in models]
    for method in ("weighted_average", "ties", "iso_c"):
        rule = [Rule(pattern="*", method=method)]
        mixed = merge_state_dicts([{"t": m} for m in low], weights, rule, base={"t": base})["t"]
        exact = merge_state_dicts([{"t": m.float()} for m in low], weights, rule, base={"t": base})["t"]
        assert mixed.dtype == torch.float32 and torch.equal(mixed, exact), method


# The methods shared with mergekit (tests/test_merge_mergekit.py checks their values against it).
TWO_INPUTS = ("slerp", "nuslerp")
SHARED = ("breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "dare_ties", "sce")
SPAN = ("multislerp", "karcher", "model_stock")
PARAMS_OF = {
    "breadcrumbs": {"density": 0.7, "gamma": 0.05},
    "breadcrumbs_ties": {"density": 0.7, "gamma": 0.05},
    "della": {"density": 0.6, "epsilon": 0.2},
    "della_linear": {"density": 0.6, "epsilon": 0.2},
    "dare_ties": {"density": 0.5},
    "sce": {"select_topk": 0.6},
}


@pytest.mark.parametrize("method", SHARED + SPAN + TWO_INPUTS)
def test_the_mergekit_methods_are_odd_and_leave_inputs_untouched(method):
    k = 2 if method in TWO_INPUTS else 4
    _, models, weights = case(k, (30, 20), seed=2)
    copies = [m.clone() for m in models]
    rule = [Rule(pattern="*", method=method, params=PARAMS_OF.get(method, {}))]
    pos = merge_state_dicts([{"t": m} for m in models], weights, rule)["t"]
    neg = merge_state_dicts([{"t": -m} for m in models], weights, rule)["t"]
    torch.testing.assert_close(neg, -pos, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(models, copies))


@pytest.mark.parametrize(
    "method, params",
    [(m, PARAMS_OF[m]) for m in SHARED]
    + [("multislerp", {}), ("model_stock", {"filter_wise": True}), ("model_stock", {})]
    + [("nuslerp", {"nuslerp_flatten": False}), ("nuslerp", {"nuslerp_flatten": False, "nuslerp_row_wise": True})]
    + [("ties", {"density": [0.2, 0.5, 0.3]}), ("dare_ties", {"density": [0.3, 0.5, 0.4], "rescale_norm": "l1"})]
    + [("della", {"density": [0.5, 0.6, 0.7], "epsilon": 0.1, "rescale_norm": "l1"})],
)
def test_the_mergekit_methods_do_not_depend_on_the_block_budget(method, params):
    """A tensor over the budget is read in row blocks, once per pass: the masks, the band's bounds,
    SCE's selection and the span methods' inner products must come out the same."""
    k = 2 if method in TWO_INPUTS else 3
    base, models, weights = case(k, (1200, 1000), seed=5)
    rule = [Rule(pattern="*", method=method, params=params)]

    def run(block_bytes):
        return merge_state_dicts([{"t": m} for m in models], weights, rule, base={"t": base}, block_bytes=block_bytes)

    whole, blocked = run(1 << 30)["t"], run(4 << 20)["t"]  # one block; several of a few hundred rows
    torch.testing.assert_close(blocked - base, whole - base, atol=1e-6, rtol=1e-5)


def test_dare_under_mergekit_names_is_dare():
    base, models, weights = case(3, (40, 17), seed=3)
    ours = merged("dare", base, models, weights, drop=0.6)
    np.testing.assert_allclose(merged("dare_linear", base, models, weights, density=0.4), ours, atol=1e-6)
    ties_mean = merged("dare", base, models, weights, drop=0.6, combine="ties")
    np.testing.assert_allclose(
        merged("dare_ties", base, models, weights, density=0.4, normalize=True), ties_mean, atol=1e-6
    )
    unscaled = merged("dare_linear", base, models, weights, density=0.4, rescale=False)
    kept = 1 - round(0.6 * 2**16) / 2**16  # the share kept at the masks' resolution
    np.testing.assert_allclose(unscaled - base.numpy(), kept * (ours - base.numpy()), atol=1e-6)


def test_breadcrumbs_keeps_the_band_below_the_outliers():
    base, models, weights = case(2, (50, 40), seed=7)
    b, taus, w = np_inputs(base, models, weights)
    n, density, gamma = taus[0].size, 0.6, 0.1
    expected = np.zeros_like(taus)
    for i, t in enumerate(taus):
        order = np.argsort(np.abs(t).ravel())  # ascending
        bottom = n - int(density * n) - int(gamma * n)
        keep = order[bottom : bottom + int(density * n)]
        expected[i].ravel()[keep] = t.ravel()[keep]
    out = merged("breadcrumbs", base, models, weights, density=density, gamma=gamma, scale=0.5)
    np.testing.assert_allclose(out, b + 0.5 * np.tensordot(w, expected, 1), atol=1e-5)


def test_della_keeps_small_entries_less_often_and_rescales_without_bias():
    """MAGPRUNE: q rises linearly with an entry's magnitude rank in its row, from density − ε to
    density + ε: the smallest fifth is kept with probability 0.3 + 0.4 · 0.1 = 0.34 on average,
    the largest 0.66; survivors × 1/q, so the kept values average to τ over many draws."""
    g = torch.Generator().manual_seed(8)
    tau = torch.randn(1, 200, 1000, generator=g)
    rule = [Rule(pattern="*", method="della_linear", params={"density": 0.5, "epsilon": 0.2})]
    out = merge_state_dicts([{"t": tau[0]}], [1.0], rule)["t"]
    kept = out != 0
    order = tau[0].abs().argsort(1)
    smallest, largest = kept.gather(1, order[:, :200]), kept.gather(1, order[:, -200:])
    assert abs(kept.float().mean() - 0.5) < 0.01
    assert abs(smallest.float().mean() - 0.34) < 0.02 and abs(largest.float().mean() - 0.66) < 0.02
    assert abs(float((out * tau[0]).sum() / tau[0].square().sum()) - 1.0) < 0.02  # E[τ̃] = τ
    again = merge_state_dicts([{"t": tau[0]}], [1.0], rule, seed=1)["t"]
    assert torch.equal(merge_state_dicts([{"t": tau[0]}], [1.0], rule)["t"], out) and not torch.equal(again, out)


def test_methods_refuse_the_wrong_number_of_inputs_up_front(tmp_path):
    from pipeline.merge import MergeSpec

    models = [{"path": str(tmp_path / f"m{k}")} for k in range(3)]
    for method, count, message in [
        ("slerp", 3, "exactly 2"),
        ("nuslerp", 1, "exactly 2"),
        ("model_stock", 1, "at least 2"),
    ]:
        with pytest.raises(ValueError, match=f"'{method}' merges {message} inputs, got {count}"):
            MergeSpec(base_model=str(tmp_path), models=models[:count], method=method, out_path=str(tmp_path / "o"))
    _, three, weights = case(3, (4, 3))
    with pytest.raises(ValueError, match="'slerp' merges exactly 2 inputs, got 3"):  # in memory: DiLoCo's rounds
        merge_state_dicts([{"t": m} for m in three], weights, [Rule(pattern="*", method="slerp")])


def test_multislerp_refuses_balanced_antipodal_inputs():
    t = torch.randn(20, 10)
    rule = [Rule(pattern="*", method="multislerp")]
    with pytest.raises(ValueError, match="multislerp has no direction"):
        merge_state_dicts([{"t": t}, {"t": -t}, {"t": t}, {"t": -t}], [1, 1, 1, 1], rule)
    two = merge_state_dicts([{"t": t}, {"t": -t}], [1, 1], rule)["t"]  # two of them: the linear mean, 0
    assert two.abs().max() <= 1e-6
