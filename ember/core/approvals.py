"""An approval request as it is kept: how it stands, and what a resumed turn finds of it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ApprovalStatus(enum.StrEnum):
    """Pending while a turn waits; then the decision (core.tools.Decision's values), or expired."""

    PENDING = "pending"
    APPROVE_ONCE = "approve_once"
    APPROVE_SESSION = "approve_session"
    DENY = "deny"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class ApprovalRow:
    id: str
    session_key: str
    identity: str
    status: ApprovalStatus
    decided_by: str | None


@dataclass(frozen=True, slots=True)
class AskedBefore:
    """A request a turn made before it was cut off, found again when the turn is resumed."""

    id: str
    status: ApprovalStatus
    decided_by: str | None
    created_at: float
