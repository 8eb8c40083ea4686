"""The Tool and Toolset protocols, and the registry that validates and runs calls.

A tool failure is a result the model reads and can correct, never a crash of
the turn: bad JSON, invalid arguments, an unknown tool and a tool that raises
all come back as text starting with "Error:".
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from ember.core.messages import ToolCall
from ember.core.tools import ToolSpec

log = logging.getLogger(__name__)

MAX_RESULT_CHARS = 16_000

Args = TypeVar("Args", bound=BaseModel)


class Risk(enum.StrEnum):
    READ = "read"
    WRITE = "write"
    EXECUTE = "execute"
    NETWORK = "network"


class ToolFailure(Exception):
    """Raised by a tool to tell the model, in plain words, why it could not act."""


class Tool(Protocol):
    @property
    def spec(self) -> ToolSpec: ...

    @property
    def risk(self) -> Risk: ...

    async def run(self, arguments: dict[str, object]) -> str: ...


class FunctionTool(Generic[Args]):
    """A tool from an async function taking one pydantic model: the model's JSON
    schema is what the LLM sees, and it validates the arguments before the call."""

    def __init__(self, name: str, description: str, args: type[Args], fn: Callable[[Args], Awaitable[str]],
                 *, risk: Risk) -> None:
        self._args = args
        self._fn = fn
        self._risk = risk
        self._spec = ToolSpec(name=name, description=description, parameters=args.model_json_schema())

    @property
    def spec(self) -> ToolSpec:
        return self._spec

    @property
    def risk(self) -> Risk:
        return self._risk

    async def run(self, arguments: dict[str, object]) -> str:
        try:
            parsed = self._args.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
            raise ToolFailure(f"invalid arguments for {self._spec.name}: {problems}") from exc
        return await self._fn(parsed)


class Toolset(Protocol):
    def specs(self) -> list[ToolSpec]: ...

    async def call(self, call: ToolCall) -> str: ...


def cap_result(text: str, limit: int = MAX_RESULT_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[output truncated: showing {limit} of {len(text)} characters]"


class ToolRegistry:
    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        name = tool.spec.name
        if name in self._tools:
            raise ValueError(f"a tool named {name!r} is already registered")
        self._tools[name] = tool

    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self._tools.values()]

    async def call(self, call: ToolCall) -> str:
        tool = self._tools.get(call.name)
        if tool is None:
            return f"Error: there is no tool named {call.name!r}. Available: {', '.join(self._tools) or 'none'}."
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError as exc:
            return f"Error: the arguments for {call.name} are not valid JSON ({exc.msg} at position {exc.pos})."
        if not isinstance(arguments, dict):
            return f"Error: the arguments for {call.name} must be a JSON object."
        try:
            return cap_result(await tool.run(arguments))
        except ToolFailure as exc:
            return f"Error: {exc}"
        except Exception as exc:  # a tool's own bug is the model's result, not the turn's crash
            log.warning("tool %s raised", call.name, exc_info=True)
            return f"Error: {call.name} failed unexpectedly: {type(exc).__name__}: {exc}"
