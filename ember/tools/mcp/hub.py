"""An MCP server's tools as the model sees them, and the hub that starts, lists and stops the servers."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.core.tools import Risk, ToolAction, ToolRun, ToolSpec
from ember.tools.base import Tool, ToolFailure
from ember.tools.mcp.config import McpServerConfig
from ember.tools.mcp.connection import McpConnection, State

if TYPE_CHECKING:
    from mcp import types

log = logging.getLogger(__name__)

MAX_TOOL_NAME = 64  # model APIs refuse longer function names


class McpTool:
    """One tool of an MCP server, as the model sees it: `server__tool`, the server's schema."""

    def __init__(self, connection: McpConnection, remote: types.Tool, name: str) -> None:
        self._connection = connection
        self._remote = remote.name
        description = remote.description or f"{remote.name} from the MCP server {connection.name}"
        self._spec = ToolSpec(name=name, description=description, parameters=remote.input_schema)
        self._validator = _validator(remote.input_schema, name)

    @property
    def spec(self) -> ToolSpec:
        return self._spec

    def describe(self, arguments: dict[str, Any]) -> ToolAction:
        self._check(arguments)
        subject = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        return ToolAction(tool=self._spec.name, risk=self._connection.config.risk, subject=subject,
                          summary=f"call {self._remote} on MCP server {self._connection.name} with {subject}")

    async def run(self, arguments: dict[str, Any], run: ToolRun) -> str:
        self._check(arguments)
        return await self._connection.call(self._remote, arguments)

    def _check(self, arguments: dict[str, Any]) -> None:
        if not isinstance(arguments, dict):
            raise ToolFailure(f"the arguments for {self._spec.name} must be a JSON object.")
        if self._validator is None:
            return  # the server validates
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(map(str, e.absolute_path)))
        if errors:
            problems = "; ".join(f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
                                 for e in errors[:5])
            raise ToolFailure(f"invalid arguments for {self._spec.name}: {problems}")


def _validator(schema: dict[str, Any], tool: str) -> Any:
    """A jsonschema validator for `schema`, or None (no jsonschema, or a schema it cannot read)."""
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        log.warning("MCP tool %s: its input schema is invalid (%s); the server validates its arguments",
                    tool, exc.message)
        return None
    return cls(schema)


def tool_name(server: str, tool: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{server}__{tool}")[:MAX_TOOL_NAME]


@dataclass(frozen=True, slots=True)
class ServerStatus:
    name: str
    transport: str  # "stdio" or "streamable-http"
    target: str  # the command line or URL, secrets hidden
    state: State
    error: str | None
    risk: Risk
    tools: tuple[str, ...]  # as the model sees them: server__tool


class McpHub:
    """The configured MCP servers: their tools, their state, and their shutdown."""

    def __init__(self, connections: Sequence[McpConnection]) -> None:
        self._connections = list(connections)
        self._tools: list[McpTool] = []
        self._names: dict[str, list[str]] = {c.name: [] for c in self._connections}
        taken: set[str] = set()
        for connection in self._connections:
            for remote in connection.tools:
                name = _unique(tool_name(connection.name, remote.name), taken)
                self._tools.append(McpTool(connection, remote, name))
                self._names[connection.name].append(name)

    def tools(self) -> list[Tool]:
        return list(self._tools)

    def status(self) -> list[ServerStatus]:
        return [
            ServerStatus(c.name, c.config.transport, c.config.target(), c.state, c.error, c.config.risk,
                         tuple(self._names[c.name]))
            for c in self._connections
        ]

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._connections))


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        suffix = f"_{n}"
        candidate = name[: MAX_TOOL_NAME - len(suffix)] + suffix
    if candidate != name:
        log.warning("MCP tool name %s is taken; registered as %s", name, candidate)
    taken.add(candidate)
    return candidate


async def start_mcp(configs: Mapping[str, McpServerConfig]) -> McpHub:
    """Connect every enabled server at once. A server that fails is in status() with
    its error and has no tools; a disabled one is 'stopped'."""
    connections = [McpConnection(name, config) for name, config in configs.items()]
    try:
        await asyncio.gather(*(c.connect() for c in connections if c.config.enabled))
    except BaseException:
        await asyncio.gather(*(c.close() for c in connections))
        raise
    for c in connections:
        if c.state == "failed":
            log.warning("MCP server %s is unavailable: %s", c.name, c.error)
    return McpHub(connections)
