"""Peak memory of this process: anonymous resident memory (what it allocated, not the page
cache of memory-mapped checkpoints, which is shared and reclaimable) sampled from
``/proc/self/status``, and the peak of every resident page, file-backed ones included."""

from __future__ import annotations

import resource
import threading
from pathlib import Path


def rss_anon() -> int:
    """Anonymous resident bytes now (0 where /proc is not there)."""
    return _status("RssAnon") or 0


def max_rss() -> int:
    """The peak of every resident page of this process. ``VmHWM`` where /proc has it: ``ru_maxrss``
    keeps, across exec, the peak of the process that forked it, so a spawned child would report at
    least its parent's size."""
    return _status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class AnonymousPeak:
    """Samples :func:`rss_anon` in a background thread while the block runs; ``peak`` in bytes."""

    def __init__(self, interval: float = 0.01):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)

    def _sample(self, interval: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            self._stop.wait(interval)

    def start(self) -> AnonymousPeak:
        self._thread.start()
        return self

    def __enter__(self) -> AnonymousPeak:
        return self.start()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
