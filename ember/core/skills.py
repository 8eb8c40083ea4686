"""Skills: the procedural tier. Plain records of skills, their versions and the
proposals the background review makes; no I/O."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any

# The identity of a shared skill (bundled, the person's folder, imported): every identity sees it.
SHARED = ""


class SkillStatus(enum.StrEnum):
    ACTIVE = "active"
    ARCHIVED = "archived"  # unused for long, or its folder is gone: out of the index, kept with its history


class SkillOrigin(enum.StrEnum):
    BUNDLED = "bundled"  # shipped with Ember
    HOME = "home"  # a folder in EMBER_HOME/skills
    IMPORTED = "imported"  # `ember skills import`
    LEARNED = "learned"  # admitted from a review's proposal; one identity's


class ProposalStatus(enum.StrEnum):
    PENDING = "pending"  # waits for a person
    ADMITTED = "admitted"
    REJECTED = "rejected"  # by a person
    REFUSED = "refused"  # by the admission gate, with its reason


class SkillRisk(enum.StrEnum):
    LOW = "low"  # reads and explains
    HIGH = "high"  # runs commands, writes files or reaches the network


@dataclass(frozen=True, slots=True)
class Skill:
    name: str
    description: str
    identity: str  # SHARED, or the identity that learned it
    version: int
    status: SkillStatus
    origin: SkillOrigin
    use_count: int = 0
    last_used_at: float | None = None
    updated_at: float = 0.0

    @property
    def scope(self) -> str:
        return "shared" if self.identity == SHARED else "learned"

    def to_json_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "scope": self.scope,
                "identity": self.identity or None, "version": self.version, "status": self.status.value,
                "origin": self.origin.value, "use_count": self.use_count, "last_used_at": self.last_used_at,
                "updated_at": self.updated_at}


@dataclass(frozen=True, slots=True)
class SkillVersion:
    name: str
    identity: str
    version: int
    text: str  # the whole SKILL.md
    source: str  # where the change came from, in words
    admitted_by: str
    created_at: float
    files: dict[str, str] = field(default_factory=dict)  # scripts/, references/, assets/: path -> text
    turn_id: str | None = None
    job_id: str | None = None

    def to_json_dict(self, *, with_text: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "version": self.version, "source": self.source,
                                "admitted_by": self.admitted_by, "created_at": self.created_at,
                                "turn_id": self.turn_id, "job_id": self.job_id, "files": sorted(self.files)}
        if with_text:
            data["text"] = self.text
        return data


@dataclass(frozen=True, slots=True)
class Proposal:
    id: str
    identity: str
    name: str
    action: str  # "create" or "patch"
    text: str  # the proposed SKILL.md, secrets redacted
    risk: SkillRisk
    risk_reasons: tuple[str, ...]
    status: ProposalStatus
    reason: str  # why the review proposed it, or why the gate refused it
    created_at: float
    base_version: int | None = None  # the version a patch was written against
    session_key: str | None = None
    turn_id: str | None = None
    job_id: str | None = None
    decided_at: float | None = None
    decided_by: str | None = None
    version: int | None = None  # the version it became, once admitted
    diff: str = ""  # against the base version (a new skill: against nothing)
    input_tokens: int = 0  # what the review that wrote it cost
    output_tokens: int = 0
    cost_usd: float | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "action": self.action, "status": self.status.value,
                "risk": self.risk.value, "risk_reasons": list(self.risk_reasons), "reason": self.reason,
                "identity": self.identity, "base_version": self.base_version, "version": self.version,
                "session_key": self.session_key, "turn_id": self.turn_id, "job_id": self.job_id,
                "created_at": self.created_at, "decided_at": self.decided_at, "decided_by": self.decided_by,
                "text": self.text, "diff": self.diff,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                          "cost_usd": self.cost_usd}}


@dataclass(frozen=True, slots=True)
class NewVersion:
    """A change to admit: the skill's text and files, and where the change came from."""

    identity: str
    name: str
    description: str
    text: str
    source: str
    admitted_by: str
    origin: SkillOrigin
    files: dict[str, str] | None = None  # None: the previous version's files
    turn_id: str | None = None
    job_id: str | None = None
    disk_digest: str | None = None  # set when the change was read from a folder


def new_proposal_id() -> str:
    return "sp_" + secrets.token_hex(5)
