"""``merit bench isoc``: Iso-C's exact SVD path vs the Newton–Schulz path, time and relative
error against exact Iso-C, on 1024², 2048² and 2048×5632 fp32 matrices with three spectra:
Gaussian (Marchenko–Pastur, a noise-like update), σ_i ∝ i^-0.5 and σ_i ∝ 1/i (steep, like
accumulated pseudo-gradients). Newton–Schulz runs with both scale estimates, in full fp32 and,
on a GPU, also with TF32 matmuls (``torch.backends.cuda.matmul.allow_tf32``)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.merge.linalg import iso

SHAPES = ((1024, 1024), (2048, 2048), (2048, 5632))
SPECTRA = ("gaussian", "power0.5", "power1")


def spectrum_matrix(m: int, n: int, spectrum: str, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    if spectrum == "gaussian":
        return torch.randn(m, n, generator=g, device=device)
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, r, generator=g, device=device))
    v, _ = torch.linalg.qr(torch.randn(n, r, generator=g, device=device))
    power = float(spectrum.removeprefix("power"))
    return (u * torch.arange(1, r + 1, device=device).float() ** -power) @ v.T


def timed(fn, device: str, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (kernels, workspaces)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def shape(text: str) -> tuple[int, int]:
    """``MxN`` → (M, N)."""
    try:
        m, n = (int(side) for side in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is MxN, e.g. 1024x1024") from None
    return m, n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per case (median)")
    parser.add_argument(
        "--shapes",
        type=shape,
        nargs="+",
        default=list(SHAPES),
        metavar="MxN",
        help="matrix shapes (default: 1024x1024 2048x2048 2048x5632)",
    )


def main(args: argparse.Namespace) -> None:
    device = args.device
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"Iso-C orthogonalisation on {name}, fp32, median of {args.repeats}")
    tf32 = device == "cuda"
    print(
        f"{'shape':>11} {'spectrum':>9} {'svd s':>8} {'NS s':>8} {'speed-up':>8} {'err inner':>10} {'err rms':>8}"
        + (f" {'NS tf32 s':>9} {'speed-up':>8} {'err tf32':>9}" if tf32 else "")
    )
    for m, n in args.shapes:
        for spectrum in SPECTRA:
            matrix = spectrum_matrix(m, n, spectrum, device)
            svd_s, exact = timed(lambda matrix=matrix: iso(matrix, "svd"), device, args.repeats)
            ns_s, fast = timed(lambda matrix=matrix: iso(matrix, "newton_schulz", "inner"), device, args.repeats)
            rms = iso(matrix, "newton_schulz", "rms")
            err = float((fast - exact).norm() / exact.norm())
            err_rms = float((rms - exact).norm() / exact.norm())
            line = (
                f"{m:>5}x{n:<5} {spectrum:>9} {svd_s:8.3f} {ns_s:8.3f} {svd_s / ns_s:7.1f}x {err:10.2e} {err_rms:8.3f}"
            )
            if tf32:
                torch.backends.cuda.matmul.allow_tf32 = True
                tf32_s, approx = timed(
                    lambda matrix=matrix: iso(matrix, "newton_schulz", "inner"), device, args.repeats
                )
                torch.backends.cuda.matmul.allow_tf32 = False
                line += f" {tf32_s:9.4f} {svd_s / tf32_s:7.1f}x {float((approx - exact).norm() / exact.norm()):9.2e}"
            print(line)
