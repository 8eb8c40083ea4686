"""The shell tool: one command under /bin/sh, in the workspace, with a deadline.

    start    /bin/sh -c COMMAND, cwd = the turn's workspace root, stdin from /dev/null,
             stdout and stderr interleaved in one pipe, in a new session (so a
             new process group whose id is the shell's pid), with a minimal
             environment and a mark of this run that every descendant inherits;
    wait     for the shell to exit, at most the timeout;
    end      SIGTERM to the group on timeout, SIGKILL after a short grace; once
             the shell has exited, SIGKILL to whatever it left in its group and
             to every process carrying the run's mark (one that called setsid or
             forked twice left the group, not the mark), so a background child
             neither outlives the call nor holds the pipe open. Cancelling the
             calling task ends them the same way. Output after the timeout is
             dropped.
    report   "exit code: N" first, a timeout line if it fired, then the output,
             its middle cut when it is longer than the cap.

The environment is PATH, HOME, the locale and a few more of the runtime's
(BASE_ENV), plus the names `shell_env` adds; never an EMBER_ variable or one
named like a key, token, secret or password. The command has the runtime's
permissions otherwise: the workspace jail of the file tools does not apply to
it, only its starting directory does. Approval (risk "execute") is what guards
it. A process that clears its own environment and leaves the session escapes
the mark: the kill cannot find it, but its output no longer reaches the result.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from ember.core.redact import secret_env_name
from ember.core.tools import Risk, ToolRun
from ember.tools.base import ToolFailure, TurnTool
from ember.tools.workspace import Workspaces

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_OUTPUT_CAP = 30_000
TERM_GRACE_S = 0.5
DRAIN_S = 1.0
# What a command sees of the runtime's environment, besides the names `shell_env` adds.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM",
            "TMPDIR")
# Every process a command starts inherits this variable, whatever session or parent it moves to.
RUN_MARK = "TOOL_RUN_ID"


def command_env(names: Sequence[str], run_id: str) -> dict[str, str]:
    env = {name: os.environ[name] for name in (*BASE_ENV, *names) if name in os.environ and not secret_env_name(name)}
    env.setdefault("PATH", os.defpath)
    env[RUN_MARK] = run_id
    return env


class ShellArgs(BaseModel):
    command: str = Field(min_length=1, description="The command line, run with /bin/sh -c in the workspace")
    timeout_s: float | None = Field(default=None, gt=0, description="Seconds before the command is killed; "
                                                                    "omit for the maximum")


class Capture:
    """Output kept as a head and a tail of at most `cap` characters together; the middle is counted, not kept."""

    def __init__(self, cap: int) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._head_cap = cap // 2
        self._tail_cap = cap - self._head_cap
        self._head = ""
        self._tail = ""
        self.total = 0
        self.closed = False

    def add(self, chunk: bytes) -> None:
        if not self.closed:
            self._keep(self._decoder.decode(chunk))

    def close(self) -> None:
        """Keep nothing more: what arrives after the timeout is not the command's answer."""
        self.closed = True

    def text(self) -> str:
        self._keep(self._decoder.decode(b"", final=True))
        cut = self.total - len(self._head) - len(self._tail)
        if not cut:
            return self._head + self._tail
        return f"{self._head}\n[... {cut} characters of output cut; {self.total} in all ...]\n{self._tail}"

    def _keep(self, text: str) -> None:
        self.total += len(text)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += text[:room]
            text = text[room:]
        if text:
            joined = self._tail + text
            self._tail = joined[max(len(joined) - self._tail_cap, 0) :]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _marked(run_id: str) -> list[int]:
    """The processes whose environment carries the run's mark (Linux /proc; none elsewhere)."""
    mark = f"{RUN_MARK}={run_id}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def _kill_marked(run_id: str) -> None:
    # A process may fork while it is being looked for: look again until none is left.
    for _ in range(5):
        found = _marked(run_id)
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _exit_line(code: int | None) -> str:
    if code is None:
        return "exit code: unknown (the shell did not exit)"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code: {code} (killed by {signal.Signals(-code).name})"
    return f"exit code: {code}"


class _Watch(asyncio.SubprocessProtocol):
    """Output into a Capture; `exited` when the shell exits, `closed` when its pipe closes too.

    (asyncio's Process.wait() would also wait for the pipe, which a background child may hold.)
    """

    def __init__(self, capture: Capture) -> None:
        loop = asyncio.get_running_loop()
        self.capture = capture
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.capture.add(data)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def _within(future: asyncio.Future[None], seconds: float) -> bool:
    """Whether `future` is done within `seconds`; it is not cancelled either way."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(future), seconds)
    return future.done()


async def run_command(command: str, cwd: str, timeout_s: float, capture: Capture,
                      env_names: Sequence[str] = ()) -> tuple[int | None, bool]:
    """Runs `command` as the module docstring says; returns (exit code, timed out)."""
    run_id = uuid.uuid4().hex
    transport, watch = await asyncio.get_running_loop().subprocess_exec(
        lambda: _Watch(capture), "/bin/sh", "-c", command, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        env=command_env(env_names, run_id),
    )
    group = transport.get_pid()
    ended = False
    try:
        timed_out = not await _within(watch.exited, timeout_s)
        if timed_out:
            capture.close()
            _signal_group(group, signal.SIGTERM)
            await _within(watch.exited, TERM_GRACE_S)
        _signal_group(group, signal.SIGKILL)
        await asyncio.to_thread(_kill_marked, run_id)
        ended = True
        # The group is dead, so the pipe closes; a process that left the group may still hold it.
        await _within(watch.exited, DRAIN_S)
        await _within(watch.closed, DRAIN_S)
        return transport.get_returncode(), timed_out
    finally:
        if not ended:  # cancelled, or failed: nothing the command started may outlive the call
            _signal_group(group, signal.SIGKILL)
            _kill_marked(run_id)
        transport.close()


def shell_tool(workspaces: Workspaces, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               output_cap: int = DEFAULT_OUTPUT_CAP, env_names: Sequence[str] = ()) -> TurnTool[ShellArgs]:
    """The `shell` tool; `timeout_s` is the longest a call may ask for, and its default;
    `env_names` are variables passed through besides BASE_ENV (secret-like ones never are)."""

    async def shell(args: ShellArgs, run: ToolRun) -> str:
        if "\x00" in args.command:
            raise ToolFailure("the command contains a NUL character")
        workspace = await workspaces.for_run(run)
        limit = timeout_s if args.timeout_s is None else min(args.timeout_s, timeout_s)
        capture = Capture(output_cap)
        code, timed_out = await run_command(args.command, str(workspace.root), limit, capture, env_names)
        lines = [_exit_line(code)]
        if timed_out:
            lines.append(f"timed out after {limit:g} s; the process group was killed")
        output = capture.text()
        lines.append(output if output else "(no output)")
        return "\n".join(lines)

    return TurnTool(
        "shell",
        f"Run a shell command (/bin/sh -c) in the workspace directory and return its exit code and output "
        f"(stdout and stderr together; the middle is cut past {output_cap} characters). It is killed, with every "
        f"process it started, after timeout_s seconds (at most {timeout_s:g}). stdin is empty.",
        ShellArgs, shell, risk=Risk.EXECUTE, subject=lambda a: a.command, verb="run the shell command",
    )
