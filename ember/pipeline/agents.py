"""Named agents (`[agents.NAME]`): one Ember, several agents, each with its own system prompt,
model chain, tools, skills and memory scope.

A turn runs as the agent its message names (the OpenAI route's `model`, the native API's
`agent`), else as the one its session began with, else as the one its chat or channel is bound
to (`channel_agents`: "telegram", "telegram:123456"), else as the default agent: Ember as
configured, every tool and skill, the main chain, the person's memory. A session records the
agent it began with; its memory scope is that agent's for the session's whole life, so what was
said in it always joins the same memory:

- `shared`: the person's own memory, as the default agent's;
- `own`: a memory the agent keeps with each person apart (`alice@coder`), which the person's
  other sessions never recall. The person's workspace, budget and approvals stay theirs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ember.core.messages import ToolCall
from ember.core.tools import ToolAction, ToolRun, ToolSpec
from ember.tools.base import ToolFailure, Toolset

AGENT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
MemoryScope = Literal["shared", "own"]


class AgentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Its system prompt, in place of the default one ({agent_name} is filled in).
    system_prompt: str | None = None
    # The [models] it calls, tried in order; empty: the main chain.
    models: list[str] = Field(default_factory=list)
    # The tools it is offered, by name or pattern (`memory_*`, `github__*`); unset: every tool.
    tools: list[str] | None = None
    # The skills in its prompt's index, by name or pattern; unset: every skill.
    skills: list[str] | None = None
    # "shared": the person's own memory; "own": a memory of its own with each person.
    memory: MemoryScope = "shared"
    # USD a day (UTC) its turns may spend on priced models, whoever they are for; past it, they are refused.
    budget_usd_per_day: float | None = Field(default=None, ge=0)


def check_agents(agents: Mapping[str, AgentSpec], models: Sequence[str], bindings: Mapping[str, str]) -> None:
    """ValueError for an agent whose name is not a plain lower-case name, whose chain names a model
    not under [models], or a channel bound to an agent that is not configured."""
    for name, spec in agents.items():
        if not AGENT_NAME.fullmatch(name):
            raise ValueError(f"agents.{name}: an agent's name is lower-case letters, digits, '-' and '_'")
        if unknown := [model for model in spec.models if model not in models]:
            raise ValueError(f"agents.{name}.models names {', '.join(map(repr, unknown))}, not under [models]")
    for where, agent in bindings.items():
        if agent not in agents:
            raise ValueError(f"channel_agents.{where} names agent {agent!r}, not under [agents]")


def matches(name: str, patterns: Sequence[str] | None) -> bool:
    """Whether `patterns` (None: all) take `name`."""
    return patterns is None or any(fnmatchcase(name, pattern) for pattern in patterns)


def agent_of(requested: str | None, metadata: Mapping[str, Any], bindings: Mapping[str, str],
             channel: str, chat_id: str) -> str | None:
    """The agent a turn runs as: the one asked for, else its session's, else the one its chat or its
    channel is bound to (`channel_agents`); None: the default."""
    return (requested or metadata.get("agent") or bindings.get(f"{channel}:{chat_id}") or bindings.get(channel)
            or None)


class AgentTools:
    """The tools an agent is offered; another tool is neither offered nor run, whatever is asked."""

    def __init__(self, inner: Toolset, patterns: Sequence[str], agent: str) -> None:
        self._inner = inner
        self._patterns = list(patterns)
        self._agent = agent

    def specs(self) -> list[ToolSpec]:
        return [spec for spec in self._inner.specs() if matches(spec.name, self._patterns)]

    def describe(self, call: ToolCall) -> ToolAction:
        self._offered(call)
        return self._inner.describe(call)

    async def call(self, call: ToolCall, run: ToolRun) -> str:
        try:
            self._offered(call)
        except ToolFailure as exc:
            return f"Error: {exc}"
        return await self._inner.call(call, run)

    def _offered(self, call: ToolCall) -> None:
        if not matches(call.name, self._patterns):
            offered = ", ".join(spec.name for spec in self.specs()) or "none"
            raise ToolFailure(f"there is no tool named {call.name!r} for agent {self._agent}. Available: {offered}.")
