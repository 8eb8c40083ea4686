"""Stops a throwaway server whose test run died without stopping it (pytest killed with kill -9).

    reaper = watch([pg_ctl, "-D", data, "-m", "immediate", "stop"], remove=folder)
    ...
    reaper.dismiss()   # the run stopped the server itself

`watch` starts this module as a child that runs the command once its parent
process is gone (it is then another's child). It looks every PARENT_POLL_S rather
than asking the kernel for a signal (PR_SET_PDEATHSIG): that signal comes when the
*thread* that started the child ends, and a test that restarts its server from
`asyncio.to_thread` would have it stopped under it when that thread ends. A normal
end, a failed test or Ctrl-C stop the server through the fixture, which dismisses
the reaper by its PID.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1
COMMAND_TIMEOUT_S = 60
PARENT_POLL_S = 0.2


class Reaper:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process

    def dismiss(self) -> None:
        self._process.kill()
        self._process.wait(10)


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def watch(command: Sequence[str], *, remove: Path | None = None) -> Reaper:
    """A reaper that runs `command`, then removes the folder `remove`, if this process dies first."""
    removing = ["--remove", str(remove)] if remove is not None else []
    return Reaper(subprocess.Popen([sys.executable, "-m", "tests.reaper", *removing, "--", *command],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def _main(args: list[str]) -> None:
    remove = Path(args[1]) if args[0] == "--remove" else None
    command = args[args.index("--") + 1:]

    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    subprocess.run(command, timeout=COMMAND_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
