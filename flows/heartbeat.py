"""Noticing a branch whose machine is gone.

A spot machine taken away takes its Prefect worker and the branch's flow run with it: nobody is
left to report the run as crashed, so the server shows it "Running" for ever and a merit run
waiting on it would wait for ever. The branch flow therefore beats a heartbeat into the shared
run directory (``<branch>/heartbeat.json``, every ``flow.heartbeat_s``), and the merit run, while
it waits on that flow run, watches it: a run that is Running but whose heartbeat has not changed
for ``flow.branch_stale_s`` (on the watcher's own clock, so machines' clocks need not agree) is
set to Crashed and the branch task fails, so its retry starts a new flow run on another machine,
which resumes from the checkpoints the lost one left. A run still waiting for a machine
(Scheduled, Pending) is not stale: no machine has taken it yet.

A run judged lost may in fact be alive (a network partition, a stalled file system): the server's
Crashed state would not stop it, and it would keep writing the branch folder beside its
replacement. So the watcher names the run it waits for in ``<branch>/owner.json``, and a branch
flow that finds another run named there stops its training at its next beat.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.states import Crashed

from pipeline.checkpoint import write_json_atomic

HEARTBEAT = "heartbeat.json"
OWNER = "owner.json"
POLL_S = 2.0


def claim(folder: Path, flow_run_id: str) -> None:
    """Make ``flow_run_id`` the one run that may train the branch in ``folder``."""
    write_json_atomic(folder / OWNER, {"flow_run": flow_run_id})


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def heartbeat(folder: Path, flow_run_id: str, every_s: float) -> Iterator[None]:
    """Beat ``folder/heartbeat.json`` from a thread while the block runs; once another run owns
    the branch, stop beating and interrupt the block (the training it runs is killed with it)."""
    stop = threading.Event()

    def beat() -> None:
        beats = 0
        while not stop.is_set():
            owner = _read(folder / OWNER).get("flow_run", flow_run_id)
            if owner != flow_run_id:
                print(f"flow run {flow_run_id}: {folder} now belongs to flow run {owner}; stopping", flush=True)
                # A real SIGINT to the main thread: it also wakes a blocking wait (the branch's
                # launcher), whose handler then kills the training process group.
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                return
            beats += 1
            info = {"flow_run": flow_run_id, "beats": beats, "host": socket.gethostname(), "pid": os.getpid()}
            with contextlib.suppress(OSError):  # a hiccup of the shared file system: the next beat
                write_json_atomic(folder / HEARTBEAT, info)
            stop.wait(every_s)

    # Python's own SIGINT handler for the block, which raises KeyboardInterrupt: a handler that
    # something else in the process installed (a library, in Python or through sigaction) could
    # swallow the fencing's interrupt, as seen once in the test suite. Only the main thread may
    # set a handler.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if in_main else None
    thread = threading.Thread(target=beat, daemon=True)
    try:
        thread.start()  # inside: the interrupt may come before the block starts
        yield
    finally:
        stop.set()
        if thread.ident is not None:
            thread.join()
        if previous is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGINT, previous)


class LostMachine(RuntimeError):
    """A branch's flow run stopped beating: its machine is gone."""


def wait_for(run: FlowRun, folder: Path, stale_s: float, timeout_s: float) -> FlowRun:
    """Wait until ``run`` ends; mark it Crashed and raise :class:`LostMachine` when its heartbeat
    stops, or :class:`TimeoutError` when it has run ``timeout_s`` (time in the queue not counted).
    The server out of reach for a while is waited out, up to ``stale_s``."""
    last_beat, since, started, unreachable = None, time.monotonic(), None, None
    with get_client(sync_client=True) as client:
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            try:
                run = client.read_flow_run(run.id)
            except httpx.HTTPError as err:  # a restart or a blip of the API: not the branch's fault
                unreachable = unreachable or now
                if now - unreachable > stale_s:
                    why = f"the Prefect API failed for {stale_s:.0f} s: {err}"
                    raise RuntimeError(f"flow run {run.name} ({run.id}): {why}") from err
                continue
            unreachable = None
            if run.state.is_final():
                return run
            beat, running = _read(folder / HEARTBEAT), run.state.is_running()
            beat = beat.get("beats") if beat.get("flow_run") == str(run.id) else None  # not an earlier run's
            started = started or (now if running else None)
            if not running or beat != last_beat:
                last_beat, since = beat, now
            elif now - since > stale_s:
                why = f"no heartbeat in {folder} for {stale_s:.0f} s: its machine is gone"
                client.set_flow_run_state(run.id, Crashed(message=why), force=True)
                raise LostMachine(f"flow run {run.name} ({run.id}): {why}")
            if started and now - started > timeout_s:
                why = f"no result after {timeout_s:.0f} s of running"
                client.set_flow_run_state(run.id, Crashed(message=why), force=True)
                raise TimeoutError(f"flow run {run.name} ({run.id}): {why}")
