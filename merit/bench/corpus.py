"""A generated corpus in Vision-FLAN's layout whose examples vary in length as real instruction
data does, for the benchmarks that measure what lengths cost (padding, packing).

Vision-FLAN's release is one annotation JSON (``id``, ``task_name``, ``image`` under the images
folder, ``conversations``) and a folder of images; one source a task. Here every task has an
instruction of its own length (8 to 80 words), every answer a length drawn long-tailed (1 + a
geometric draw of mean 15 words, at most 300) and every image its own size (each side 224 to 1,024
px, so that at the 3B config's pixel bounds an image is 256 to 1,280 tokens). These ranges are this
generator's, chosen once; they are not Vision-FLAN's measured statistics. The words are common
English words, so the tokenizer's pieces per word are those of ordinary text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

WORDS = tuple(
    " ".join(
        (
            "the of and to in is that for it as with was on be by this are from or an which at not but have",
            "image picture shows what color shape object left right top bottom count many number describe",
            "answer question person people animal car tree house sign text table chart graph map scene water",
            "sky road building street window door red blue green yellow black white large small two three",
        )
    ).split()
)
SIDES = (224, 1024)  # pixels, each side drawn alone
INSTRUCTION_WORDS = (8, 80)  # per task
ANSWER_MEAN_WORDS, ANSWER_MOST_WORDS = 15, 300


def write_corpus(folder: Path, tasks: int, per_task: int, seed: int = 0) -> tuple[Path, Path]:
    """Write ``tasks`` × ``per_task`` examples under ``folder``; returns (annotation JSON, images folder).
    The same arguments write the same files."""
    rng = random.Random(f"{seed}/vision-flan-shaped")
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    records = []
    for t in range(tasks):
        task = f"task_{t:03d}"
        instruction = " ".join(rng.choices(WORDS, k=rng.randint(*INSTRUCTION_WORDS)))
        for i in range(per_task):
            name = f"{task}_{i}.png"
            if not (images / name).is_file():  # an image draws from its own generator: rewritten alike
                _image(random.Random(f"{seed}/{name}"), images / name)
            words = min(ANSWER_MOST_WORDS, 1 + _geometric(rng, ANSWER_MEAN_WORDS))
            conversation = [
                {"from": "human", "value": f"<image>\n{instruction}"},
                {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=words))},
            ]
            records.append({"id": f"{task}-{i}", "task_name": task, "image": name, "conversations": conversation})
    annotation = folder / "annotation.json"
    annotation.write_text(json.dumps(records))
    return annotation, images


def _geometric(rng: random.Random, mean: float) -> int:
    """Failures before a success of probability 1 / (1 + mean): a long tail of mean ``mean``."""
    p, n = 1 / (1 + mean), 0
    while rng.random() > p:
        n += 1
    return n


def _image(rng: random.Random, path: Path) -> None:
    """A flat background and one rectangle, at a random size (compresses to a few KB as PNG)."""
    size = (rng.randint(*SIDES), rng.randint(*SIDES))
    image = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    box = sorted(rng.randrange(size[0]) for _ in range(2)), sorted(rng.randrange(size[1]) for _ in range(2))
    ImageDraw.Draw(image).rectangle((box[0][0], box[1][0], box[0][1], box[1][1]), fill=(255, 255, 255))
    image.save(path)
