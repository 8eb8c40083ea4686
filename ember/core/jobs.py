"""Kinds of durable background work a turn may schedule, and a request for one."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class JobKind(enum.StrEnum):
    CONSOLIDATE = "consolidate"
    EMBED = "embed"
    REVIEW_MEMORY = "review_memory"
    REVIEW_SKILLS = "review_skills"
    ARCHIVE = "archive_messages"  # copy a session's new messages into the archival memory tier
    MEMORY_UPKEEP = "memory_upkeep"  # write recall counts, archive what faded
    RECONCILE_FACTS = "reconcile_facts"  # ask the model whether new keyless facts replace older ones
    CURATE_SKILLS = "curate_skills"  # archive the skills unused for long
    TITLE_SESSION = "title_session"  # name a session from its first exchange


@dataclass(frozen=True, slots=True)
class JobRequest:
    """Work to queue unless an equal (kind, dedupe_key) job is already pending.
    A turn's requests are written in its answer's transaction, so a crash can
    never keep the answer and lose the work it owes (I6)."""

    kind: str
    dedupe_key: str
    session_key: str | None = None
    turn_id: str | None = None  # the turn that queued it
    # Due this long after it is queued: meanwhile an equal request is covered by this one.
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    kind: str
    dedupe_key: str
    session_key: str | None
    attempts: int
    turn_id: str | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    jobs: list[Job]
    # When the earliest job still pending after the claim is due (None: none is): the runner
    # sleeps until then without asking the store again.
    next_due_at: float | None
