"""Write the frozen inputs of the golden loss curve: θ0 (the tiny model and its processor as a
folder, read as a downloaded model is) and a LLaVA-format data file with its images, so that no
change to the built-in corpus or the tiny model's builder can move the curve. Run it only to
change those inputs on purpose, then re-record the curve (``pytest --update-golden``) in the
same commit, saying why:

    python tests/golden/freeze.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from merit.cli import main as merit
from pipeline.data.builtin import make_example

HERE = Path(__file__).parent
SOURCES, PER_SOURCE, IMAGE_SIZE = ("colour_name", "add_digits", "caption"), 24, 112


def freeze_theta0(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        demo = HERE.parent.parent / "configs" / "demo.yaml"
        assert merit(["init", str(demo), "--run-dir", tmp, "--set", "warmup.steps=0"]) == 0
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(Path(tmp) / "init", out, ignore=shutil.ignore_patterns("manifest.json", ".*"))


def freeze_data(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    (out / "images").mkdir(parents=True)
    records = []
    for source in SOURCES:
        for i in range(PER_SOURCE):
            example = make_example(source, i, seed=0, image_size=IMAGE_SIZE)
            user, answer = example.messages
            question = next(c["text"] for c in user["content"] if c["type"] == "text")
            record = {"conversations": [{"from": "gpt", "value": answer["content"][0]["text"]}]}
            if example.images:
                name = f"images/{source}-{i}.png"
                example.load_images()[0].save(out / name, optimize=True)
                record["image"], question = name, f"<image>\n{question}"
            record["conversations"].insert(0, {"from": "human", "value": question})
            records.append(record)
    (out / "golden.json").write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    freeze_theta0(HERE / "theta0")
    freeze_data(HERE / "data")
