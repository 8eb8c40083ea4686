"""The shell tool: exit codes, capped output, the workspace as cwd, no process outliving its call
(in the bubblewrap sandbox and unsandboxed), and none of Ember's secrets in its environment."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from pathlib import Path

import pytest

from ember.config.settings import load_settings
from ember.core.errors import ConfigError
from ember.core.messages import ToolCall
from ember.core.tools import Risk
from ember.tools.approval import Rule, ToolPolicy
from ember.tools.base import ToolRegistry
from ember.tools.sandbox import SandboxMode
from ember.tools.sandboxes import sandbox_choice
from ember.tools.shell import shell_tool
from ember.tools.workspace import Workspaces
from tests.conftest import tool_run


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


def registry(ws: Path, *, timeout_s: float = 10.0, output_cap: int = 30_000,
             env_names: tuple[str, ...] = (), mode: SandboxMode = "auto") -> ToolRegistry:
    return ToolRegistry([shell_tool(Workspaces(ws), sandbox=sandbox_choice(mode), timeout_s=timeout_s,
                                    output_cap=output_cap, env_names=env_names)])


# Where processes are looked for from outside: a pid written inside a PID namespace names another process here.
@pytest.fixture(params=["bubblewrap", "none"])
def mode(request: pytest.FixtureRequest) -> SandboxMode:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def nap() -> str:
    """A sleep of 1000 s spelt uniquely (1000.<digits>), so its processes can be found by their command line."""
    return f"sleep 1000.{secrets.randbelow(10**9):09d}"


async def run(tools: ToolRegistry, command: str, **args: object) -> str:
    arguments = json.dumps({"command": command, **args})
    return await tools.call(ToolCall(id="c", name="shell", arguments=arguments), tool_run())


def running(token: str) -> list[int]:
    """The live processes whose command line holds `token` (a zombie counts as dead)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


async def survivors(token: str, within_s: float = 2.0) -> list[int]:
    """The processes holding `token` still running after waiting up to `within_s`."""
    deadline = time.monotonic() + within_s
    while (living := running(token)) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return living


# The shell, a child shell, and that child's background sleep, each writing its pid down.
FAMILY = ("echo $$ > shell.pid; sh -c 'NAP & echo $! > grandchild.pid; NAP' & "
          "echo $! > child.pid; wait")


async def test_success_returns_exit_code_zero_and_output(ws: Path) -> None:
    assert await run(registry(ws), "echo hello") == "exit code: 0\nhello\n"
    assert await run(registry(ws), "printf 'caf\\303\\251 \\342\\230\\225'") == "exit code: 0\ncafé ☕"


async def test_failure_returns_its_exit_code_with_stderr_interleaved(ws: Path) -> None:
    result = await run(registry(ws), "echo out; echo err >&2; exit 3")
    assert result == "exit code: 3\nout\nerr\n"
    assert await run(registry(ws), "true >/dev/null") == "exit code: 0\n(no output)"


async def test_the_command_runs_in_the_workspace(ws: Path) -> None:
    assert await run(registry(ws), "pwd; echo made > here.txt") == f"exit code: 0\n{ws.resolve()}\n"
    assert (ws / "here.txt").read_text() == "made\n"


async def test_long_output_keeps_head_and_tail_with_a_note(ws: Path) -> None:
    result = await run(registry(ws, output_cap=1000), "seq 1 100000")
    lines = result.splitlines()
    assert lines[:3] == ["exit code: 0", "1", "2"]
    assert lines[-1] == "100000"
    assert len(result) < 1200
    total = len("".join(f"{i}\n" for i in range(1, 100001)))
    assert f"characters of output cut; {total} in all" in result


async def test_a_command_that_never_ends_is_killed_at_its_timeout(ws: Path) -> None:
    result = await run(registry(ws), "sleep 1000", timeout_s=0.5)
    assert result.startswith("exit code: -15 (killed by SIGTERM)\ntimed out after 0.5 s; the process group was killed")


async def test_a_timeout_kills_the_children_too(ws: Path, mode: SandboxMode, nap: str) -> None:
    result = await run(registry(ws, mode=mode), FAMILY.replace("NAP", nap), timeout_s=1)
    assert "timed out after 1 s; the process group was killed" in result
    assert await survivors(nap) == []


async def test_a_command_ignoring_sigterm_is_killed_after_the_grace(ws: Path, mode: SandboxMode, nap: str) -> None:
    result = await run(registry(ws, mode=mode), f"trap '' TERM; {nap} & wait", timeout_s=0.5)
    assert result.startswith("exit code: -9 (killed by SIGKILL)\ntimed out")
    assert await survivors(nap) == []


async def test_the_timeout_asked_for_is_capped_by_the_configured_maximum(ws: Path) -> None:
    result = await run(registry(ws, timeout_s=0.5), "sleep 1000", timeout_s=600)
    assert "timed out after 0.5 s" in result


async def test_a_background_child_left_behind_neither_blocks_nor_survives(ws: Path, mode: SandboxMode,
                                                                         nap: str) -> None:
    result = await run(registry(ws, timeout_s=5, mode=mode), f"{nap} & echo started")
    assert result == "exit code: 0\nstarted\n"  # not "timed out": the child held nothing up
    assert await survivors(nap) == []


