"""The shell tool: one command under /bin/sh, in the workspace, with a deadline.

    start    /bin/sh -c COMMAND, cwd = the workspace root, stdin from /dev/null,
             stdout and stderr interleaved in one pipe, in a new session (so a
             new process group whose id is the shell's pid);
    wait     for the shell to exit, at most the timeout;
    end      SIGTERM to the group on timeout, SIGKILL after a short grace; once
             the shell has exited, SIGKILL to whatever it left in its group, so
             a background child neither outlives the call nor holds the pipe
             open. Cancelling the calling task ends the group the same way.
    report   "exit code: N" first, a timeout line if it fired, then the output,
             its middle cut when it is longer than the cap.

The command inherits the runtime's whole environment (API keys included) and
its permissions: the workspace jail of the file tools does not apply to it,
only its starting directory does. Approval (risk "execute") is what guards it.
A process that starts its own session (setsid, a daemon) leaves the group and
is not killed.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import signal

from pydantic import BaseModel, Field

from ember.core.tools import Risk
from ember.tools.base import FunctionTool, ToolFailure
from ember.tools.workspace import Workspace

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_OUTPUT_CAP = 30_000
TERM_GRACE_S = 0.5
DRAIN_S = 1.0


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

    def add(self, chunk: bytes) -> None:
        self._keep(self._decoder.decode(chunk))

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


async def run_command(command: str, cwd: str, timeout_s: float, capture: Capture) -> tuple[int | None, bool]:
    """Runs `command` as the module docstring says; returns (exit code, timed out)."""
    transport, watch = await asyncio.get_running_loop().subprocess_exec(
        lambda: _Watch(capture), "/bin/sh", "-c", command, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )
    group = transport.get_pid()
    ended = False
    try:
        timed_out = not await _within(watch.exited, timeout_s)
        if timed_out:
            _signal_group(group, signal.SIGTERM)
            await _within(watch.exited, TERM_GRACE_S)
        _signal_group(group, signal.SIGKILL)
        ended = True
        # The group is dead, so the pipe closes; a process that left the group may still hold it.
        await _within(watch.exited, DRAIN_S)
        await _within(watch.closed, DRAIN_S)
        return transport.get_returncode(), timed_out
    finally:
        if not ended:  # cancelled, or failed: nothing the command started may outlive the call
            _signal_group(group, signal.SIGKILL)
        transport.close()


def shell_tool(workspace: Workspace, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               output_cap: int = DEFAULT_OUTPUT_CAP) -> FunctionTool[ShellArgs]:
    """The `shell` tool; `timeout_s` is the longest a call may ask for, and its default."""

    async def shell(args: ShellArgs) -> str:
        if "\x00" in args.command:
            raise ToolFailure("the command contains a NUL character")
        limit = timeout_s if args.timeout_s is None else min(args.timeout_s, timeout_s)
        capture = Capture(output_cap)
        code, timed_out = await run_command(args.command, str(workspace.root), limit, capture)
        lines = [_exit_line(code)]
        if timed_out:
            lines.append(f"timed out after {limit:g} s; the process group was killed")
        output = capture.text()
        lines.append(output if output else "(no output)")
        return "\n".join(lines)

    return FunctionTool(
        "shell",
        f"Run a shell command (/bin/sh -c) in the workspace directory and return its exit code and output "
        f"(stdout and stderr together; the middle is cut past {output_cap} characters). It is killed, with every "
        f"process it started, after timeout_s seconds (at most {timeout_s:g}). stdin is empty.",
        ShellArgs, shell, risk=Risk.EXECUTE, subject=lambda a: a.command, verb="run the shell command",
    )
