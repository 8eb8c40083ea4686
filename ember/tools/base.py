"""The Tool and Toolset protocols, and the registry that validates and runs calls.

A tool failure is a result the model reads and can correct, never a crash of
the turn: bad JSON, invalid arguments, an unknown tool and a tool that raises
all come back as text starting with "Error:".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from ember.core.messages import ToolCall
from ember.core.tools import Risk, ToolAction, ToolRun, ToolSpec

log = logging.getLogger(__name__)

# What the store keeps of one result; the model is shown less (see pipeline.prompt).
MAX_STORED_RESULT_CHARS = 1_000_000

Args = TypeVar("Args", bound=BaseModel)


class ToolFailure(Exception):
    """Raised by a tool to tell the model, in plain words, why it could not act."""


class Tool(Protocol):
    @property
    def spec(self) -> ToolSpec: ...

    def describe(self, arguments: dict[str, Any]) -> ToolAction:
        """The call as a person would judge it; ToolFailure when the arguments are invalid."""
        ...

    async def run(self, arguments: dict[str, Any], run: ToolRun) -> str: ...


class FunctionTool(Generic[Args]):
    """A tool from an async function taking one pydantic model: the model's JSON
    schema is what the LLM sees, and it validates the arguments before the call.

    `subject` names what the call acts on (a path, a command, a URL), for
    approval rules and prompts; `verb` says what it does ("write the file").
    """

    def __init__(self, name: str, description: str, args: type[Args], fn: Callable[[Args], Awaitable[str]],
                 *, risk: Risk, subject: Callable[[Args], str] | None = None, verb: str | None = None) -> None:
        self._args = args
        self._fn = fn
        self._risk = risk
        self._subject = subject
        self._verb = verb or f"call {name} with"
        self._spec = ToolSpec(name=name, description=description, parameters=args.model_json_schema())

    @property
    def spec(self) -> ToolSpec:
        return self._spec

    def describe(self, arguments: dict[str, Any]) -> ToolAction:
        parsed = self._parse(arguments)
        subject = self._subject(parsed) if self._subject else parsed.model_dump_json(exclude_defaults=True)
        return ToolAction(tool=self._spec.name, risk=self._risk, subject=subject, summary=f"{self._verb} {subject}")

    async def run(self, arguments: dict[str, Any], run: ToolRun) -> str:
        return await self._fn(self._parse(arguments))

    def _parse(self, arguments: dict[str, Any]) -> Args:
        return parsed_arguments(self._args, arguments, self._spec.name)


def parsed_arguments(model: type[Args], arguments: dict[str, Any], tool: str) -> Args:
    """`arguments` as `model`; ToolFailure naming every problem, for the model to correct."""
    try:
        return model.model_validate(arguments)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
        raise ToolFailure(f"invalid arguments for {tool}: {problems}") from exc


class TurnTool(FunctionTool[Args]):
    """A FunctionTool whose function also sees the turn it runs in (whose memory, say)."""

    def __init__(self, name: str, description: str, args: type[Args],
                 fn: Callable[[Args, ToolRun], Awaitable[str]], *, risk: Risk,
                 subject: Callable[[Args], str] | None = None, verb: str | None = None) -> None:
        async def without_turn(_: Args) -> str:
            raise AssertionError(f"{name} needs its turn")

        super().__init__(name, description, args, without_turn, risk=risk, subject=subject, verb=verb)
        self._turn_fn = fn

    async def run(self, arguments: dict[str, Any], run: ToolRun) -> str:
        return await self._turn_fn(self._parse(arguments), run)


class Toolset(Protocol):
    def specs(self) -> list[ToolSpec]: ...

    def describe(self, call: ToolCall) -> ToolAction:
        """The call as a person would judge it; ToolFailure for an unknown tool or invalid arguments."""
        ...

    async def call(self, call: ToolCall, run: ToolRun) -> str:
        """Run the call; every failure is a result starting with "Error:"."""
        ...


def cap_result(text: str, limit: int) -> str:
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

    def describe(self, call: ToolCall) -> ToolAction:
        tool, arguments = self._resolve(call)
        return tool.describe(arguments)

    async def call(self, call: ToolCall, run: ToolRun) -> str:
        try:
            tool, arguments = self._resolve(call)
            return cap_result(await tool.run(arguments, run), MAX_STORED_RESULT_CHARS)
        except ToolFailure as exc:
            return f"Error: {exc}"
        except Exception as exc:  # a tool's own bug is the model's result, not the turn's crash
            log.warning("tool %s raised", call.name, exc_info=True)
            return f"Error: {call.name} failed unexpectedly: {type(exc).__name__}: {exc}"

    def _resolve(self, call: ToolCall) -> tuple[Tool, dict[str, Any]]:
        tool = self._tools.get(call.name)
        if tool is None:
            raise ToolFailure(f"there is no tool named {call.name!r}. Available: {', '.join(self._tools) or 'none'}.")
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError as exc:
            raise ToolFailure(
                f"the arguments for {call.name} are not valid JSON ({exc.msg} at position {exc.pos})."
            ) from exc
        if not isinstance(arguments, dict):
            raise ToolFailure(f"the arguments for {call.name} must be a JSON object.")
        return tool, arguments


class Toolsets:
    """Several toolsets offered as one (the given tools, and the runtime's own `delegate`); a call
    goes to the first that offers its name."""

    def __init__(self, *toolsets: Toolset) -> None:
        self._toolsets = toolsets

    def specs(self) -> list[ToolSpec]:
        return [spec for toolset in self._toolsets for spec in toolset.specs()]

    def describe(self, call: ToolCall) -> ToolAction:
        return self._owner(call).describe(call)

    async def call(self, call: ToolCall, run: ToolRun) -> str:
        return await self._owner(call).call(call, run)

    def _owner(self, call: ToolCall) -> Toolset:
        for toolset in self._toolsets:
            if any(spec.name == call.name for spec in toolset.specs()):
                return toolset
        return self._toolsets[0]  # which says the tool does not exist, naming its own
