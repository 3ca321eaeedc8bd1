"""Hub-shaped caches of the MERIT paper's lmms-eval benchmark data sets, a few items each.

``write_paper_datasets(hf_home)`` lays out, under ``HF_HOME/hub``, what ``hf download ID --repo-type
dataset`` leaves for each of the 8 benchmarks (blobs, ``refs/main``, a snapshot of symlinks): parquet
files with the real data sets' columns, column types, configs and splits (as lmms-eval's task utils
read them) and a README whose front matter lists the configs. Deterministic: drawn images, no
randomness.
"""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, Features, Image, Sequence, Value

from merit.bench.hub_cache import COLORS, image, revision, write_dataset_cache  # noqa: F401  (tests import them here)

# lmms-eval task -> the hub data set its YAML names (the mathvista group's three subtasks share one).
PAPER_TASKS = {
    "seedbench": "lmms-lab-encoder/SEED-Bench",
    "mmbench_en_dev": "lmms-lab-encoder/MMBench",
    "ai2d": "lmms-lab-encoder/ai2d",
    "textvqa_val": "lmms-lab-encoder/textvqa",
    "mmmu_val": "lmms-lab-encoder/MMMU",
    "mathvista_testmini": "AI4Math/MathVista",
    "llava_in_the_wild": "lmms-lab-encoder/llava-bench-in-the-wild",
    "mmvet": "lmms-lab-encoder/MMVet",
}


def write_paper_datasets(hf_home: Path, items: int = 4) -> dict[str, str]:
    """The 8 benchmarks' data sets, ``items`` rows in each split lmms-eval reads; task -> repo id."""
    writers = {
        "seedbench": _seedbench,
        "mmbench_en_dev": _mmbench,
        "ai2d": _ai2d,
        "textvqa_val": _textvqa,
        "mmmu_val": _mmmu,
        "mathvista_testmini": _mathvista,
        "llava_in_the_wild": _llava_wild,
        "mmvet": _mmvet,
    }
    for task, repo_id in PAPER_TASKS.items():
        write_dataset_cache(hf_home, repo_id, writers[task](items))
    return dict(PAPER_TASKS)


def _table(rows: list[dict], features: Features) -> Dataset:
    return Dataset.from_dict({k: [r[k] for r in rows] for k in features}, features=features)


LETTERS = "ABCD"
SHAPES = ["square", "circle", "triangle", "star"]


def _seedbench(n: int) -> dict[str, dict[str, Dataset]]:
    # lmms-lab/SEED-Bench: one split, images as a list (one picture for image questions, frames for video).
    features = Features(
        {
            "answer": Value("string"),
            **{f"choice_{c}": Value("string") for c in "abcd"},
            "data_id": Value("string"),
            "data_type": Value("string"),
            "question": Value("string"),
            "question_id": Value("string"),
            "question_type_id": Value("int16"),
            "image": Sequence(Image()),
            "segment": Sequence(Value("int64")),
        }
    )
    rows = [
        {
            "answer": LETTERS[i % 4],
            **{f"choice_{c}": f"a {SHAPES[(i + k) % 4]}" for k, c in enumerate("abcd")},
            "data_id": f"{1454426 + i}_{2591111986 + i}.jpg",
            "data_type": "image",
            "question": f"What shape is drawn in the top left corner of picture {i}?",
            "question_id": str(101669 + i),
            "question_type_id": 1 + i % 9,
            "image": [image(i)],
            "segment": None,
        }
        for i in range(n)
    ]
    return {"default": {"test": _table(rows, features)}}


MMBENCH_CATEGORIES = [
    ("image_scene", "coarse_perception"),
    ("attribute_recognition", "finegrained_perception (instance-level)"),
    ("spatial_relationship", "relation_reasoning"),
    ("physical_property_reasoning", "attribute_reasoning"),
]


def _mmbench(n: int) -> dict[str, dict[str, Dataset]]:
    # lmms-lab/MMBench: configs cc (test), cn and en (dev, test); `hint` is null when there is none.
    columns = {
        "index": Value("int64"),
        "question": Value("string"),
        "hint": Value("string"),
        "answer": Value("string"),
        **{c: Value("string") for c in LETTERS},
        "category": Value("string"),
        "image": Image(),
        "source": Value("string"),
        "L2-category": Value("string"),
        "comment": Value("string"),
        "split": Value("string"),
    }

    def rows(split: str, lang: str) -> list[dict]:
        out = []
        for i in range(n):
            category, l2 = MMBENCH_CATEGORIES[i % len(MMBENCH_CATEGORIES)]
            colour = ["red", "green", "blue", "yellow"]
            question = f"Which colour is the square in picture {i}?" if lang == "en" else f"图{i}中正方形是什么颜色?"
            out.append(
                {
                    "index": 1000 * (split == "test") + i,
                    "question": question,
                    "hint": None if i % 2 else f"The picture shows shapes (item {i}).",
                    "answer": LETTERS[(i * 3 + 1) % 4],
                    **{c: colour[(k + i) % 4] for k, c in enumerate(LETTERS)},
                    "category": category,
                    "image": image(i + 10),
                    "source": "MMBench" if i % 3 else "COCO",
                    "L2-category": l2,
                    "comment": None,
                    "split": split,
                }
            )
        return out

    full = Features(columns)
    cc = Features({k: v for k, v in columns.items() if k not in ("hint", "L2-category", "comment", "split")})
    return {
        "cc": {"test": _table(rows("test", "cn"), cc)},
        "cn": {split: _table(rows(split, "cn"), full) for split in ("dev", "test")},
        "en": {split: _table(rows(split, "en"), full) for split in ("dev", "test")},
    }


