"""The branch flow's heartbeat and its fencing: a run replaced by another stops its training."""

import json
import signal
import time

import pytest

from flows.heartbeat import HEARTBEAT, claim, heartbeat


def test_the_owner_beats_and_a_replaced_run_is_interrupted(tmp_path):
    claim(tmp_path, "new-run")
    with heartbeat(tmp_path, "new-run", every_s=0.02):
        time.sleep(0.2)
    beat = json.loads((tmp_path / HEARTBEAT).read_text())
    assert beat["flow_run"] == "new-run" and beat["beats"] >= 3
    # A run judged lost but alive (its machine cut off) finds another run named and stops what it
    # runs, even where the process had a SIGINT handler of its own that does not raise.
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), heartbeat(tmp_path, "old-run", every_s=0.02):
        time.sleep(30)
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # the process's handler is back
    signal.signal(signal.SIGINT, previous)
    assert json.loads((tmp_path / HEARTBEAT).read_text())["flow_run"] == "new-run"  # it never beat over it
