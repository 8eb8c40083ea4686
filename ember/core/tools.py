"""What a model is told about a tool, and what a person is asked before a risky call."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from ember.core.attachments import Attachment
from ember.core.journal import TurnObserver
from ember.core.usage import TurnTally


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


class Risk(enum.StrEnum):
    READ = "read"
    WRITE = "write"
    EXECUTE = "execute"
    NETWORK = "network"


@dataclass(frozen=True, slots=True)
class ToolAction:
    """A validated call as a person would judge it.

    `subject` is what pattern rules match (a command, a path, a URL); `summary`
    says in plain words what will happen.
    """

    tool: str
    risk: Risk
    subject: str
    summary: str
    arguments: str = ""  # the call's whole arguments (JSON), for the approval model to read


class Decision(enum.StrEnum):
    APPROVE_ONCE = "approve_once"
    APPROVE_SESSION = "approve_session"
    DENY = "deny"


# A person's typed answer to an approval request (the terminal, an A2A message): anything else denies.
_REPLIES = {"y": Decision.APPROVE_ONCE, "yes": Decision.APPROVE_ONCE, "approve": Decision.APPROVE_ONCE,
            "a": Decision.APPROVE_SESSION, "always": Decision.APPROVE_SESSION}


def decision_from_reply(text: str) -> Decision:
    return _REPLIES.get(text.strip().lower().rstrip(".!"), Decision.DENY)


@dataclass(frozen=True, slots=True)
class Explanation:
    """The approval model's reading of a call: what it does in plain words, and how risky it is."""

    text: str
    risk: str  # low | medium | high
    reason: str

    def line(self) -> str:
        return f"{self.text} Risk: {self.risk} ({self.reason})."


@dataclass(frozen=True, slots=True)
class Verdict:
    """How an approval ended: the decision, who made it and when."""

    decision: Decision
    decided_by: str  # "policy", "session-grant", "timeout", "channel", or "user:<identity>"
    decided_at: float
    reason: str = ""
    explanation: Explanation | None = None  # what the person was shown beside the request

    @property
    def allowed(self) -> bool:
        return self.decision is not Decision.DENY


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    id: str
    session_key: str
    turn_id: str
    action: ToolAction
    timeout_s: float
    explanation: Explanation | None = None


class Approver(Protocol):
    """Asks the person behind a turn's channel; a silence past the timeout is a denial."""

    async def approve(self, action: ToolAction) -> Verdict: ...


@dataclass(frozen=True, slots=True)
class ToolRun:
    """What a tool call may know of the turn it runs in."""

    session_key: str
    turn_id: str
    approver: Approver
    observer: TurnObserver  # the turn's journal, and OpenTelemetry when it is on
    identity: str  # the person the turn is for: their workspace, their approvals
    # Whose memory the memory tools act on: the person's, or a named agent's own with them (None: the person's).
    memory_identity: str | None = None
    depth: int = 0  # how many delegations deep the turn is (0: a person's own turn)
    # A delegated turn's: the session of the person's conversation it works for (None: its own session).
    asked_in: str | None = None
    offered: frozenset[str] = frozenset()  # the tools the turn's model is offered (set by the inference stage)
    spent: TurnTally = field(default_factory=TurnTally)  # what its model calls used, its delegated turns' too
    # The files its answer sends with it (send_file), stored in the session already.
    files: list[Attachment] = field(default_factory=list)

    @property
    def conversation(self) -> str:
        """The session of the person's conversation: whose workspace, grants and usage a turn's calls share."""
        return self.asked_in or self.session_key

    @property
    def memory_owner(self) -> str:
        return self.memory_identity or self.identity
