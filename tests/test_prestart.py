"""Jobs forked from a prestart server behave as the processes they replace: their own pid and
session, the environment, directory, arguments and exit code asked for, killed with their group,
and gone when the process that asked for them dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline import prestart

JOB = """
import json, os, sys, time
print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "server": os.getppid(), "cwd": os.getcwd(),
                  "argv": sys.argv[1:], "rank": os.environ.get("RANK"), "tag": os.environ.get("TAG"),
                  "imported": "textwrap" in sys.modules}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def env(tmp_path):
    (tmp_path / "prestart_job.py").write_text(JOB)
    return dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", TAG="a")


def run(env: dict, *args: str) -> tuple[int, dict]:
    job = prestart.start("prestart_job", list(args), env, preload=["textwrap"])
    report = json.loads(job.stdout.readline())
    return job.wait(timeout=60), report


def test_a_job_runs_as_its_own_process_with_what_it_was_asked(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, first = run(env | {"RANK": "0"}, "3")
    assert code == 3 and first["argv"] == ["3"] and first["rank"] == "0" and first["tag"] == "a"
    assert first["sid"] == first["pid"] and first["cwd"] == str(tmp_path) and first["imported"]
    # Another rank is the same server; another environment (read at import, maybe) is not.
    code, second = run(env | {"RANK": "1"}, "0")
    assert code == 0 and second["rank"] == "1" and second["server"] == first["server"]
    assert second["pid"] != first["pid"]
    _, third = run(env | {"TAG": "b"}, "0")
    assert third["tag"] == "b" and third["server"] != first["server"]


def test_a_running_job_times_out_and_dies_with_its_group(env):
    job = prestart.start("prestart_job", ["sleep"], env, preload=["textwrap"])
    json.loads(job.stdout.readline())
    assert job.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(timeout=0.2)
    os.killpg(job.pid, signal.SIGKILL)
    assert job.wait(timeout=30) == -signal.SIGKILL


def test_a_killed_client_takes_its_server_and_jobs_with_it(env, tmp_path):
    client = textwrap.dedent(
        """
        import os, sys
        from pipeline import prestart
        job = prestart.start("prestart_job", ["sleep"], dict(os.environ), preload=["textwrap"])
        print(job.stdout.readline(), end="", flush=True)
        job.wait()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", client], env=env, stdout=subprocess.PIPE, text=True)
    report = json.loads(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in (report["pid"], report["server"])):
        assert time.monotonic() < deadline, "a job or its server outlived the killed client"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
