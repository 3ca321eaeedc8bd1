"""Hub-shaped caches of data sets, written on disk as ``hf download ID --repo-type dataset`` leaves
them under ``HF_HOME/hub`` (content-addressed blobs, a snapshot of links, ``refs/main``): parquet
files per config and split, a README whose front matter lists the configs. The tests' fixtures and
``merit bench sources`` build their data sets with it; deterministic (drawn images, no randomness).

:func:`write_mixture` writes an instruction mixture of many subsets in the shape of a real one: the
Cauldron's (``images`` + ``texts``) or LLaVA-OneVision-Data's (``image`` + ``conversations``). Its
content exercises the readers and the stages' scale (every subset its own questions and answers),
not the quality of a split.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import datasets
import yaml
from datasets import Dataset, Features, Image, List, Value
from PIL import Image as PILImage
from PIL import ImageDraw

COLORS = [(200, 40, 40), (40, 160, 60), (40, 70, 200), (220, 180, 30), (150, 50, 170), (30, 170, 170)]


def revision(repo_id: str) -> str:
    """The fixed commit hash a test copy of ``repo_id`` is stored under (40 hex digits)."""
    return hashlib.sha1(repo_id.encode()).hexdigest()


def image(i: int, size: int = 56) -> PILImage.Image:
    """A small RGB picture: a coloured square and disc on a light ground, different for each i."""
    img = PILImage.new("RGB", (size, size), (245, 245, 240))
    draw = ImageDraw.Draw(img)
    draw.rectangle([4 + i % 5, 6, 26 + i % 5, 28], fill=COLORS[i % len(COLORS)])
    draw.ellipse([28, 24 + i % 7, 50, 46 + i % 7], fill=COLORS[(i + 2) % len(COLORS)])
    draw.line([0, size - 4, size, 4 + 3 * (i % 4)], fill=(0, 0, 0), width=2)
    return img


def write_dataset_cache(
    hf_home: Path,
    repo_id: str,
    configs: dict[str, dict[str, Dataset]],
    shards: int = 1,
    data_dir: bool = False,
    extra: dict[str, bytes] | None = None,
) -> Path:
    """``repo_id`` as a hub dataset cache under ``hf_home/hub``; returns the snapshot folder.

    ``shards`` parquet files per split: ``data/<split>-00000-of-00001.parquet`` for a data set with
    only the ``default`` config, ``<config>/<split>-...`` for one with several (as the real repos lay
    them out). The card lists each config's ``data_files``, or (``data_dir``) only its folder, as
    some repos' cards do. ``extra``: more files (path in the repo -> bytes), e.g. images or archives.
    """
    repo = Path(hf_home) / "hub" / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision(repo_id)
    single = list(configs) == ["default"]
    card = []
    files: dict[str, Path] = {}
    for config, splits in configs.items():
        folder = "data" if single else config
        card.append(
            {"config_name": config, "data_dir": folder} if data_dir else {"config_name": config, "data_files": []}
        )
        for split, rows in splits.items():
            for shard in range(shards):
                rel = f"{folder}/{split}-{shard:05d}-of-{shards:05d}.parquet"
                files[rel] = repo / "tmp" / rel
                files[rel].parent.mkdir(parents=True, exist_ok=True)
                _to_parquet(rows.shard(shards, shard, contiguous=True), files[rel])
            if not data_dir:
                card[-1]["data_files"].append({"split": split, "path": f"{folder}/{split}-*"})
    for rel, content in (extra or {}).items():
        files[rel] = repo / "tmp" / rel
        files[rel].parent.mkdir(parents=True, exist_ok=True)
        files[rel].write_bytes(content)
    readme = repo / "tmp" / "README.md"
    readme.write_text(f"---\n{yaml.safe_dump({'configs': card}, sort_keys=False)}---\n\n# {repo_id} (test copy)\n")
    files["README.md"] = readme
    # As huggingface_hub stores them: content-addressed blobs, and the snapshot's files link to them.
    for rel, tmp in files.items():
        blob = repo / "blobs" / hashlib.sha256(tmp.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        tmp.replace(blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    shutil.rmtree(repo / "tmp")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision(repo_id))
    return snapshot


def _to_parquet(rows: Dataset, path: Path) -> None:
    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        rows.to_parquet(str(path))
    finally:
        if not quiet:
            datasets.enable_progress_bars()


CAULDRON = Features(
    {
        "images": List(Image()),
        "texts": List({"user": Value("string"), "assistant": Value("string"), "source": Value("string")}),
    }
)
ONEVISION = Features(
    {
        "id": Value("string"),
        "image": Image(),
        "conversations": List({"from": Value("string"), "value": Value("string")}),
        "data_source": Value("string"),
    }
)
WORDS = ["red", "green", "blue", "yellow", "purple", "teal", "left", "right", "up", "down", "one", "two"]


def subset_names(count: int, shape: str) -> list[str]:
    """Subset names as the real mixtures spell them (OneVision's carry parentheses and dashes)."""
    if shape == "cauldron":
        return [f"task_{i:03d}" for i in range(count)]
    return [f"Task-{i:03d}(source {i % 7})" for i in range(count)]


def write_mixture(hf_home: Path, repo_id: str, count: int, rows: int | list[int], shape: str = "cauldron") -> list[str]:
    """A ``count``-subset mixture of ``rows`` examples each (or ``rows[s]`` in subset s), in the
    ``cauldron`` or ``onevision`` shape, as a hub cache under ``hf_home``; returns the subset names."""
    names = subset_names(count, shape)
    sizes = rows if isinstance(rows, list) else [rows] * count
    configs = {name: {"train": _subset(s, sizes[s], shape)} for s, name in enumerate(names)}
    write_dataset_cache(hf_home, repo_id, configs)
    return names


def _subset(s: int, rows: int, shape: str) -> Dataset:
    def answer(i: int) -> str:
        return " ".join(WORDS[(s * 7 + i * 3 + j) % len(WORDS)] for j in range(1 + s % 3))

    question = [f"Task {s}: what does picture {i} show?" for i in range(rows)]
    if shape == "cauldron":
        table = {
            "images": [[image(s + i)] for i in range(rows)],
            "texts": [[{"user": question[i], "assistant": answer(i), "source": f"task_{s}"}] for i in range(rows)],
        }
        return Dataset.from_dict(table, features=CAULDRON)
    table = {
        "id": [f"{s}-{i}" for i in range(rows)],
        "image": [image(s + i) if i % 5 else None for i in range(rows)],  # every fifth example: text only
        "conversations": [
            [
                {"from": "human", "value": ("<image>\n" if i % 5 else "") + question[i]},
                {"from": "gpt", "value": answer(i)},
            ]
            for i in range(rows)
        ],
        "data_source": [f"source {s % 7}"] * rows,
    }
    return Dataset.from_dict(table, features=ONEVISION)
