"""Processes that die with the process that started them.

A branch runs as caller → torchrun launcher → ranks. The launcher runs in a session of its own
(so that a timeout can kill its group) and torchrun starts every rank in yet another session, so
no signal to a process group reaches past one level. Instead each level asks the kernel for
SIGKILL when its parent dies (``PR_SET_PDEATHSIG``): a cancelled or killed flow takes its
launchers with it, and a killed launcher its ranks, so no rank trains on holding GPUs and
writing into a branch folder that a retry is about to use.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The pid a process' parent must have, set by the parent (:func:`parent_environment`) and by each
# process that asked for its own death for the processes it starts: a process whose parent died
# before the request was in place has been re-parented (to init or a subreaper), which only the
# expected pid tells apart from a parent that is alive.
PARENT = "MERIT_PARENT_PID"


def parent_environment() -> dict[str, str]:
    """What a process that starts one dying with it adds to its environment."""
    return {PARENT: str(os.getpid())}


def die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    expected = os.environ.get(PARENT)
    if expected == str(os.getpid()):  # asked already, by this same process (the module runner below)
        return
    parent = int(expected) if expected else os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)
    os.environ.update(parent_environment())  # for the processes this one starts (torchrun's ranks)


if __name__ == "__main__":  # python -m pipeline.train.lifetime MODULE ARGS...: run MODULE, dying with the caller
    die_with_parent()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
