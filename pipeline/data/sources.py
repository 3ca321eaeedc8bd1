"""Config source entries -> named sources of :class:`Example`, with the bad-record policy applied.

Each source has a role, from the config list that names it: ``finetune`` (``data.sources``: the
branches' data), ``warmup`` (``warmup.sources``: the data that makes θ0) or, for ``eval.sources``,
the entry's own role (``unseen`` or ``retention``: evaluated, never trained on)."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from pipeline.config import DataSection, EvalSourceSpec, SourceSpec
from pipeline.data import builtin
from pipeline.data.example import DataError, Example
from pipeline.data.formats import RecordParser, read_hf_disk_records, read_json_records, read_jsonl_records
from pipeline.data.hub import hub_records, local_datasets

EVAL_ROLES: tuple[str, ...] = get_args(EvalSourceSpec.model_fields["role"].annotation)  # never trained on


@dataclass
class LoadedSources:
    examples: dict[str, list[Example]] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)
    entries: dict[str, SourceSpec] = field(default_factory=dict)  # the config entry of each source
    roles: dict[str, str] = field(default_factory=dict)  # also of the sources dropped whole
    skipped: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # source -> messages
    skipped_by_reason: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # source -> counts

    def add(self, name: str, spec: SourceSpec, examples: list[Example]) -> None:
        if name in self.examples:
            raise ValueError(f"two config entries produce a source named '{name}'")
        self.examples[name], self.formats[name], self.entries[name] = examples, spec.format, spec


class _Policy:
    """``on_bad_record``: ``error`` re-raises the DataError, ``skip`` records it and goes on."""

    def __init__(self, mode: str, loaded: LoadedSources, seed: int):
        self.mode, self.loaded, self.seed = mode, loaded, seed

    def parse_all(
        self, parser: RecordParser, records: Iterable[tuple[int, Any]], limit: int | None, total: int
    ) -> list[Example]:
        """The source's ``total`` records parsed; with ``limit``, a seeded sample of that many
        (fewer when some are bad), in their order, never only the first ones."""
        kept = sampled(total, limit, self.seed, parser.source)
        examples = []
        for position, (index, raw) in enumerate(records):
            if kept is not None and position not in kept:
                continue
            try:
                examples.append(parser.parse(index, raw))
            except DataError as err:
                self.reject(parser.source, err)
        return examples

    def reject(self, source: str, err: DataError) -> None:
        if self.mode == "error":
            raise err
        self.loaded.skipped[source].append(str(err))
        self.loaded.skipped_by_reason[source][err.reason] += 1


def sampled(total: int, limit: int | None, seed: int, source: str) -> set[int] | None:
    """The positions a source with ``limit`` keeps of its ``total`` records: a sample seeded by the
    run's seed and the source's name (None: all of them)."""
    if limit is None or limit >= total:
        return None
    return set(random.Random(f"{seed}:{source}").sample(range(total), limit))


def load_sources(
    data: DataSection, seed: int, warmup: list[SourceSpec] | None = None, evaluated: list[EvalSourceSpec] = ()
) -> LoadedSources:
    """The sources of ``data.sources`` and of the run's ``warmup.sources`` and ``eval.sources``
    (``warmup`` and ``evaluated``), each with its role; every list given must yield a source."""
    loaded = LoadedSources()
    policy = _Policy(data.on_bad_record, loaded, seed)
    lists = {
        "data.sources": [(spec, "finetune") for spec in data.sources],
        "warmup.sources": [(spec, "warmup") for spec in warmup or []],
        "eval.sources": [(spec, spec.role) for spec in evaluated],
    }
    for where, entries in lists.items():
        before = len(loaded.examples)
        for spec, role in entries:
            generated = _load_entry(spec, data, seed, policy)
            loaded.roles |= dict.fromkeys([spec.name, *generated], role)  # spec.name: its records' skips
            for name, examples in generated.items():
                if not examples:
                    origin = spec.path or f"builtin:{name}"
                    policy.reject(name, DataError(origin, None, f"source '{name}' has no examples"))
                    continue
                loaded.add(name, spec, examples)
        if (entries or where == "data.sources") and len(loaded.examples) == before:
            raise DataError(f"config {where}", None, "no source has any example")
    return loaded


def _load_entry(spec: SourceSpec, data: DataSection, seed: int, policy: _Policy) -> dict[str, list[Example]]:
    if spec.format == "builtin":
        return builtin.generate(spec.tasks, data.builtin, seed, spec.suite, spec.max_examples)
    if spec.format == "hub":
        return _load_hub(spec, policy)
    path = Path(spec.path)
    if not path.exists():
        raise DataError(str(path), None, f"source '{spec.name}': file not found")
    images_dir = Path(spec.images_dir) if spec.images_dir else (path if path.is_dir() else path.parent)
    if spec.format == "vision_flan":
        return _load_vision_flan(spec, path, images_dir, policy)
    readers = {
        "llava": lambda: list(enumerate(read_json_records(path))),
        "sharegpt": lambda: list(enumerate(read_json_records(path))),
        "jsonl": lambda: list(read_jsonl_records(path)),
        "hf_disk": lambda: _indexed(read_hf_disk_records(path)),
    }
    parser, records = RecordParser(spec.name, path, images_dir), readers[spec.format]()
    return {spec.name: policy.parse_all(parser, records, spec.max_examples, len(records))}


class _indexed:
    """A ``datasets.Dataset``'s rows as ``(index, row)``, with its length, read as iterated."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return enumerate(self.dataset)


def _load_hub(spec: SourceSpec, policy: _Policy) -> dict[str, list[Example]]:
    """One source per subset (or per value of ``source_column``) of a hub data set."""
    out = {}
    with local_datasets():
        for name, parser, records, total in hub_records(spec):
            out[name] = policy.parse_all(parser, records, spec.max_examples, total)
    return out


def _load_vision_flan(spec: SourceSpec, path: Path, images_dir: Path, policy: _Policy) -> dict[str, list[Example]]:
    """One annotation file, one source per ``task_name`` (optionally only ``spec.tasks``)."""
    by_task: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for index, raw in enumerate(read_json_records(path)):
        task = raw.get("task_name") if isinstance(raw, dict) else None
        if not isinstance(task, str) or not task:
            policy.reject(spec.name, DataError(str(path), index, "Vision-FLAN record without 'task_name'"))
            continue
        by_task[task].append((index, raw))
    wanted = spec.tasks or sorted(by_task)
    missing = sorted(set(wanted) - set(by_task))
    if missing:
        raise DataError(str(path), None, f"tasks not in the annotation file: {missing}")
    return {
        task: policy.parse_all(
            RecordParser(task, path, images_dir), by_task[task], spec.max_examples, len(by_task[task])
        )
        for task in wanted
    }
