"""Launch one branch as its own process group: ``torch.distributed.run`` with N processes (NCCL
on GPUs, gloo on CPU), or the one rank alone. One subprocess per branch keeps DeepSpeed's global
state (ZeRO-3 partitioning) out of the caller. The subprocess' exit code becomes an exception; a
timeout kills its whole process group; its output is streamed to the caller and to ``train.log``.
On a machine without CUDA the one rank is forked from a process that has already imported it
(:mod:`pipeline.prestart`): the same process, without its 10 s of imports."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import prestart
from pipeline.checkpoint import is_complete, read_manifest
from pipeline.devices import visible_devices
from pipeline.threads import threads_per_process
from pipeline.train.lifetime import parent_environment
from pipeline.train.spec import BranchSpec

KILLED = {137: "SIGKILL", 143: "SIGTERM", -9: "SIGKILL", -15: "SIGTERM"}
# torchrun exits 1 when a rank dies by a signal; its report names the signal of the first
# failure ("Root Cause"), after the ranks it then stopped itself (SIGTERM): only the former counts.
ROOT_CAUSE = "Root Cause (first observed failure):"
RANK_KILLED = re.compile(r"Signal \d+ \((SIGKILL|SIGTERM)\)")


class BranchFailed(RuntimeError):
    """A branch's training process group exited with an error; the message names the branch."""

    def __init__(self, name: str, code: int, log: Path):
        tail = log.read_text(errors="replace")[-20_000:] if log.is_file() else ""
        signal_name = KILLED.get(code) or _root_cause_signal(tail)
        self.name, self.code, self.killed = name, code, signal_name is not None
        why = f"killed ({signal_name})" if self.killed else f"exit code {code}"
        super().__init__(f"branch {name}: training {why}; see {log}")


def _root_cause_signal(log_tail: str) -> str | None:
    """The signal that killed the first rank to fail in torchrun's last report, if one did."""
    if ROOT_CAUSE not in log_tail:
        return None
    cause = log_tail.rsplit(ROOT_CAUSE, 1)[1].split("=" * 20, 1)[0]
    found = RANK_KILLED.search(cause)
    return found.group(1) if found else None


@dataclass
class BranchResult:
    name: str
    final: str
    steps: int
    tokens_seen: int
    seconds: float
    resumed: bool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(spec_path: Path, processes: int, module: str = "pipeline.train.worker") -> tuple[list[str], dict[str, str]]:
    """The job's processes (``module`` run on the spec), run so that they die with the caller
    (``pipeline.train.lifetime``), and the environment they need: torchrun for several ranks; one
    rank runs on its own, with torchrun's variables set here (the launcher would cost a process
    and 2 s a branch)."""
    port = str(free_port())
    if processes == 1:
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        argv = [sys.executable, "-u", "-m", "pipeline.train.lifetime", module, str(spec_path)]
        return argv, env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    torchrun = ["torch.distributed.run", f"--nproc_per_node={processes}", "--nnodes=1", "--master_addr=127.0.0.1"]
    worker = ["-m", module, str(spec_path)]
    return [sys.executable, "-m", "pipeline.train.lifetime", *torchrun, f"--master_port={port}", *worker], {}


def train_branch(spec: BranchSpec, echo: bool = True, gpus: list[int] | None = None) -> BranchResult:
    """Train (or resume, or skip if already complete) one branch; returns a small result.
    ``gpus``: the devices this branch may use, when several branches share a machine."""
    out, final = Path(spec.out_dir), Path(spec.out_dir) / "final"
    digest = spec.digest()
    _refuse_other_spec(spec, digest)
    if is_complete(final):
        return _result(spec, final, 0.0, resumed=False)
    spec.validate_inputs()
    resumed = (out / "checkpoints" / "latest.json").is_file()
    seconds = run_job(spec, spec.save(out / "spec.json"), "pipeline.train.worker", echo, gpus)
    return _result(spec, final, seconds, resumed)


def rank_environment(ranks_sharing: int, gpus: list[int] | None) -> dict[str, str]:
    """What a rank needs beyond its rendezvous: its share of this process's CPUs as threads, when
    ``ranks_sharing`` ranks run on them at once (OpenMP's passive waiting is inherited, set by
    ``pipeline.threads``), its GPUs, and DeepSpeed's extension cache."""
    env = {
        "OMP_NUM_THREADS": str(threads_per_process(ranks_sharing)),
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/torch_extensions")),
    }
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus)
    return env


def run_job(
    spec: BranchSpec, spec_path: Path, module: str, echo: bool, gpus: list[int] | None, sharing: int = 1
) -> float:
    """Run ``module`` on ``spec_path`` as the branch's process group until it exits; returns its
    seconds. Output goes to ``train.log`` (and the caller's stdout with ``echo``); a failure or
    the branch's timeout raises, naming the branch. ``sharing``: jobs sharing this machine's
    CPU cores at once (each gets its share of threads)."""
    out = Path(spec.out_dir)
    argv, rank_env = command(spec_path, spec.train.processes, module)
    env = os.environ | rank_env | rank_environment(spec.train.processes * sharing, gpus) | parent_environment()
    start = time.perf_counter()
    log = out / "train.log"
    with open(log, "a") as log_file:
        if spec.train.processes == 1 and prestart.usable():  # a fork of a process that imported the module
            proc = prestart.start(module, [str(spec_path)], env, preload=[module])
        else:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                env=env,
                start_new_session=True,
            )
        pump = threading.Thread(target=_pump, args=(proc, log_file, echo), daemon=True)
        pump.start()
        try:
            code = proc.wait(timeout=spec.train.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)  # the launcher and every rank it started
            proc.wait()
            raise TimeoutError(f"branch {spec.name}: no result after {spec.train.timeout_s} s; see {log}") from None
        except BaseException:
            # The ranks run in their own session, out of reach of the caller's Ctrl-C: a caller
            # that stops (interrupt, cancelled task) must not leave them holding the GPUs.
            _kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            pump.join(timeout=5)
    if code != 0:
        _kill_group(proc.pid)  # ranks of a killed launcher must not outlive it
        raise BranchFailed(spec.name, code, log)
    return time.perf_counter() - start


def _refuse_other_spec(spec: BranchSpec, digest: str) -> None:
    """A branch folder holds the training of one spec: reusing (or resuming) it under a changed θ0,
    sources or training setting would silently give weights the config does not describe."""
    out = Path(spec.out_dir)
    final, latest = out / "final", out / "checkpoints" / "latest.json"
    recorded = read_manifest(final).get("spec_digest") if is_complete(final) else None
    if recorded is None and latest.is_file():
        recorded = json.loads(latest.read_text()).get("spec_digest")
    if recorded is not None and recorded != digest:
        raise ValueError(
            f"branch {spec.name}: {out} was trained from another θ0, sources or train settings; "
            "move it away (or use another run directory) to train this one"
        )


def _pump(proc: subprocess.Popen | prestart.Job, log_file, echo: bool) -> None:
    """Copy the process group's output; never stop reading, or a full pipe would block the ranks."""
    for line in proc.stdout:
        log_file.write(line)
        log_file.flush()
        if echo:
            try:
                print(line, end="", flush=True)
            except (OSError, ValueError):  # the caller's stdout is gone: keep the log going
                echo = False


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _result(spec: BranchSpec, final: Path, seconds: float, resumed: bool) -> BranchResult:
    manifest = read_manifest(final)
    return BranchResult(spec.name, str(final), manifest["step"], manifest["tokens_seen"], seconds, resumed)
