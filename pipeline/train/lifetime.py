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


def die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)


if __name__ == "__main__":  # python -m pipeline.train.lifetime MODULE ARGS...: run MODULE, dying with the caller
    die_with_parent()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
