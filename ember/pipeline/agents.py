"""Named agents (`[agents.NAME]`, configured in agent_spec.py): one Ember, several agents, each with
its own system prompt, model chain, tools, skills and memory scope.

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

from collections.abc import Mapping, Sequence
from typing import Any

from ember.core.messages import ToolCall
from ember.core.tools import ToolAction, ToolRun, ToolSpec
from ember.pipeline.agent_spec import matches
from ember.tools.base import ToolFailure, Toolset


def agent_of(requested: str | None, metadata: Mapping[str, Any], bindings: Mapping[str, str],
             channel: str, chat_id: str) -> str | None:
    """The agent a turn runs as: the one asked for, else its session's, else the one its chat or its
    channel is bound to (`channel_agents`); None: the default."""
    return (requested or metadata.get("agent") or bindings.get(f"{channel}:{chat_id}") or bindings.get(channel)
            or None)


class AgentTools:
    """The tools an agent is offered; another tool is neither offered nor run, whatever is asked."""

    def __init__(self, inner: Toolset, patterns: Sequence[str], whom: str) -> None:
        """`whom`: who is offered them, as a refusal names them ("agent coder")."""
        self._inner = inner
        self._patterns = list(patterns)
        self._whom = whom

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
            raise ToolFailure(f"there is no tool named {call.name!r} for {self._whom}. Available: {offered}.")