# Two ways out of the process group: a new session, and a double fork (the parent gone, the child adopted).
ESCAPEES = "setsid sh -c 'exec NAP' & ( (sh -c 'exec NAP' &) & ); sleep 0.3; echo started"


async def test_a_child_that_left_the_group_is_killed_when_the_command_ends(ws: Path, mode: SandboxMode,
                                                                          nap: str) -> None:
    result = await run(registry(ws, mode=mode), ESCAPEES.replace("NAP", nap))
    assert result == "exit code: 0\nstarted\n"
    assert await survivors(nap) == []


async def test_a_child_that_left_the_group_is_killed_at_the_timeout(ws: Path, mode: SandboxMode, nap: str) -> None:
    result = await run(registry(ws, mode=mode), ESCAPEES.replace("NAP", nap).replace("echo started", nap),
                       timeout_s=1)
    assert "timed out after 1 s" in result
    assert await survivors(nap) == []


async def test_output_after_the_timeout_never_reaches_the_result(ws: Path) -> None:
    # It clears its environment and leaves the session, so nothing finds it to kill: it still writes late.
    command = "setsid env -i /bin/sh -c 'sleep 1.2; echo LATE-OUTPUT' & echo early; sleep 1000"
    result = await run(registry(ws), command, timeout_s=0.5)
    assert "early" in result and "LATE-OUTPUT" not in result


SECRETS = {"EMBER_MODEL_API_KEY": "sk-ember-model-0123456789abcdef", "OPENAI_API_KEY": "sk-openai-0123456789abcdef",
           "GITHUB_TOKEN": "ghp_0123456789abcdefghijklmnop", "AWS_SECRET_ACCESS_KEY": "aws-secret-0123456789",
           "DEPLOY_PASSWORD": "hunter2-0123456789", "SERVICE_KEY": "service-key-0123456789"}


async def test_no_secret_of_the_runtime_reaches_a_command(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TOOL_HOME", "/opt/tool")
    # Even named in shell_env, a secret-like variable stays out (the config refuses such names too).
    tools = registry(ws, env_names=("TOOL_HOME", "GITHUB_TOKEN"))
    result = await run(tools, "env; cat /proc/$$/environ | tr '\\0' '\\n'")
    for value in SECRETS.values():
        assert value not in result
    assert "EMBER_" not in result
    listed = dict(line.split("=", 1) for line in result.splitlines()[1:] if "=" in line)
    assert listed["TOOL_HOME"] == "/opt/tool" and listed["PATH"] and listed["HOME"]


async def test_cancelling_the_call_kills_the_process_group(ws: Path, mode: SandboxMode, nap: str) -> None:
    call = asyncio.create_task(run(registry(ws, mode=mode), FAMILY.replace("NAP", nap)))
    for _ in range(250):
        if all((ws / name).exists() and (ws / name).read_text().strip()
               for name in ("shell.pid", "child.pid", "grandchild.pid")):
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("the command did not start")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await survivors(nap) == []


async def test_a_call_cancelled_while_it_starts_leaves_nothing_running(ws: Path, mode: SandboxMode, nap: str) -> None:
    tools = registry(ws, mode=mode)
    await run(tools, "true")  # the sandbox is found: what follows is the start itself
    for turns in range(12):  # of the event loop before the cancel: before, during and after the fork
        call = asyncio.create_task(run(tools, FAMILY.replace("NAP", nap)))
        for _ in range(turns):
            await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    await asyncio.sleep(0.5)  # what escaped has started its sleeps by now
    assert running(nap) == []


async def test_the_event_loop_keeps_running_during_a_command(ws: Path) -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await run(registry(ws), "sleep 0.3")
    ticker.cancel()
    assert ticks >= 10


def test_approval_sees_the_command_as_the_subject(ws: Path) -> None:
    tools = registry(ws)
    action = tools.describe(ToolCall(id="c", name="shell", arguments='{"command": "pytest -q tests"}'))
    assert (action.risk, action.subject, action.summary) == (Risk.EXECUTE, "pytest -q tests",
                                                            "run the shell command pytest -q tests")
    policy = ToolPolicy(rules=[Rule(tool="shell", subject="pytest*", decision="allow")])
    assert policy.decide(action) == "allow"
    other = tools.describe(ToolCall(id="c", name="shell", arguments='{"command": "rm -rf /"}'))
    assert policy.decide(other) == "ask"


def test_shell_env_refuses_a_secret_or_an_ember_setting_by_name() -> None:
    home = Path(os.environ["EMBER_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "ember.toml").write_text('shell_env = ["TOOL_HOME", "JAVA_HOME"]\n')
    assert load_settings().shell_env == ["TOOL_HOME", "JAVA_HOME"]
    for refused in ("OPENAI_API_KEY", "EMBER_MODEL", "GITHUB_TOKEN", "DB_PASSWORD", "not a name"):
        (home / "ember.toml").write_text(f'shell_env = ["{refused}"]\n')
        with pytest.raises(ConfigError, match="shell_env"):
            load_settings()
