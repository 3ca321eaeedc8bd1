"""Jobs forked from a server that has already imported what they need.

A branch of the tiny model trains in a few seconds, but its process first spends about 10 s
importing torch, transformers and DeepSpeed, and an lmms-eval evaluation 9 s importing lmms-eval;
a run starts dozens of them. A prestart server (``python -m pipeline.prestart SOCKET MODULE...``)
imports the modules once, then forks one child per job: still a process of its own (its own pid
and session, so that its group can be killed; its memory given back when it exits), its
environment, working directory and output set from the request, started in a fraction of a
second. :func:`start` returns a ``subprocess.Popen``-like handle.

Only on machines without CUDA (:func:`usable`): a process that has initialised CUDA cannot be
forked safely, and beside loading a model onto a GPU the seconds of imports do not matter.

Modules that read the environment when imported (Hugging Face's cache and offline settings,
OpenMP's wait policy) see the server's: a server only takes jobs whose environment equals its own
outside :data:`PER_JOB`, the variables read when a job runs; another environment gets a server of
its own. A server exits when its client does (it watches a pipe the client holds) or after
:data:`IDLE_S` without jobs; its jobs die with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import IO

# Read when a job runs, not at import: torch.distributed's rendezvous, the job's threads (set
# again in the child), and the test pytest runs (which would otherwise start a server a test).
PER_JOB = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"}
    | {"PYTEST_CURRENT_TEST", "MERIT_PARENT_PID"}
)
IDLE_S = 120.0  # a server holds its imports' memory (≈ 1 GB) while it waits
READY_TIMEOUT_S = 600.0
MESSAGE = 1 << 20  # bytes: a request (the job's whole environment) fits in one datagram


def usable() -> bool:
    """Whether jobs may be forked from a server here: never where CUDA is available."""
    import torch

    return not torch.cuda.is_available()


class Job:
    """A forked job, as much of ``subprocess.Popen`` as the launchers use."""

    def __init__(self, conn: socket.socket, pid: int, stdout: IO[str] | None):
        self.conn, self.pid, self.stdout, self.returncode = conn, pid, stdout, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.conn.settimeout(timeout)
            try:
                reply = self.conn.recv(MESSAGE)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(f"job {self.pid}", timeout) from None
            # No reply: the server died, and the job with it (PR_SET_PDEATHSIG).
            self.returncode = json.loads(reply)["code"] if reply else -signal.SIGKILL
            self.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None


class _Server:
    def __init__(self, modules: tuple[str, ...], env: dict[str, str]):
        folder = Path(tempfile.mkdtemp(prefix="merit-prestart-"))
        self.socket, log = folder / "socket", folder / "server.log"
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.prestart", str(self.socket), *modules],
                stdin=subprocess.PIPE,  # its end closes when this process dies, however it dies
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.socket.exists():  # bound once every module is imported
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the prestart server for {', '.join(modules)} did not start:\n{log.read_text()}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None


_servers: dict[str, _Server] = {}
_lock = threading.Lock()


def start(
    module: str,
    args: list[str],
    env: dict[str, str],
    preload: list[str],
    stdout: int | None = None,
    cwd: str | None = None,
) -> Job:
    """Run ``python -m module args...`` with ``env`` as a fork of a server that imported
    ``preload``, in ``cwd`` (default: this process's); its output goes to the file descriptor
    ``stdout``, or to a pipe read from the handle's ``stdout`` (text)."""
    base = {k: v for k, v in env.items() if k not in PER_JOB}
    key = hashlib.sha256(json.dumps([preload, sorted(base.items())]).encode()).hexdigest()
    read_end = None
    if stdout is None:
        read, stdout = os.pipe()
        read_end = open(read, errors="replace")  # noqa: SIM115 (the handle's, closed by its reader)
    try:
        request = json.dumps({"module": module, "args": args, "env": env, "cwd": cwd or os.getcwd()}).encode()
        for fresh in (False, True):
            server = _server(key, tuple(preload), base, fresh)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(str(server.socket))
                socket.send_fds(conn, [request], [stdout])
                reply = conn.recv(MESSAGE)
            except (ConnectionError, FileNotFoundError):
                reply = b""
            if reply:
                return Job(conn, json.loads(reply)["pid"], read_end)
            conn.close()  # the server was leaving (idle) as the request came: start another
        raise RuntimeError(f"the prestart server for {module} took no job")
    finally:
        if read_end is not None:
            os.close(stdout)  # the job holds its own copy


def _server(key: str, modules: tuple[str, ...], env: dict[str, str], fresh: bool) -> _Server:
    with _lock:
        server = _servers.get(key)
        if fresh or server is None or not server.alive():
            server = _servers[key] = _Server(modules, env)
        return server


# --- the server side ---------------------------------------------------------------------


def serve(path: str, modules: list[str]) -> None:
    for module in modules:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the client connects once the path exists: listening by then
    jobs: dict[int, socket.socket] = {}
    idle_since = time.monotonic()
    while jobs or time.monotonic() - idle_since < IDLE_S:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.1)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the client is gone: so are its jobs
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, MESSAGE, 1)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                for held in [listener, conn, *jobs.values()]:  # the server's, not the job's
                    held.close()
                _child(json.loads(message), fds[0])
            os.close(fds[0])
            conn.send(json.dumps({"pid": pid}).encode())
            jobs[pid] = conn
        for pid, code in _reaped():
            conn = jobs.pop(pid)
            with contextlib.suppress(OSError):  # the client stopped waiting
                conn.send(json.dumps({"code": code}).encode())
            conn.close()
            idle_since = time.monotonic()
    listener.close()
    for pid in jobs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _reaped() -> list[tuple[int, int]]:
    """Jobs that have exited, with their exit codes as ``Popen.returncode`` gives them."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, os.waitstatus_to_exitcode(status)))


def _child(request: dict, out: int) -> None:
    """The forked job: a session of its own, dying with the server, then the module as __main__."""
    from pipeline.train.lifetime import die_with_parent, parent_environment

    os.setsid()
    die_with_parent()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"] | parent_environment())  # this fork's parent is the server: asked above
    if "OMP_NUM_THREADS" in os.environ and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = [request["module"], *request["args"]]
    # The server imported the module itself; running it again as __main__ is what `python -m` does.
    warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
        code = int(exit_.code) if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
    shutil.rmtree(Path(sys.argv[1]).parent)  # its socket and log (kept when it could not start)
