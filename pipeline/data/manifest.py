"""The prepared data's manifest (``data/manifest.json``): what the prepare stage wrote, read by
every later stage and the report without importing the encoders; and the examples' token counts
from the prepared store beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST_PATH = Path("data") / "manifest.json"


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST_PATH
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no data manifest; run `merit prepare` first")
    return json.loads(path.read_text())


def active_sources(manifest: dict[str, Any], role: str | None = "finetune") -> dict[str, dict[str, Any]]:
    """The prepared sources that were not dropped, of one role (None: of every role). A manifest
    written before roles existed holds fine-tuning sources only."""
    return {
        name: info
        for name, info in manifest["sources"].items()
        if not info.get("dropped") and role in (None, info.get("role", "finetune"))
    }


def train_lengths(run_dir: str | Path, sources: list[str]) -> dict[str, np.ndarray]:
    """Each source's training examples' token counts, in order, from the prepared store (its token
    lists' offsets alone: no example is read)."""
    from pipeline.data.store import SourceStore  # the store's readers, only where lengths are asked for

    known = active_sources(read_manifest(run_dir), role=None)
    lengths = {}
    for name in sources:
        counts = SourceStore(Path(run_dir) / known[name]["store"], name, known[name]["origin"]).lengths()
        lengths[name] = np.delete(counts, known[name]["heldout_indices"])
    return lengths
