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
from pipeline.data.formats import RecordParser, hf_disk_files, read_json_records, read_jsonl_records
from pipeline.data.hub import HubDataset, SubsetTable, local_datasets, subset_records

EVAL_ROLES: tuple[str, ...] = get_args(EvalSourceSpec.model_fields["role"].annotation)  # never trained on


@dataclass
class LoadedSources:
    """Every source's examples in memory (:func:`load_sources`: for small corpora and tests; the
    prepare stage streams each :class:`Task` into the store instead)."""

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


class Policy:
    """``on_bad_record``: ``error`` re-raises the DataError, ``skip`` records it (by source and
    reason) and goes on."""

    def __init__(self, mode: str, seed: int):
        self.mode, self.seed = mode, seed
        self.skipped: dict[str, list[str]] = defaultdict(list)
        self.skipped_by_reason: dict[str, Counter] = defaultdict(Counter)

    def parsed(
        self, parser: RecordParser, records: Iterable[tuple[int, Any]], limit: int | None, total: int
    ) -> Iterator[Example]:
        """The source's ``total`` records parsed as they are read; with ``limit``, a seeded sample of
        that many (fewer when some are bad), in their order, never only the first ones."""
        kept = sampled(total, limit, self.seed, parser.source)
        for position, (index, raw) in enumerate(records):
            if kept is not None and position not in kept:
                continue
            try:
                yield parser.parse(index, raw)
            except DataError as err:
                self.reject(parser.source, err)

    def reject(self, source: str, err: DataError) -> None:
        if self.mode == "error":
            raise err
        self.skipped[source].append(str(err))
        self.skipped_by_reason[source][err.reason] += 1


def sampled(total: int, limit: int | None, seed: int, source: str) -> set[int] | None:
    """The positions a source with ``limit`` keeps of its ``total`` records: a sample seeded by the
    run's seed and the source's name (None: all of them)."""
    if limit is None or limit >= total:
        return None
    return set(random.Random(f"{seed}:{source}").sample(range(total), limit))


@dataclass(frozen=True)
class Task:
    """One unit of the prepare stage's parallel work: a config entry, or one subset of a hub entry
    (a mixture's subsets are prepared side by side). ``listed``: the config list that names it."""

    spec: SourceSpec
    role: str
    listed: str
    subset: str | None = None
    hub: HubDataset | None = None

    @property
    def label(self) -> str:
        return self.spec.name if self.subset is None else f"{self.spec.name}/{self.subset}"

    def inputs(self) -> list[Path]:
        """The files it reads (their sizes and times tell whether what it prepared is current)."""
        if self.hub is not None:
            return self.hub.data_files(self.subset)
        return [] if self.spec.format == "builtin" else [Path(self.spec.path)]

    def sources(self, data: DataSection, policy: Policy) -> Iterator[tuple[str, Iterable[Example]]]:
        """``(source name, its examples, streamed)``, the bad-record policy applied."""
        spec = self.spec
        if spec.format == "builtin":
            yield from builtin.generate(spec.tasks, data.builtin, policy.seed, spec.suite, spec.max_examples).items()
            return
        if self.hub is not None:
            for name, parser, records, total in subset_records(self.hub, self.subset):
                yield name, policy.parsed(parser, records, spec.max_examples, total)
            return
        path = Path(spec.path)
        if not path.exists():
            raise DataError(str(path), None, f"source '{spec.name}': file not found")
        images_dir = Path(spec.images_dir) if spec.images_dir else (path if path.is_dir() else path.parent)
        if spec.format == "vision_flan":
            yield from _vision_flan(spec, path, images_dir, policy)
            return
        if spec.format == "hf_disk":
            table = SubsetTable(hf_disk_files(path), None, str(path), spec.name)
            records = ((row, record) for row, _, record in table.records(None, keep_bytes=True))
            yield (
                spec.name,
                policy.parsed(RecordParser(spec.name, path, images_dir), records, spec.max_examples, table.rows),
            )
            return
        readers = {
            "llava": lambda: enumerate(read_json_records(path)),
            "sharegpt": lambda: enumerate(read_json_records(path)),
            "jsonl": lambda: read_jsonl_records(path),
        }
        read = readers[spec.format]
        total = sum(1 for _ in read()) if spec.max_examples is not None else 0  # a sample needs the count first
        yield spec.name, policy.parsed(RecordParser(spec.name, path, images_dir), read(), spec.max_examples, total)


def source_tasks(
    data: DataSection, warmup: list[SourceSpec] | None = None, evaluated: list[EvalSourceSpec] = ()
) -> list[Task]:
    """The tasks of ``data.sources``, the run's ``warmup.sources`` and ``eval.sources``, in order,
    each with its role; a hub entry's subsets are checked present here, before any is read."""
    lists = {
        "data.sources": [(spec, "finetune") for spec in data.sources],
        "warmup.sources": [(spec, "warmup") for spec in warmup or []],
        "eval.sources": [(spec, spec.role) for spec in evaluated],
    }
    tasks = []
    for listed, entries in lists.items():
        for spec, role in entries:
            if spec.format != "hub":
                tasks.append(Task(spec, role, listed))
                continue
            hub = HubDataset.find(spec)
            tasks += [Task(spec, role, listed, subset, hub) for subset in hub.wanted()]
    return tasks


def load_sources(
    data: DataSection, seed: int, warmup: list[SourceSpec] | None = None, evaluated: list[EvalSourceSpec] = ()
) -> LoadedSources:
    """The sources of ``data.sources`` and of the run's ``warmup.sources`` and ``eval.sources``
    (``warmup`` and ``evaluated``), each with its role, in memory; every list given must yield a
    source."""
    loaded, policy = LoadedSources(), Policy(data.on_bad_record, seed)
    loaded.skipped, loaded.skipped_by_reason = policy.skipped, policy.skipped_by_reason
    tasks = source_tasks(data, warmup, evaluated)
    for listed in ("data.sources", "warmup.sources", "eval.sources"):
        before, mine = len(loaded.examples), [task for task in tasks if task.listed == listed]
        for task in mine:
            loaded.roles[task.spec.name] = task.role  # the entry's own skips (records without a task name)
            with local_datasets():
                for name, stream in task.sources(data, policy):
                    loaded.roles[name] = task.role
                    examples = list(stream)
                    if not examples:
                        policy.reject(name, no_examples(task, name))
                        continue
                    loaded.add(name, task.spec, examples)
        if (mine or listed == "data.sources") and len(loaded.examples) == before:
            raise no_source(listed)
    return loaded


def no_examples(task: Task, name: str) -> DataError:
    return DataError(task.spec.path or f"builtin:{name}", None, f"source '{name}' has no examples")


def no_source(listed: str) -> DataError:
    return DataError(f"config {listed}", None, "no source has any example")


def _vision_flan(
    spec: SourceSpec, path: Path, images_dir: Path, policy: Policy
) -> Iterator[tuple[str, Iterable[Example]]]:
    """One annotation file, one source per ``task_name`` (optionally only ``spec.tasks``): the
    file's records are grouped by task first (held: 191 k records of text, no image)."""
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
    for task in wanted:
        records = by_task.pop(task)
        yield task, policy.parsed(RecordParser(task, path, images_dir), records, spec.max_examples, len(records))
