"""Where a shell command runs: the argv that starts it, and how to end everything it started.

    bubblewrap  its own PID namespace and /proc (no ancestor of it is visible), the system read-only,
                the workspace the only writable place, a fresh /tmp, a minimal /dev, no capabilities;
                Ember's home and the other workspaces do not exist inside; no network unless asked.
    docker      the same contract in a throwaway container, for hosts where namespaces are not allowed.
    none        /bin/sh as Ember's own user, with Ember's view of the machine; only when configured.

ember/tools/sandboxes.py picks the one a mode runs in.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

SandboxMode = Literal["auto", "bubblewrap", "docker", "none"]
PROBE_TIMEOUT_S = 10.0
# Every process a command starts inherits this variable, whatever session or parent it moves to.
RUN_MARK = "TOOL_RUN_ID"


@dataclass(frozen=True, slots=True)
class Launch:
    """One command to start."""

    command: str
    root: Path  # the workspace: the working directory, and the only place the command may write
    network: bool
    env: Mapping[str, str]  # already cleaned of secrets; it carries RUN_MARK
    run_id: str


@dataclass(frozen=True, slots=True)
class Command:
    """What to execute, in its own session, with `root` as the working directory."""

    argv: list[str]
    env: dict[str, str]


class Sandbox(Protocol):
    name: str

    def problem(self) -> str | None:
        """Why it cannot start here (it tries), or None when it can."""
        ...

    def command(self, launch: Launch) -> Command: ...

    def signal(self, launch: Launch, pid: int, sig: signal.Signals) -> None:
        """`sig` to everything the command started; `pid` is the Command's process, leader of its own group.
        SIGKILL leaves nothing of it running."""
        ...

    def exit_code(self, returncode: int) -> int:
        """The command's exit code, negative when a signal ended it, from the Command's."""
        ...


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_pid(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _marked(run_id: str) -> list[int]:
    """The processes whose environment carries the run's mark (Linux /proc; none elsewhere)."""
    mark = f"{RUN_MARK}={run_id}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def kill_marked(run_id: str) -> None:
    # A process may fork while it is being looked for: look again until none is left.
    for _ in range(5):
        found = _marked(run_id)
        if not found:
            return
        for pid in found:
            kill_pid(pid, signal.SIGKILL)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (Linux /proc)."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, children first."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, level = [], children.get(pid, [])
    while level:
        found.extend(level)
        level = [grandchild for child in level for grandchild in children.get(child, [])]
    return found


def signal_exit(returncode: int) -> int:
    """128+N, as bubblewrap and docker report a command that signal N ended, told back as -N."""
    if 128 < returncode <= 128 + 64:
        return -(returncode - 128)
    return returncode


class Unsandboxed:
    """/bin/sh as Ember's user; the run's mark finds what left the process group (setsid, a double fork)."""

    name = "none"

    def problem(self) -> str | None:
        return None

    def command(self, launch: Launch) -> Command:
        return Command(["/bin/sh", "-c", launch.command], dict(launch.env))

    def signal(self, launch: Launch, pid: int, sig: signal.Signals) -> None:
        signal_group(pid, sig)
        if sig is signal.SIGKILL:
            kill_marked(launch.run_id)

    def exit_code(self, returncode: int) -> int:
        return returncode


def probe(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """None when `argv` runs and exits 0, else the first line of what it said."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                              timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    said = (done.stderr or done.stdout).strip().splitlines()
    return said[0] if said else f"exit code {done.returncode}"
