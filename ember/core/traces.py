"""A turn's trace as the runtime keeps it: its status, and what the journal recorded of it."""

from __future__ import annotations

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
