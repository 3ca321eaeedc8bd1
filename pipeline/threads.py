"""CPU threads: as many as this process may use, set for every stage and rank, never spinning.

Two traps of shared machines:

- ``os.cpu_count()`` counts the machine, not what the process may use: a job pinned to some
  cores (taskset, Slurm, Kubernetes' static CPU manager) or a container with a CPU quota gets
  pools sized for the whole machine, their threads queueing on too few cores.
- OpenMP's worker threads spin-wait between parallel regions (GNU OpenMP's default). When
  another process holds the core a sibling thread needs, the spinning thread burns its time
  slice waiting for it: beside two busy processes on 2 cores a TIES merge took 7× its unloaded
  time, 1.6× with passive waiting (``merit bench merge --load``). The OpenMP runtime reads
  ``OMP_WAIT_POLICY`` once, when torch loads it, so :func:`configure_environment` runs when
  ``pipeline`` is imported, before any of its modules imports torch; child processes (ranks,
  workers) inherit it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

CGROUP = Path("/sys/fs/cgroup")
SMALL_MODEL = 20_000_000  # parameters: below, a model's operations are too small to split across threads


def configure_environment() -> None:
    """Passive waiting for the OpenMP runtimes torch may load (GNU's and Intel's), unless set."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("KMP_BLOCKTIME", "0")


def cgroup_quota(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time the process's cgroups allow (the tightest along the path), or None.
    cgroup v2 ``cpu.max`` ("max 100000" or "150000 100000"); v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` (−1: none)."""
    limits = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: walk from the process's cgroup up to the root
            folder = root / path.lstrip("/")
            while True:
                limits.append(_v2_limit(folder / "cpu.max"))
                if folder == root or root not in folder.parents:
                    break
                folder = folder.parent
        elif "cpu" in controllers.split(","):
            for mount in (root / "cpu", root / "cpu,cpuacct"):
                limits.append(_v1_limit(mount / path.lstrip("/")))
                limits.append(_v1_limit(mount))  # a container sees its own cgroup at the mount
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _v2_limit(file: Path) -> float | None:
    try:
        quota, period = file.read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity), capped by its cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cpus, math.floor(quota))) if quota else cpus


def threads_per_process(processes: int = 1) -> int:
    """Each of ``processes`` processes sharing this process's CPUs gets an equal share."""
    return max(1, available_cpus() // max(1, processes))


def set_threads(processes: int = 1) -> int:
    """Set torch's intra-op threads to this process's share of the CPUs; returns the count."""
    import torch

    threads = threads_per_process(processes)
    torch.set_num_threads(threads)
    return threads


def map_chunks(
    fn: Callable[[slice, list[torch.Tensor]], T],
    chunks: list[slice],
    scratch: Callable[[], list[torch.Tensor]],
    workers: int,
) -> list[T]:
    """``fn(chunk, buffers)`` for every chunk, results in order, by ``workers`` threads over
    contiguous runs of chunks, each running torch single-threaded with buffers of its own from
    ``scratch()``. A pass of thousands of small operations in torch's own pool synchronises its
    threads after every one: with passive waiting that doubles the pass, with spinning it
    collapses beside other work; threads that each own a run of chunks meet once per pass."""
    if workers <= 1 or len(chunks) < 2:
        buffers = scratch()
        return [fn(chunk, buffers) for chunk in chunks]
    size = -(-len(chunks) // workers)
    runs = [chunks[i : i + size] for i in range(0, len(chunks), size)]

    import torch

    restore = torch.get_num_threads()

    def run(part: list[slice]) -> list[T]:
        # torch.set_num_threads sets this thread's OpenMP setting and the default that threads
        # take at their first operation: take it now, then set one. The caller puts its own
        # count back once every worker is done (a worker doing so could reach a sibling that
        # had not started yet).
        torch.get_num_threads()
        torch.set_num_threads(1)
        buffers = scratch()
        return [fn(chunk, buffers) for chunk in part]

    try:
        with ThreadPoolExecutor(len(runs)) as pool:
            return [result for part in pool.map(run, runs) for result in part]
    finally:
        torch.set_num_threads(restore)


def fit_threads_to_model(parameters: int) -> int:
    """One thread for a model under ``SMALL_MODEL`` parameters, whose operations take
    microseconds: splitting one wakes the other threads (passive waiting), which costs more than
    it saves (the tiny model's evaluation ran 1.3× slower on 2 threads than on 1). A larger model
    keeps this thread's share. Returns the threads now set."""
    import torch

    if parameters < SMALL_MODEL:
        torch.set_num_threads(1)
    return torch.get_num_threads()