def _ai2d(n: int) -> dict[str, dict[str, Dataset]]:
    # lmms-lab/ai2d: options a list of strings, answer the index of the right one as a string.
    features = Features(
        {"question": Value("string"), "options": Sequence(Value("string")), "answer": Value("string"), "image": Image()}
    )
    stages = ["egg", "larva", "pupa", "adult", "nymph"]
    rows = [
        {
            "question": f"Which stage comes after stage {i} in the diagram?",
            "options": [stages[(i + k) % 5] for k in range(3 + i % 2)],  # 3 or 4 options, as in AI2D
            "answer": str(i % (3 + i % 2)),
            "image": image(i + 20),
        }
        for i in range(n)
    ]
    return {"default": {"test": _table(rows, features)}}


def _textvqa(n: int) -> dict[str, dict[str, Dataset]]:
    # lmms-lab/textvqa: ten human answers per question; the test split has none.
    features = Features(
        {
            "image_id": Value("string"),
            "question_id": Value("int32"),
            "question": Value("string"),
            "question_tokens": Sequence(Value("string")),
            "image": Image(),
            "image_width": Value("int32"),
            "image_height": Value("int32"),
            "flickr_original_url": Value("string"),
            "flickr_300k_url": Value("string"),
            "answers": Sequence(Value("string")),
            "image_classes": Sequence(Value("string")),
            "set_name": Value("string"),
            "ocr_tokens": Sequence(Value("string")),
        }
    )
    words = ["stop", "exit", "open", "cafe", "bus 12"]

    def rows(split: str, offset: int) -> list[dict]:
        out = []
        for i in range(n):
            word = words[i % len(words)]
            question = f"what word is written on the sign {i}?"
            out.append(
                {
                    "image_id": f"{0xA0F0 + offset + i:016x}",
                    "question_id": offset + i,
                    "question": question,
                    "question_tokens": question.rstrip("?").split(),
                    "image": image(i + 30),
                    "image_width": 56,
                    "image_height": 56,
                    "flickr_original_url": f"https://farm1.staticflickr.com/{offset + i}_o.jpg",
                    "flickr_300k_url": f"https://c1.staticflickr.com/{offset + i}_z.jpg",
                    "answers": None if split == "test" else [word] * 7 + [word.upper(), f"{word}!", "unanswerable"],
                    "image_classes": ["Sign", "Street"],
                    "set_name": split if split != "validation" else "val",
                    "ocr_tokens": [word, "street"],
                }
            )
        return out

    splits = {"train": 0, "validation": 34602, "test": 39602}
    return {"default": {split: _table(rows(split, offset), features) for split, offset in splits.items()}}


