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
import io
import os
import random
import shutil
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
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
    return _publish(repo, repo_id, files, card)


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


# The Cauldron's parquet schema, and the rows per row group ``datasets`` writes for image data.
CAULDRON_SCHEMA = pa.schema(
    [
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("texts", pa.list_(pa.struct([("user", pa.string()), ("assistant", pa.string()), ("source", pa.string())]))),
    ]
)
IMAGE_ROW_GROUP = 100
SIDES = (28, 56, 96, 160, 240, 336, 448)  # image sides drawn from (aspect ratios from 1:2 to 2:1)


def write_large_mixture(hf_home: Path, repo_id: str, subsets: int, rows: int, shards: int = 2, seed: int = 0) -> dict:
    """A Cauldron-shaped mixture of ``subsets`` × ``rows`` examples at the scale of the real ones,
    written with pyarrow (``datasets``' encoding of every image would take longer than what it
    measures): 1 to 3 turns a row, one image (two in every tenth row) of a side and aspect ratio
    drawn from ``SIDES``, ``shards`` parquet files a subset in row groups of ``IMAGE_ROW_GROUP``, and
    one corrupt image (row 7 of the first subset). The images are drawn once per size and
    reused (prepare reads every one's header all the same). Returns what was written."""
    rng = random.Random(seed)
    pictures = {}
    for w in SIDES:
        for h in SIDES:
            if 0.5 <= w / h <= 2:
                buffer = io.BytesIO()
                image(len(pictures)).resize((w, h)).save(buffer, format="PNG")
                pictures[w, h] = buffer.getvalue()
    sizes = list(pictures)
    repo = Path(hf_home) / "hub" / f"datasets--{repo_id.replace('/', '--')}"
    tmp = repo / "tmp"
    files, card, names = {}, [], subset_names(subsets, "cauldron")
    for s, name in enumerate(names):
        card.append({"config_name": name, "data_files": [{"split": "train", "path": f"{name}/train-*"}]})
        per_shard = -(-rows // shards)
        for shard in range(shards):
            count = min(per_shard, rows - shard * per_shard)
            images, texts = [], []
            for i in range(shard * per_shard, shard * per_shard + count):
                n = 2 if i % 10 == 9 else 1
                data = [pictures[rng.choice(sizes)] for _ in range(n)]
                if s == 0 and i == 7:
                    data[0] = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40  # a corrupt image: its header does not read
                images.append([{"bytes": b, "path": None} for b in data])
                turns = rng.randint(1, 3)
                texts.append(
                    [
                        {
                            "user": f"Task {s}, picture {i}, question {t}: "
                            + " ".join(rng.choices(WORDS, k=rng.randint(4, 24))),
                            "assistant": " ".join(rng.choices(WORDS, k=rng.randint(1, 12))),
                            "source": name,
                        }
                        for t in range(turns)
                    ]
                )
            rel = f"{name}/train-{shard:05d}-of-{shards:05d}.parquet"
            files[rel] = tmp / rel
            files[rel].parent.mkdir(parents=True, exist_ok=True)
            table = pa.Table.from_pydict({"images": images, "texts": texts}, schema=CAULDRON_SCHEMA)
            pq.write_table(table, files[rel], row_group_size=IMAGE_ROW_GROUP)
    _publish(repo, repo_id, files, card)
    return {"subsets": subsets, "rows": subsets * rows, "corrupt": f"{names[0]} row 7"}


def _publish(repo: Path, repo_id: str, files: dict[str, Path], card: list[dict]) -> Path:
    """``files`` (path in the repo -> where they are now) and a card listing ``card``'s configs, stored
    as huggingface_hub stores a download: content-addressed blobs, a snapshot of links to them."""
    snapshot = repo / "snapshots" / revision(repo_id)
    readme = repo / "tmp" / "README.md"
    readme.parent.mkdir(parents=True, exist_ok=True)
    readme.write_text(f"---\n{yaml.safe_dump({'configs': card}, sort_keys=False)}---\n\n# {repo_id} (test copy)\n")
    files = {**files, "README.md": readme}
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
