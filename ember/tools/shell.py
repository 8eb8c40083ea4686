"""The shell tool: one command under /bin/sh, in the workspace, in a sandbox, with a deadline.

    start    the sandbox's argv for /bin/sh -c COMMAND (tools/sandbox.py), cwd = the turn's workspace root,
             stdin from /dev/null, stdout and stderr interleaved in one pipe, in a new session (so
             a new process group whose id is its pid), with a minimal environment and a mark of
             this run that every descendant inherits;
    wait     for it to exit, at most the timeout;
    end      SIGTERM to everything the command started on timeout, SIGKILL after a short grace;
             once it has exited, SIGKILL to whatever it left behind (the sandbox finds what called
             setsid or forked twice), so a background child neither outlives the call nor holds
             the pipe open. Cancelling the calling task ends them the same way. Output after the
             timeout is dropped.
    report   "exit code: N" first, a timeout line if it fired, then the output, its middle cut when
             it is longer than the cap.

The environment is PATH, HOME, the locale and a few more of the runtime's (BASE_ENV), plus the
names `shell_env` adds; never an EMBER_ variable or one named like a key, token, secret or
password. What else the command can see and reach is the sandbox's to say: by default one that
shows it the system read-only and only its own workspace; with shell_sandbox = "none" it has the
runtime's permissions, and only approval (risk "execute") guards it. When no sandbox of the
configured mode can start, every call fails with the line saying how to enable one.
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
from ember.tools.sandbox import RUN_MARK, Launch, Sandbox
from ember.tools.sandboxes import SandboxChoice, SandboxUnavailable, sandbox_choice
from ember.tools.workspace import Workspaces

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_OUTPUT_CAP = 30_000
TERM_GRACE_S = 0.5
DRAIN_S = 1.0
# What a command sees of the runtime's environment, besides the names `shell_env` adds.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM",
            "TMPDIR")


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


async def _start(sandbox: Sandbox, launch: Launch, capture: Capture) -> tuple[asyncio.SubprocessTransport, _Watch]:
    """The command's process, started; cancelled meanwhile, it is killed once it exists."""
    start = sandbox.command(launch)
    spawning = asyncio.ensure_future(asyncio.get_running_loop().subprocess_exec(
        lambda: _Watch(capture), *start.argv, cwd=launch.root, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True, env=start.env,
    ))
    try:
        return await asyncio.shield(spawning)
    except asyncio.CancelledError:
        # The child runs as soon as it is forked, before the pipes are connected and this returns.
        with contextlib.suppress(OSError):
            transport, _ = await spawning
            sandbox.signal(launch, transport.get_pid(), signal.SIGKILL)
            transport.close()
        raise


async def run_command(command: str, cwd: str, timeout_s: float, capture: Capture, env_names: Sequence[str] = (),
                      *, sandbox: Sandbox, network: bool = True) -> tuple[int | None, bool]:
    """Runs `command` in `sandbox` as the module docstring says; returns (exit code, timed out)."""
    run_id = uuid.uuid4().hex
    launch = Launch(command, Path(cwd), network, command_env(env_names, run_id), run_id)
    transport, watch = await _start(sandbox, launch, capture)
    pid = transport.get_pid()
    ended = False
    try:
        timed_out = not await _within(watch.exited, timeout_s)
        if timed_out:
            capture.close()
            await asyncio.to_thread(sandbox.signal, launch, pid, signal.SIGTERM)
            await _within(watch.exited, TERM_GRACE_S)
        await asyncio.to_thread(sandbox.signal, launch, pid, signal.SIGKILL)
        ended = True
        # Everything is dead, so the pipe closes; a process that escaped the sandbox's kill may still hold it.
        await _within(watch.exited, DRAIN_S)
        await _within(watch.closed, DRAIN_S)
        code = transport.get_returncode()
        return (None if code is None else sandbox.exit_code(code)), timed_out
    finally:
        if not ended:  # cancelled, or failed: nothing the command started may outlive the call
            sandbox.signal(launch, pid, signal.SIGKILL)
        transport.close()


def shell_tool(workspaces: Workspaces, *, sandbox: SandboxChoice | None = None, network: bool = True,
               timeout_s: float = DEFAULT_TIMEOUT_S, output_cap: int = DEFAULT_OUTPUT_CAP,
               env_names: Sequence[str] = ()) -> TurnTool[ShellArgs]:
    """The `shell` tool; `sandbox` is where commands run (by default the first that starts here, of
    bubblewrap and docker); `network` whether they may reach it; `timeout_s` is the longest a call may
    ask for, and its default; `env_names` are variables passed through besides BASE_ENV (secret-like
    ones never are)."""
    choice = sandbox or sandbox_choice("auto")

    async def shell(args: ShellArgs, run: ToolRun) -> str:
        if "\x00" in args.command:
            raise ToolFailure("the command contains a NUL character")
        try:
            where = await asyncio.to_thread(choice.sandbox)
        except SandboxUnavailable as exc:
            raise ToolFailure(str(exc)) from exc
        workspace = await workspaces.for_run(run)
        limit = timeout_s if args.timeout_s is None else min(args.timeout_s, timeout_s)
        capture = Capture(output_cap)
        code, timed_out = await run_command(args.command, str(workspace.root), limit, capture, env_names,
                                            sandbox=where, network=network)
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