def _mmmu(n: int) -> dict[str, dict[str, Dataset]]:
    # lmms-lab/MMMU: `options` is the string form of a list, images in image_1..image_7, ids
    # "<split>_<Subject>_<n>"; multiple-choice answers are letters, open ones the value.
    features = Features(
        {
            "id": Value("string"),
            "question": Value("string"),
            "options": Value("string"),
            "explanation": Value("string"),
            **{f"image_{k}": Image() for k in range(1, 8)},
            "img_type": Value("string"),
            "answer": Value("string"),
            "topic_difficulty": Value("string"),
            "question_type": Value("string"),
            "subfield": Value("string"),
        }
    )
    subjects = [("Accounting", "Financial Accounting"), ("Math", "Geometry"), ("Physics", "Optics")]

    def rows(split: str) -> list[dict]:
        out = []
        for i in range(n):
            subject, subfield = subjects[i % len(subjects)]
            two = i % 3 == 2  # a question with two pictures
            row = {
                "id": f"{split}_{subject}_{i + 1}",
                "explanation": "",
                **{f"image_{k}": None for k in range(1, 8)},
                "img_type": "['Diagrams']",
                "topic_difficulty": ["Easy", "Medium", "Hard"][i % 3],
                "subfield": subfield,
                "image_1": image(i + 40),
            }
            if two:
                row["image_2"] = image(i + 41)
            if i % 2 == 0:
                right = (i // 2 + 2) % 4
                options = ["2", "3", "5"]
                options.insert(right, "4")
                row |= {
                    "question": f"<image 1> How many corners does the square have?{' Compare <image 2>.' * two}",
                    "options": str(options),
                    "answer": LETTERS[right],
                    "question_type": "multiple-choice",
                }
            else:
                row |= {
                    "question": f"What is the width in pixels of <image 1>?{' And of <image 2>?' * two}",
                    "options": "[]",
                    "answer": "56",
                    "question_type": "open",
                }
            out.append(row)
        return out

    return {"default": {split: _table(rows(split), features) for split in ("dev", "validation", "test")}}


def _mathvista(n: int) -> dict[str, dict[str, Dataset]]:
    # AI4Math/MathVista: decoded_image holds the picture (image its file name), choices null for
    # free-form questions, precision set for float answers, metadata a struct the aggregation reads.
    features = Features(
        {
            "pid": Value("string"),
            "question": Value("string"),
            "image": Value("string"),
            "decoded_image": Image(),
            "choices": Sequence(Value("string")),
            "unit": Value("string"),
            "precision": Value("float64"),
            "answer": Value("string"),
            "question_type": Value("string"),
            "answer_type": Value("string"),
            "metadata": {
                "category": Value("string"),
                "context": Value("string"),
                "grade": Value("string"),
                "img_height": Value("int64"),
                "img_width": Value("int64"),
                "language": Value("string"),
                "skills": Sequence(Value("string")),
                "source": Value("string"),
                "split": Value("string"),
                "task": Value("string"),
            },
            "query": Value("string"),
        }
    )
    kinds = [
        ("multi_choice", "text", ["35°", "45°", "55°", "65°"], None, "45°", None),
        ("free_form", "integer", None, None, "4", None),
        ("free_form", "float", None, 1.0, "2.5", "cm"),
        ("free_form", "float", None, 2.0, "0.25", None),
    ]

    def rows(split: str) -> list[dict]:
        out = []
        for i in range(n):
            question_type, answer_type, choices, precision, answer, unit = kinds[i % len(kinds)]
            question = f"What is the measure asked about in figure {i}?"
            hint = "Hint: Please answer the question and provide the final answer at the end."
            query = f"{hint}\nQuestion: {question}" + (
                "\nChoices:\n" + "\n".join(f"({LETTERS[k]}) {c}" for k, c in enumerate(choices)) if choices else ""
            )
            out.append(
                {
                    "pid": str(i + 1),
                    "question": question,
                    "image": f"images/{i + 1}.jpg",
                    "decoded_image": image(i + 50),
                    "choices": choices,
                    "unit": unit,
                    "precision": precision,
                    "answer": answer if split == "testmini" else "",
                    "question_type": question_type,
                    "answer_type": answer_type,
                    "metadata": {
                        "category": ["math-targeted-vqa", "general-vqa"][i % 2],
                        "context": ["geometry diagram", "synthetic scene", "function plot", "table"][i % 4],
                        "grade": ["high school", "elementary school", "college", "daily life"][i % 4],
                        "img_height": 56,
                        "img_width": 56,
                        "language": "english",
                        "skills": [["geometry reasoning", "algebraic reasoning"], ["arithmetic reasoning"]][i % 2],
                        "source": ["Geometry3K", "CLEVR-Math", "FunctionQA", "TabMWP"][i % 4],
                        "split": split,
                        "task": ["geometry problem solving", "math word problem", "textbook question answering"][i % 3],
                    },
                    "query": query,
                }
            )
        return out

    return {"default": {split: _table(rows(split), features) for split in ("testmini", "test")}}


def _llava_wild(n: int) -> dict[str, dict[str, Dataset]]:
    # lmms-lab/llava-bench-in-the-wild: one split, `train`; the judge reads caption and gpt_answer.
    features = Features(
        {
            "question_id": Value("int8"),
            "question": Value("string"),
            "image": Image(),
            "caption": Value("string"),
            "gpt_answer": Value("string"),
            "category": Value("string"),
            "image_id": Value("string"),
        }
    )
    categories = ["conv", "detail", "complex"]
    rows = [
        {
            "question_id": i,
            "question": ["What is in the picture?", "Describe the picture in detail.", "Why might it be drawn?"][i % 3],
            "image": image(i + 60),
            "caption": f"A coloured square and a disc crossed by a line (picture {i}).",
            "gpt_answer": f"The picture shows a square, a disc and a black line (picture {i}).",
            "category": categories[i % 3],
            "image_id": f"{i + 1:03d}",
        }
        for i in range(n)
    ]
    return {"default": {"train": _table(rows, features)}}


def _mmvet(n: int) -> dict[str, dict[str, Dataset]]:
    # lmms-lab/MMVet: capability a comma-separated string of rec, ocr, know, gen, spat, math.
    features = Features(
        {
            "question_id": Value("string"),
            "image": Image(),
            "question": Value("string"),
            "answer": Value("string"),
            "image_source": Value("string"),
            "capability": Value("string"),
        }
    )
    capabilities = ["rec", "ocr,spat", "rec,know,gen", "ocr,math"]
    rows = [
        {
            "question_id": f"v1_{i}",
            "image": image(i + 70),
            "question": f"How many shapes are in picture {i}?",
            "answer": "2<OR>two",
            "image_source": "synthetic",
            "capability": capabilities[i % len(capabilities)],
        }
        for i in range(n)
    ]
    return {"default": {"test": _table(rows, features)}}
