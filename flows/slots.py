"""Jobs on a fixed set of slots (GPU groups, CPU shares, machines of a pool), one job per slot at a
time, started as soon as a slot is free: the fan-out of the branches and of the benchmark jobs."""

from __future__ import annotations

import queue
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

from prefect.futures import PrefectFuture

Slot = TypeVar("Slot")


class SlotPool(Generic[Slot]):
    """``add`` jobs (a key and the arguments of ``submit``), in any order, while others run;
    ``finished`` yields each job's key and future as it ends, until every job added has."""

    def __init__(self, slots: list[Slot], submit: Callable[[Any, Slot], PrefectFuture]):
        self.free, self.submit = list(slots), submit
        self.pending: list[tuple[Hashable, Any]] = []
        self.running: dict[Hashable, tuple[PrefectFuture, Slot]] = {}
        self.ended: list[tuple[Hashable, PrefectFuture]] = []
        self.done: queue.Queue[Hashable] = queue.Queue()  # filled by the futures' callbacks

    def add(self, key: Hashable, job: Any) -> None:
        self.pending.append((key, job))
        self.poll()

    def poll(self) -> None:
        """Without waiting: the slots of the jobs that ended take the next jobs."""
        while self._reap(timeout=None):
            pass
        self._start()

    def finished(
        self, poll_s: float, idle: Callable[[], None] = lambda: None
    ) -> Iterator[tuple[Hashable, PrefectFuture]]:
        """Each job as it ends (its slot then takes the next job); ``idle`` every ``poll_s`` without one."""
        while self.pending or self.running or self.ended:
            if self.ended:
                yield self.ended.pop(0)
            elif not self._reap(timeout=poll_s):
                idle()

    def _start(self) -> None:
        while self.pending and self.free:
            (key, job), slot = self.pending.pop(0), self.free.pop(0)
            future = self.submit(job, slot)
            self.running[key] = (future, slot)
            future.add_done_callback(lambda _, key=key: self.done.put(key))

    def _reap(self, timeout: float | None) -> bool:
        """One ended job moved to ``ended``, its slot freed and given the next job; False when
        none ends within ``timeout`` (None: none has ended)."""
        try:
            key = self.done.get(timeout=timeout) if timeout else self.done.get_nowait()
        except queue.Empty:
            return False
        future, slot = self.running.pop(key)
        self.free.append(slot)
        self.ended.append((key, future))
        self._start()
        return True
