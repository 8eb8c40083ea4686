"""What a listing's rows decode into: shared by the stores and the SQLite glance (store/sqlite/glance.py),
so that both read a row alike. Nothing here imports SQLAlchemy."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.core.memory import MemoryKind, MemoryRecord, MemoryStatus, SourceRank
from ember.core.schedule import Schedule, ScheduleKind
from ember.core.skills import SHARED, Skill, SkillOrigin, SkillStatus
from ember.core.tasks import MissedPolicy, Task, TaskState
from ember.core.traces import TurnTrace


@dataclass(frozen=True, slots=True)
class SessionSummary:
    key: str
    message_count: int
    last_consolidated: int
    updated_at: float
    title: str | None = None  # the person's name for it, else the start of its first message
    archived: bool = False


# By stored value: a lookup here is a tenth of an Enum call's cost, and a recall decodes a hundred rows.
_KINDS = {kind.value: kind for kind in MemoryKind}
_STATUSES = {status.value: status for status in MemoryStatus}
_RANKS = {rank.value: rank for rank in SourceRank}


def record_of(row: Sequence[Any]) -> tuple[int, MemoryRecord]:
    """A memory row's number and record, from the columns memory_rows.MEMORY selects."""
    (num, id_, identity, kind, status, content, subject, key, source, rank, session_key, seq_start, seq_end,
     created_at, valid_from, invalid_at, superseded_by, recall_count, last_recalled_at, strength) = row
    return num, MemoryRecord(
        id=id_, identity=identity, kind=_KINDS[kind], status=_STATUSES[status], content=content,
        subject=subject, key=key, source=source, source_rank=_RANKS[rank], session_key=session_key,
        seq_start=seq_start, seq_end=seq_end, created_at=created_at, valid_from=valid_from, invalid_at=invalid_at,
        superseded_by=superseded_by, recall_count=recall_count, last_recalled_at=last_recalled_at,
        strength=strength,
    )


def skill_of(row: Sequence[Any]) -> Skill:
    name, description, identity, version, status, origin, uses, last_used, updated = row
    return Skill(name, description, identity, version, SkillStatus(status), SkillOrigin(origin), uses, last_used,
                 updated)


def visible_to(identity: str | None, skills: list[Skill]) -> list[Skill]:
    """What `identity` sees of the skills listed for it: its own hide the shared ones of their names
    (None: the local CLI, which sees everyone's)."""
    if identity is None:
        return skills
    own = {skill.name for skill in skills if skill.identity != SHARED}
    return [skill for skill in skills if skill.identity != SHARED or skill.name not in own]


def session_summary(row: Sequence[Any]) -> SessionSummary:
    return SessionSummary(*row[:5], archived=row[5] is not None)


def turn_trace(row: Sequence[Any]) -> TurnTrace:
    turn_id, session_key, status, error, detail, started_at, finished_at = row
    return TurnTrace(turn_id=turn_id, session_key=session_key, started_at=started_at, finished_at=finished_at,
                     status=status, error=error, detail=json.loads(detail))


# The columns scheduled_task() reads, in its order.
TASK_COLUMNS = ("id", "identity", "prompt", "kind", "spec", "tz", "anchor", "reply_channel", "reply_chat_id",
                "missed", "grant_approvals", "state", "next_run_at", "runs", "created_at")


def scheduled_task(row: Sequence[Any]) -> Task:
    (id_, identity, prompt, kind, spec, tz, anchor, reply_channel, reply_chat_id, missed, grant, state,
     next_run_at, runs, created_at) = row
    from ember.core.events import ReplyRoute  # here: a glance at sessions or traces has no need of the events

    return Task(id=id_, identity=identity, prompt=prompt, schedule=Schedule(ScheduleKind(kind), spec, tz, anchor),
                reply=ReplyRoute(reply_channel, reply_chat_id) if reply_channel else None,
                missed=MissedPolicy(missed), grant_approvals=bool(grant), state=TaskState(state),
                next_run_at=next_run_at, runs=runs, created_at=created_at)


def usage_totals(rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    # int(): PostgreSQL sums BIGINT columns as NUMERIC, which arrives as a Decimal.
    return [{"key": k, "calls": calls, "input_tokens": int(i), "output_tokens": int(o),
             "cache_read_tokens": int(cr), "cache_write_tokens": int(cw), "cost_usd": round(cost, 6),
             "unpriced_calls": int(unpriced)}
            for k, calls, i, o, cr, cw, cost, unpriced in rows]
