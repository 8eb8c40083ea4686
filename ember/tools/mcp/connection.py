"""One MCP server's connection: its transport, its session, and the task that supervises them.

The SDK's transports and session are anyio context managers that must be
entered and exited in one task, so each connection attempt runs in its own
supervisor task:

    supervisor:  open transport -> session -> initialize -> list tools -> ready
                 wait until stopped or the server hangs up -> exit the contexts
                 (a stdio child is stopped: stdin closed, then SIGTERM, SIGKILL)
    call:        reconnect once if the connection is down; send through the
                 session; a closed connection or no answer within timeout_s
                 ends the call with an "Error:" result and marks the connection
                 down, so the next call starts a fresh one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import IO, TYPE_CHECKING, Any, Literal

import anyio

from ember.tools.base import ToolFailure
from ember.tools.mcp.config import McpServerConfig

if TYPE_CHECKING:
    from mcp import types
    from mcp.client.session import ClientSession

log = logging.getLogger(__name__)

State = Literal["connected", "failed", "stopped"]
# Beyond the SDK's own per-request timeout, before a call is abandoned regardless.
_GRACE_S = 5.0
# How long close() lets supervisors stop their servers before cancelling them.
_CLOSE_S = 8.0
_STDERR_TAIL_CHARS = 600


class _Link:
    """One connection attempt: its session once ready, and the event that ends its supervisor."""

    def __init__(self) -> None:
        self.session: ClientSession | None = None
        self.wake = asyncio.Event()
        self.hung_up = False

    def hang_up(self) -> None:
        if not self.wake.is_set():  # the stream also ends when we stop it ourselves
            self.hung_up = True
            self.wake.set()

    @property
    def usable(self) -> bool:
        return self.session is not None and not self.wake.is_set()


class _WatchedReadStream:
    """The transport's read stream, reporting when the server hangs up."""

    def __init__(self, inner: Any, on_end: Callable[[], None]) -> None:
        self._inner = inner
        self._on_end = on_end

    @property
    def last_context(self) -> Any:  # the SDK reads the sender's context this way, when a stream has one
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._on_end()
            raise

    def __aiter__(self) -> _WatchedReadStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except (StopAsyncIteration, anyio.ClosedResourceError):
            self._on_end()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _WatchedReadStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class McpConnection:
    """One MCP server, connected on demand; see the module docstring for the lifecycle."""

    def __init__(self, name: str, config: McpServerConfig) -> None:
        self.name = name
        self.config = config
        self.state: State = "stopped"
        self.error: str | None = None
        # As listed by the latest successful connection.
        self.tools: list[types.Tool] = []
        self._live: _Link | None = None
        self._lock = asyncio.Lock()
        self._supervisors: dict[asyncio.Task[None], _Link] = {}
        self._closed = False

    async def connect(self) -> bool:
        """Start a supervisor and wait until it is ready: True, or False with `state` and `error` saying why."""
        if self._live is not None:
            self._live.wake.set()
            self._live = None
        link = _Link()
        ready: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._supervise(link, ready), name=f"mcp-server:{self.name}")
        self._supervisors[task] = link
        task.add_done_callback(lambda done: self._supervisors.pop(done, None))
        try:
            failure = await asyncio.wait_for(asyncio.shield(ready), 2 * self.config.startup_timeout_s + _GRACE_S)
        except TimeoutError:
            task.cancel()
            failure = f"not ready within {2 * self.config.startup_timeout_s:g} s"
        if failure is not None or self._closed:
            link.wake.set()
            self.state, self.error = ("stopped", None) if self._closed else ("failed", failure)
            return False
        self._live, self.state, self.error = link, "connected", None
        return True

    async def call(self, tool: str, arguments: dict[str, Any]) -> str:
        """The tool's result text; every failure, the server's own included, raises ToolFailure."""
        from mcp import types
        from mcp.shared.exceptions import MCPError

        link = await self._usable_link()
        assert link.session is not None
        timeout = self.config.timeout_s
        try:
            async with asyncio.timeout(timeout + _GRACE_S):
                result = await link.session.call_tool(tool, arguments, read_timeout_seconds=timeout)
        except TimeoutError:
            raise self._lost(link, tool, f"did not answer within {timeout:g} s") from None
        except MCPError as exc:
            if exc.code == types.REQUEST_TIMEOUT:
                raise self._lost(link, tool, f"did not answer within {timeout:g} s") from None
            if exc.code == types.CONNECTION_CLOSED:
                raise self._lost(link, tool, "stopped") from None
            raise ToolFailure(f"MCP server {self.name!r} refused {tool}: {exc.message}") from exc
        except Exception as exc:  # the edge to another process: its failures are the model's result
            log.warning("MCP server %s failed while running %s", self.name, tool, exc_info=True)
            raise self._lost(link, tool, f"failed ({type(exc).__name__}: {exc})") from exc
        text = result_text(result)
        if result.is_error:
            raise ToolFailure(f"{tool} on MCP server {self.name!r} failed: {text or 'no details given'}")
        return text

    async def close(self) -> None:
        """Stop every supervisor (and so every stdio child), within about _CLOSE_S seconds."""
        self._closed = True
        self._live = None
        self.state, self.error = "stopped", None
        for link in self._supervisors.values():
            link.wake.set()
        tasks = list(self._supervisors)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=_CLOSE_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=_CLOSE_S)

    async def _usable_link(self) -> _Link:
        link = self._live
        if link is not None and link.usable:
            return link
        async with self._lock:
            if self._live is not None and self._live.usable:
                return self._live
            if self._closed:
                raise ToolFailure(f"MCP server {self.name!r} is stopped")
            if not await self.connect():
                raise ToolFailure(f"MCP server {self.name!r} is unavailable: {self.error}")
            assert self._live is not None
            return self._live

    def _lost(self, link: _Link, tool: str, what: str) -> ToolFailure:
        self._down(link, f"{what} while running {tool}")
        return ToolFailure(f"MCP server {self.name!r} {what} while running tool {tool}; "
                           "it will be restarted on the next call.")

    def _down(self, link: _Link, reason: str) -> None:
        link.wake.set()
        if self._live is link:
            self._live, self.state, self.error = None, "failed", reason

    async def _supervise(self, link: _Link, ready: asyncio.Future[str | None]) -> None:
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
            try:
                await self._serve(link, ready, errlog)
                failure = "the server closed the connection" if link.hung_up else None
            except Exception as exc:  # the edge to another process; reported through state and error
                log.info("MCP server %s: connection ended", self.name, exc_info=True)
                failure = _reason(exc, self.config)
            if failure is None and not ready.done():
                failure = "the connection ended before it was ready"
            if failure is not None:
                failure = self.config.scrub(failure + _tail(errlog))
                if not ready.done():
                    ready.set_result(failure)
                self._down(link, failure)

    async def _serve(self, link: _Link, ready: asyncio.Future[str | None], errlog: IO[str]) -> None:
        from mcp.client.session import ClientSession

        async with AsyncExitStack() as stack:
            read, write = await self._open_transport(stack, errlog)
            session = await stack.enter_async_context(
                ClientSession(_WatchedReadStream(read, link.hang_up), write,
                              read_timeout_seconds=self.config.startup_timeout_s)
            )
            await session.initialize()
            self.tools = await _list_tools(session)
            link.session = session
            ready.set_result(None)
            await link.wake.wait()

    async def _open_transport(self, stack: AsyncExitStack, errlog: IO[str]) -> tuple[Any, Any]:
        config = self.config
        if config.command is not None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(
                command=config.command, args=config.args, cwd=config.cwd,
                env={name: value.get_secret_value() for name, value in config.env.items()} or None,
            )
            return await stack.enter_async_context(stdio_client(params, errlog=errlog))
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        assert config.url is not None
        client = await stack.enter_async_context(httpx2.AsyncClient(
            headers={name: value.get_secret_value() for name, value in config.headers.items()},
            timeout=httpx2.Timeout(config.timeout_s, read=300.0),
        ))
        return await stack.enter_async_context(streamable_http_client(config.url, http_client=client))


