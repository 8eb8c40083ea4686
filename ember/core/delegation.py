"""A task one turn hands to another agent (the `delegate` tool): what is asked, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ember.core.tools import ToolRun

CHANNEL = "delegate"  # the channel of delegated turns' sessions; their sender is the person they work for


@dataclass(frozen=True, slots=True)
class ChildTask:
    task: str
    agent: str | None = None  # a named agent (None: the default agent)
    tools: tuple[str, ...] | None = None  # the tools it may use, within the parent's (None: all of the parent's)


@dataclass(frozen=True, slots=True)
class ChildAnswer:
    text: str
    turn_id: str
    failed: bool = False  # `text` then says why


class ChildTurns(Protocol):
    async def run(self, task: ChildTask, parent: ToolRun) -> ChildAnswer:
        """The task's answer, from a turn of its own in a session of its own, on behalf of `parent`'s
        person; ToolFailure when it may not run (too deep, an unknown agent or tool)."""
        ...
