"""Orthogonalisation for the spectral methods (Iso-C, Iso-CTS, TSV).

``polar(X)`` returns U Vᵀ for X = U S Vᵀ, the closest matrix with orthonormal columns/rows.
Two ways:
- ``svd``: exact, from ``torch.linalg.svd``.
- ``newton_schulz``: iterations X ← a X + (b A + c A²) X with A = X Xᵀ after Frobenius
  normalisation, a schedule of (a, b, c) steps. The default schedule is Muon's quintic
  (3.4445, −4.7750, 2.0315) × 8, which lifts small singular values fast but leaves them in
  ≈ [0.7, 1.2], followed by 4 cubic steps (1.5, −0.5, 0), which converge quadratically to
  exactly 1 from there. Measured errors: ``merit bench isoc`` (docs: benchmarks).

Iso(M) = mean(S) · U Vᵀ over the support of M: the singular directions whose value is above
numerical zero (``support``). A full fine-tune's M has full rank and the support is all of it;
a LoRA merge's M has rank ≤ Σ r_k, and its other singular vectors are an arbitrary basis of the
null space (LAPACK's choice), so a spectral method that used them would give a result that is
not a function of M. Newton–Schulz maps the null space to 0 in exact arithmetic (odd
polynomials; in fp32 its quintic steps lift the null space's rounding noise to about 1 %); with
O = polar(M), mean(S) = ⟨M, O⟩ / ‖O‖_F², so ``scale="inner"`` uses that (exact when O is);
``scale="rms"`` uses ‖M‖_F / √min(m, n) = RMS(S), the cheaper proxy, which over-estimates
mean(S) on steep spectra.
"""

from __future__ import annotations

from typing import Literal

import torch

MUON_QUINTIC = (3.4445, -4.7750, 2.0315)
CUBIC = (1.5, -0.5, 0.0)
DEFAULT_SCHEDULE: tuple[tuple[float, float, float], ...] = (MUON_QUINTIC,) * 8 + (CUBIC,) * 4

Orthogonaliser = Literal["svd", "newton_schulz"]


def support(s: torch.Tensor, shape: tuple[int, ...], top: float | None = None) -> int:
    """How many singular values (descending) are above numerical zero: ``torch.linalg.matrix_rank``'s
    tolerance, σ_max · max(m, n) · ε of fp32, with σ_max that of ``s`` or of the matrix ``s``
    was derived from (``top``: a residual's zero is the original's)."""
    top = float(s[0]) if top is None and len(s) else top or 0.0
    return int((s > top * max(shape) * torch.finfo(torch.float32).eps).sum()) if top > 0 else 0


def newton_schulz(m: torch.Tensor, schedule=DEFAULT_SCHEDULE, eps: float = 1e-7) -> torch.Tensor:
    """Approximate polar factor of a 2-D matrix by Newton–Schulz iterations (fp32)."""
    x = m.float()
    wide = x.shape[0] <= x.shape[1]
    if not wide:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + eps)
    for a, b, c in schedule:
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram) if c else b * gram
        x = a * x + poly @ x
    return x if wide else x.T


def polar(m: torch.Tensor, method: Orthogonaliser = "svd", schedule=DEFAULT_SCHEDULE) -> torch.Tensor:
    if method == "svd":
        u, _, vh = torch.linalg.svd(m.float(), full_matrices=False)
        return u @ vh
    return newton_schulz(m, schedule)


def iso(
    m: torch.Tensor, method: Orthogonaliser = "svd", scale: Literal["inner", "rms"] = "inner", schedule=DEFAULT_SCHEDULE
) -> torch.Tensor:
    """mean(S) · U Vᵀ: the spectrum of ``m`` flattened to its mean (Iso-C's core)."""
    if method == "svd":
        u, s, vh = torch.linalg.svd(m.float(), full_matrices=False)
        r = support(s, m.shape)
        return s[:r].mean() * (u[:, :r] @ vh[:r]) if r else torch.zeros_like(m, dtype=torch.float32)
    o = newton_schulz(m, schedule)
    if scale == "rms":
        return m.float().norm() / min(m.shape) ** 0.5 * o
    support_size = o.square().sum()  # ‖O‖_F²: the support's dimension (0 for M = 0: a frozen tensor)
    return (m.float() * o).sum() / support_size * o if support_size > 0 else torch.zeros_like(o)