async def _list_tools(session: ClientSession) -> list[types.Tool]:
    from mcp import types

    listing = await session.list_tools()
    tools = list(listing.tools)
    while listing.next_cursor is not None:
        listing = await session.list_tools(params=types.PaginatedRequestParams(cursor=listing.next_cursor))
        tools.extend(listing.tools)
    return tools


def _reason(exc: BaseException, config: McpServerConfig) -> str:
    from mcp import types
    from mcp.shared.exceptions import MCPError

    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, MCPError) and exc.code == types.CONNECTION_CLOSED:
        return "the server closed the connection while starting"
    if isinstance(exc, MCPError) and exc.code == types.REQUEST_TIMEOUT:
        return f"no answer while starting within {config.startup_timeout_s:g} s"
    if isinstance(exc, FileNotFoundError) and config.command is not None:
        return f"cannot start {config.command!r}: no such file or command"
    if isinstance(exc, OSError) and config.command is not None:
        return f"cannot start {config.command!r}: {exc}"
    return str(exc) or type(exc).__name__


def _tail(errlog: IO[str]) -> str:
    errlog.flush()
    errlog.seek(0)
    text = errlog.read().strip()
    if not text:
        return ""
    return f"; its stderr ended with: {text[-_STDERR_TAIL_CHARS:]}"


def result_text(result: types.CallToolResult) -> str:
    """Text content joined; images, audio and resources summarized by type and size."""
    from mcp import types

    parts: list[str] = []
    for item in result.content:
        if isinstance(item, types.TextContent):
            parts.append(item.text)
        elif isinstance(item, types.ImageContent | types.AudioContent):
            parts.append(f"[{item.mime_type}, {_decoded_size(item.data)} bytes]")
        elif isinstance(item, types.EmbeddedResource):
            resource = item.resource
            if isinstance(resource, types.TextResourceContents):
                parts.append(f"[resource {resource.uri}]\n{resource.text}")
            else:
                kind = resource.mime_type or "binary"
                parts.append(f"[resource {resource.uri}, {kind}, {_decoded_size(resource.blob)} bytes]")
        elif isinstance(item, types.ResourceLink):
            parts.append(f"[resource link {item.uri}: {item.name}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _decoded_size(data: str) -> int:
    data = data.strip()
    return len(data) * 3 // 4 - (len(data) - len(data.rstrip("=")))

