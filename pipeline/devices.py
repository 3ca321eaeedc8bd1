"""Which of this machine's GPUs a stage may use, and how a child process is told.

Indices are the ones this process sees (``torch.cuda``'s 0…n-1): the flow may itself be limited
to some of the machine's GPUs by ``CUDA_VISIBLE_DEVICES``, by ids (``1,2,3``) or UUIDs
(``GPU-…``, ``MIG-…``). A child started with ``CUDA_VISIBLE_DEVICES=0`` would see the machine's
GPU 0, not the flow's first, so every child's list goes through the parent's (:func:`visible_devices`).
``NVIDIA_VISIBLE_DEVICES`` is the container runtime's: inside the container the GPUs it lets in are
already numbered 0…n-1 and CUDA never reads it, so it needs no mapping.

GPUs held by a local judge server (``eval.judge.gpus``) are left out of every slot, and on a machine
with more than one GPU left, the held-out evaluation and diagnostics take the first and the
benchmark jobs the others, so a benchmark job never shares its GPU with them.
"""

from __future__ import annotations

import os

import torch

from pipeline.config import RunConfig


def visible_devices(gpus: list[int], visible: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child given this process' device indices, through this
    process' own ``CUDA_VISIBLE_DEVICES`` (ids or UUIDs; default: the environment's) when set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else [str(i) for i in range(max(gpus) + 1)]
    if max(gpus) >= len(ids):
        raise ValueError(
            f"GPU {max(gpus)} asked for, but CUDA_VISIBLE_DEVICES={visible} lets this process see {len(ids)}"
        )
    return ",".join(ids[i] for i in gpus)


def usable_gpus(cfg: RunConfig) -> list[int]:
    """The GPUs the run's stages may use: every one this process sees but the judge's."""
    held = set(cfg.eval.judge.gpus) if cfg.eval.judge else set()
    return [i for i in range(torch.cuda.device_count()) if i not in held]


def eval_device(cfg: RunConfig) -> str:
    """Where the held-out evaluation and diagnostics run: ``eval.device``, else the first usable
    GPU, else the CPU."""
    gpus = usable_gpus(cfg)
    return cfg.eval.device or (f"cuda:{gpus[0]}" if gpus else "cpu")


def benchmark_gpus(cfg: RunConfig) -> list[int]:
    """The GPUs of the benchmark jobs: the usable ones but the held-out evaluation's, unless it is
    the only one (then the two share it)."""
    gpus, device = usable_gpus(cfg), eval_device(cfg)
    held = int(device.split(":")[1]) if device.startswith("cuda:") else (0 if device == "cuda" else None)
    rest = [i for i in gpus if i != held]
    return rest or gpus
