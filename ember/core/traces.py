"""A turn's trace as the runtime keeps it: its status, and what the journal recorded of it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, kw_only=True)
class TurnTrace:
    turn_id: str
    session_key: str
    started_at: float
    finished_at: float = 0.0
    status: str = "running"
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


async def delegated_traces(trace: TurnTrace, get: Callable[[str], Awaitable[TurnTrace | None]],
                           ) -> dict[str, TurnTrace]:
    """The traces of the turns `trace` delegated to, and of theirs, by turn id (`get` reads one)."""
    found: dict[str, TurnTrace] = {}
    waiting = [trace]
    while waiting:
        for delegation in waiting.pop().detail.get("delegations", []):
            child = await get(delegation["turn_id"]) if delegation["turn_id"] not in found else None
            if child is not None:
                found[child.turn_id] = child
                waiting.append(child)
    return found
