"""MCP servers as tools, against a real server written with the SDK (tests/mcp_servers/notes_server.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from pydantic import ValidationError

from ember.config.settings import Settings, load_settings
from ember.core.errors import ConfigError
from ember.core.messages import Role, ToolCall
from ember.core.tools import Risk
from ember.models.base import ModelReply
from ember.models.scripted import ScriptedModel
from ember.tools.approval import ToolPolicy
from ember.tools.base import ToolRegistry
from ember.tools.mcp import McpHub, McpServerConfig, result_text, start_mcp, tool_name
from tests.conftest import session_key, tool_run

# The async tests share one event loop, and so the module's hub of running servers.
shared_loop = pytest.mark.asyncio(loop_scope="module")

SERVER = str(Path(__file__).parent / "mcp_servers" / "notes_server.py")
EMBER = str(Path(sys.executable).parent / "ember")
SECRET = "s3cr3t-token-value"


def notes(**overrides: Any) -> McpServerConfig:
    return McpServerConfig(command=sys.executable, args=[SERVER], **overrides)


async def call(hub: McpHub, tool: str, **arguments: Any) -> str:
    return await ToolRegistry(hub.tools()).call(ToolCall("c1", tool, json.dumps(arguments)), tool_run())


@asynccontextmanager
async def hub_of(**configs: McpServerConfig) -> AsyncIterator[McpHub]:
    hub = await start_mcp(configs)
    try:
        yield hub
    finally:
        await hub.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hub() -> AsyncIterator[McpHub]:
    """notes (risk read) and exec (the same server, risk execute), and a server that cannot start."""
    async with hub_of(notes=notes(risk=Risk.READ, env={"NOTES_TOKEN": SECRET}), exec=notes(),
                      missing=McpServerConfig(command="/nonexistent/mcp-server")) as started:
        yield started


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# --- configuration -----------------------------------------------------------------


def test_a_server_is_a_command_or_a_url() -> None:
    for bad in ({}, {"command": "x", "url": "http://h/mcp"}, {"url": "ftp://h/mcp"},
                {"url": "http://h/mcp", "env": {"A": "b"}}, {"command": "x", "headers": {"A": "b"}},
                {"command": "x", "risk": "dangerous"}, {"command": "x", "colour": "red"}):
        with pytest.raises(ValidationError):
            McpServerConfig.model_validate(bad)
    assert McpServerConfig(url="https://h/mcp").transport == "streamable-http"
    assert McpServerConfig(command="x").risk is Risk.EXECUTE


def test_listings_show_secret_names_not_values() -> None:
    stdio = McpServerConfig(command="srv", args=["--key", SECRET], env={"API_TOKEN": SECRET})
    http = McpServerConfig(url=f"https://me:{SECRET}@h/mcp", headers={"Authorization": f"Bearer {SECRET}"})
    assert stdio.target() == "srv --key [redacted] (API_TOKEN=[redacted])"
    assert http.target() == "https://me:[redacted]@h/mcp (Authorization: [redacted])"
    assert SECRET not in repr(stdio.env) + repr(http.headers)


def test_settings_read_mcp_servers_from_ember_toml() -> None:
    home = Path(os.environ["EMBER_HOME"])
    home.mkdir(parents=True)
    (home / "ember.toml").write_text('[mcp_servers.notes]\ncommand = "srv"\nrisk = "read"\n')
    assert load_settings().mcp_servers["notes"].risk is Risk.READ
    (home / "ember.toml").write_text('[mcp_servers."bad name"]\ncommand = "srv"\n')
    with pytest.raises(ConfigError, match="mcp_servers"):
        load_settings()


def test_tool_names_are_sanitized_and_short() -> None:
    assert tool_name("notes", "add") == "notes__add"
    assert tool_name("fs", "read file.v2") == "fs__read_file_v2"
    assert len(tool_name("s", "x" * 100)) == 64


def test_result_content_is_joined_and_summarized() -> None:
    from mcp import types

    result = types.CallToolResult(content=[
        types.TextContent(text="two items:"),
        types.EmbeddedResource(resource=types.TextResourceContents(uri="file:///a.txt", text="alpha")),
        types.EmbeddedResource(resource=types.BlobResourceContents(uri="file:///b.bin", blob="AAAA",
                                                                   mime_type="application/zip")),
        types.AudioContent(data="AAA=", mime_type="audio/wav"),
        types.ResourceLink(uri="file:///c.md", name="c"),
    ])
    assert result_text(result) == ("two items:\n[resource file:///a.txt]\nalpha\n"
                                   "[resource file:///b.bin, application/zip, 3 bytes]\n[audio/wav, 2 bytes]\n"
                                   "[resource link file:///c.md: c]")
    assert result_text(types.CallToolResult(content=[], structured_content={"n": 1})) == '{"n": 1}'


# --- a stdio server ----------------------------------------------------------------


@shared_loop
async def test_tools_appear_with_the_servers_schemas(hub: McpHub) -> None:
    tools = {tool.spec.name: tool.spec for tool in hub.tools()}
    assert {"notes__add", "notes__echo", "notes__slow", "exec__add"} <= tools.keys()
    assert not any(name.startswith("missing__") for name in tools)
    add = tools["notes__add"]
    assert add.description == "Add two integers."
    assert add.parameters["required"] == ["a", "b"] and add.parameters["properties"]["a"]["type"] == "integer"


@shared_loop
async def test_a_call_returns_the_servers_result(hub: McpHub) -> None:
    assert await call(hub, "notes__add", a=2, b=40) == "42"
    assert await call(hub, "notes__echo", text="hé") == "hé"
    assert await call(hub, "notes__env_value", name="NOTES_TOKEN") == SECRET  # env reaches the server
    assert await call(hub, "notes__picture") == "a pixel:\n[image/png, 70 bytes]"


@shared_loop
async def test_an_error_result_and_bad_arguments_are_errors(hub: McpHub) -> None:
    failed = await call(hub, "notes__fail")
    assert failed.startswith("Error: fail on MCP server 'notes' failed") and "the notebook is locked" in failed
    bad = await call(hub, "notes__add", a="two")
    assert bad.startswith("Error: invalid arguments for notes__add:")
    assert "a: 'two' is not of type 'integer'" in bad and "'b' is a required property" in bad
    not_object = await ToolRegistry(hub.tools()).call(ToolCall("c1", "notes__add", "[1, 2]"), tool_run())
    assert not_object == "Error: the arguments for notes__add must be a JSON object."


@shared_loop
async def test_the_call_as_a_person_judges_it(hub: McpHub) -> None:
    action = ToolRegistry(hub.tools()).describe(ToolCall("c1", "exec__add", '{"a": 1, "b": 2}'))
    assert (action.tool, action.risk, action.subject) == ("exec__add", Risk.EXECUTE, '{"a":1,"b":2}')
    assert action.summary == 'call add on MCP server exec with {"a":1,"b":2}'


@shared_loop
async def test_a_server_that_cannot_start_is_reported_and_the_others_serve(hub: McpHub) -> None:
    status = {s.name: s for s in hub.status()}
    assert status["missing"].state == "failed" and status["missing"].tools == ()
    assert status["missing"].error == "cannot start '/nonexistent/mcp-server': no such file or command"
    assert status["notes"].state == "connected" and status["notes"].error is None
    assert "notes__add" in status["notes"].tools
    assert status["notes"].target == f"{sys.executable} {SERVER} (NOTES_TOKEN=[redacted])"


@shared_loop
async def test_a_crash_mid_call_is_an_error_and_the_next_call_reconnects() -> None:
    async with hub_of(notes=notes(timeout_s=20)) as hub:
        first_pid = int(await call(hub, "notes__pid"))
        crashed = await call(hub, "notes__crash")  # at once, not at the 20 s timeout: the message says why
        assert crashed.startswith("Error: MCP server 'notes' stopped while running tool crash")
        assert hub.status()[0].state == "failed"
        assert int(await call(hub, "notes__pid")) != first_pid
        assert hub.status()[0].state == "connected"
        assert await call(hub, "notes__add", a=1, b=1) == "2"


@shared_loop
async def test_a_server_killed_mid_call_is_an_error_and_the_next_call_reconnects() -> None:
    async with hub_of(notes=notes(timeout_s=20)) as hub:
        pid = int(await call(hub, "notes__pid"))
        slow = asyncio.create_task(call(hub, "notes__slow", seconds=30))
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        result = await slow
        assert result.startswith("Error: MCP server 'notes' stopped while running tool slow")
        new_pid = int(await call(hub, "notes__pid"))
        assert new_pid != pid
    assert gone(new_pid)  # close() stopped the child it started
    assert await call(hub, "notes__pid") == "Error: MCP server 'notes' is stopped"


@shared_loop
async def test_a_hung_server_is_an_error_within_its_timeout() -> None:
    async with hub_of(notes=notes(timeout_s=1)) as hub:
        pid = int(await call(hub, "notes__pid"))
        result = await call(hub, "notes__slow", seconds=30)
        assert result == ("Error: MCP server 'notes' did not answer within 1 s while running tool slow; "
                          "it will be restarted on the next call.")
        assert await call(hub, "notes__add", a=2, b=2) == "4"
        for _ in range(200):  # the hung server was stopped in the background
            if gone(pid):
                break
            await asyncio.sleep(0.05)
        assert gone(pid)


# --- streamable HTTP ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.close()
        await writer.wait_closed()
        return
    raise TimeoutError(f"the HTTP MCP server did not listen on {port}")


@shared_loop
async def test_a_streamable_http_server() -> None:
    port = free_port()
    process = subprocess.Popen([sys.executable, SERVER, "--http", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await listening(port, process)
        url = f"http://127.0.0.1:{port}/mcp"
        async with hub_of(web=McpServerConfig(url=url, headers={"X-Api-Key": SECRET})) as hub:
            assert await call(hub, "web__add", a=20, b=22) == "42"
            [status] = hub.status()
            assert (status.transport, status.state, status.target) == (
                "streamable-http", "connected", f"{url} (X-Api-Key: [redacted])")
    finally:
        process.terminate()
        process.wait(10)


# --- the agent ---------------------------------------------------------------------


def adds(server: str) -> ScriptedModel:
    return ScriptedModel([
        ModelReply(tool_calls=(ToolCall("call-1", f"{server}__add", '{"a": 2, "b": 3}'),)),
        ModelReply(text="2 + 3 = 5"),
    ])


@shared_loop
async def test_the_agent_calls_an_mcp_tool(start, hub: McpHub) -> None:  # type: ignore[no-untyped-def]
    model = adds("notes")
    async with start(model, tools=ToolRegistry(hub.tools())) as h:
        final = await h.turn("what is 2 + 3?")
        history = await h.runtime.sessions.history(session_key())
    assert final.text == "2 + 3 = 5"
    assert [m.content for m in history if m.role is Role.TOOL] == ["5"]
    model.assert_complete()


@shared_loop
async def test_an_execute_mcp_tool_is_denied_by_the_default_policy(start, hub: McpHub) -> None:  # type: ignore[no-untyped-def]
    async with start(adds("exec"), tools=ToolRegistry(hub.tools())) as h:
        await h.turn("what is 2 + 3?")
        history = await h.runtime.sessions.history(session_key())
    [result] = [m.content for m in history if m.role is Role.TOOL]
    assert result.startswith('Error: not permitted to call add on MCP server exec with {"a":2,"b":3}')


@shared_loop
async def test_a_policy_can_allow_a_servers_tools(start, settings: Settings, hub: McpHub) -> None:  # type: ignore[no-untyped-def]
    config = settings.model_copy(update={"tool_policy": ToolPolicy(tools={"exec__*": "allow"})})
    async with start(adds("exec"), tools=ToolRegistry(hub.tools()), config=config) as h:
        await h.turn("what is 2 + 3?")
        history = await h.runtime.sessions.history(session_key())
    assert [m.content for m in history if m.role is Role.TOOL] == ["5"]


# --- ember mcp list ----------------------------------------------------------------


def ember_mcp_list(home: Path, toml: str) -> subprocess.CompletedProcess[str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "ember.toml").write_text(toml)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "OPENAI_"))}
    env |= {"EMBER_HOME": str(home), "PYTHONPATH": str(Path(__file__).parent.parent), "COLUMNS": "250"}
    return subprocess.run([EMBER, "mcp", "list"], env=env, capture_output=True, text=True, timeout=60)


def test_ember_mcp_list(tmp_path: Path) -> None:
    shown = ember_mcp_list(tmp_path / "home", f"""
[mcp_servers.notes]
command = {json.dumps(sys.executable)}
args = [{json.dumps(SERVER)}]
env = {{ NOTES_TOKEN = "{SECRET}" }}
risk = "read"

[mcp_servers.broken]
command = "/nonexistent/mcp-server"
headers = {{}}
""")
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "notes" in text and "connected" in text and "notes__add" in text and "notes__slow" in text
    assert "NOTES_TOKEN=[redacted]" in text
    assert "broken" in text and "failed" in text and "no such file or command" in text
    assert SECRET not in shown.stdout + shown.stderr


def test_ember_mcp_list_rejects_a_bad_configuration(tmp_path: Path) -> None:
    shown = ember_mcp_list(tmp_path / "home", '[mcp_servers.both]\ncommand = "x"\nurl = "http://h/mcp"\n')
    assert shown.returncode == 2
    assert "set exactly one of `command`" in shown.stderr
