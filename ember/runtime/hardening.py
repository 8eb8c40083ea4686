"""Ember's own process, out of reach of the commands it runs as the same user."""

from __future__ import annotations

import ctypes
import sys

PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4


def make_undumpable() -> bool:
    """Marks this process non-dumpable, so that other processes of its user (a shell command run
    with shell_sandbox = "none", say) can no longer read its /proc/<pid>/environ or memory, nor
    attach a debugger; root still can, and there are no core dumps. Whether it took (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)


def dumpable() -> bool:
    """Whether this process is dumpable (True off Linux, where there is no such flag)."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0))
