"""One memory row at a time, in the caller's transaction: what a memory row and its
text row are, writing one (deduplicated, superseding), archiving a message.

Every write of a memory row writes its full-text row in the same transaction,
and queues the embedding job there too (I6): a crash keeps all or none.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ember.core.jobs import JobKind, JobRequest
from ember.core.memory import (
    MAX_CONTENT_CHARS,
    MemoryKind,
    MemoryRecord,
    MemoryStatus,
    NewMemory,
    SourceRank,
    check_content,
    content_hash,
    normalized_key,
)
from ember.store.jobs import record_job
from ember.store.segment import index_text, owner_token

_COLUMNS = ("num, id, identity, kind, status, content, subject, fact_key, source, source_rank, session_key, "
            "seq_start, seq_end, created_at, valid_from, invalid_at, superseded_by, recall_count, "
            "last_recalled_at, strength")
SELECT_MEMORY = f"SELECT {_COLUMNS} FROM memory_items"
_INSERT = (
    "INSERT INTO memory_items (id, identity, kind, status, content, content_hash, subject, fact_key, source, "
    "source_rank, session_key, seq_start, seq_end, valid_from, recall_count, strength, context_json, checked_at, "
    "created_at, updated_at) VALUES (:id, :identity, :kind, :status, :content, :hash, :subject, :key, :source, "
    ":rank, :session_key, :seq_start, :seq_end, :created_at, 0, 1.0, :context, :now, :created_at, :now)"
)
_INSERT_TEXT = "INSERT INTO memory_fts (rowid, owner, body, before, after, far, day) VALUES (?, ?, ?, ?, ?, ?, ?)"
_BUMP_TEXT_REV = ("UPDATE memory_items SET text_rev = (SELECT COALESCE(MAX(text_rev), 0) + 1 FROM memory_items "
                  "WHERE identity = ?) WHERE num = ?")
# BM25 weights of the text index's columns: owner, body, before, after, far, day.
TEXT_WEIGHTS = (0.0, 1.0, 0.5, 0.5, 0.35, 0.6)
EMBED_JOB = JobRequest(JobKind.EMBED, "all")
RECONCILE_JOB = JobRequest(JobKind.RECONCILE_FACTS, "all")


@dataclass(frozen=True, slots=True)
class Context:
    """An archived message's neighbours in its session: one and two messages away."""

    before: str = ""
    after: str = ""
    far: tuple[str, ...] = ()

    def to_json(self) -> str | None:
        if not (self.before or self.after or self.far):
            return None
        return json.dumps({"before": self.before, "after": self.after, "far": list(self.far)}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | None) -> Context:
        if not text:
            return cls()
        data = json.loads(text)
        return cls(data.get("before", ""), data.get("after", ""), tuple(data.get("far", ())))

    def window(self, content: str) -> str:
        """The text the window vector is made from: the message between its neighbours."""
        return "\n".join(part for part in (self.before, content, self.after) if part)


def _day(timestamp: float) -> str:
    moment = dt.datetime.fromtimestamp(timestamp, dt.UTC)
    return f"{moment.day} {moment:%B} {moment.year}"


def write_text_row(conn: sqlite3.Connection, num: int, identity: str, content: str, created_at: float,
                   context: Context = Context()) -> None:
    conn.execute(_INSERT_TEXT, (num, owner_token(identity), index_text(content), index_text(context.before),
                                index_text(context.after), index_text("\n".join(context.far)), _day(created_at)))
    conn.execute(_BUMP_TEXT_REV, (identity, num))

Row = Sequence[Any]


def record_of(row: Row) -> tuple[int, MemoryRecord]:
    (num, id_, identity, kind, status, content, subject, key, source, rank, session_key, seq_start, seq_end,
     created_at, valid_from, invalid_at, superseded_by, recall_count, last_recalled_at, strength) = row
    return num, MemoryRecord(
        id=id_, identity=identity, kind=MemoryKind(kind), status=MemoryStatus(status), content=content,
        subject=subject, key=key, source=source, source_rank=SourceRank(rank), session_key=session_key,
        seq_start=seq_start, seq_end=seq_end, created_at=created_at, valid_from=valid_from, invalid_at=invalid_at,
        superseded_by=superseded_by, recall_count=recall_count, last_recalled_at=last_recalled_at,
        strength=strength,
    )


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def insert_memory(conn: sqlite3.Connection, memory: NewMemory, now: float, *,
                  status: MemoryStatus = MemoryStatus.ACTIVE, context: Context = Context()) -> tuple[int, str]:
    """Write one memory row, its text index row and the embedding job, in the caller's transaction."""
    content = check_content(memory.content)
    created_at = memory.created_at if memory.created_at is not None else now
    id_ = new_id()
    cursor = conn.execute(_INSERT, {
        "id": id_, "identity": memory.identity, "kind": memory.kind.value, "status": status.value,
        "content": content, "hash": content_hash(content), "subject": normalized_key(memory.subject),
        "key": normalized_key(memory.key), "source": memory.source, "rank": int(memory.source_rank),
        "session_key": memory.session_key, "seq_start": memory.seq_start, "seq_end": memory.seq_end,
        "created_at": created_at, "now": now, "context": context.to_json(),
    })
    num = cursor.lastrowid
    assert num is not None
    write_text_row(conn, num, memory.identity, content, created_at, context)
    record_job(conn, EMBED_JOB, now)
    return num, id_


@dataclass(frozen=True, slots=True)
class Unembedded:
    """A memory waiting for its vectors, as it was when read."""

    num: int
    identity: str
    content: str
    context_json: str | None

    @property
    def window(self) -> str | None:
        """The text of its window vector; None for a memory without neighbours."""
        return Context.from_json(self.context_json).window(self.content) if self.context_json else None


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """What a write did: the record now standing for the content, whether it is
    new, and the facts it superseded."""

    record: MemoryRecord
    created: bool
    superseded: tuple[str, ...] = ()


def write_memory(conn: sqlite3.Connection, memory: NewMemory, now: float) -> WriteOutcome:
    """Add a memory unless this identity already has its content, in any state
    but forgotten: a fact said twice is one fact, and an import run again adds
    nothing, superseded facts included. (An episode is always added: its
    source span makes it new.) A pending fact said again by a better source
    takes effect, or still waits if an even better one stands against it: one
    row waits either way.

    A fact with a subject and key supersedes the active fact of the same
    subject and key at once, unless that one has a better source: then the
    new fact is parked as pending (needs confirmation) and nothing changes.
    """
    content = check_content(memory.content)
    existing = None if memory.kind is MemoryKind.EPISODIC else conn.execute(
        f"{SELECT_MEMORY} WHERE identity = ? AND content_hash = ? AND kind = ? AND status != 'archived' "
        "ORDER BY status = 'pending' LIMIT 1", (memory.identity, content_hash(content), memory.kind.value)).fetchone()
    confirmed: int | None = None
    if existing is not None:
        existing_num, known = record_of(existing)
        if known.status is not MemoryStatus.PENDING or memory.source_rank <= known.source_rank:
            return WriteOutcome(known, created=False)
        confirmed = existing_num
    subject, key = normalized_key(memory.subject), normalized_key(memory.key)
    current: list[tuple[int, MemoryRecord]] = []
    if key is not None:
        current = [record_of(row) for row in conn.execute(
            f"{SELECT_MEMORY} WHERE identity = ? AND subject IS ? AND fact_key = ? AND status = 'active'",
            (memory.identity, subject, key))]
    parked = any(record.source_rank > memory.source_rank for _, record in current)
    num, id_ = insert_memory(conn, memory, now, status=MemoryStatus.PENDING if parked else MemoryStatus.ACTIVE)
    if confirmed is not None:
        # Said again by a better source: the new row replaces the weaker one, active or still waiting.
        supersede(conn, confirmed, id_, now)
    if parked:
        return WriteOutcome(_get_num(conn, num), created=True)
    for old_num, _ in current:
        supersede(conn, old_num, id_, now)
    if memory.kind is MemoryKind.FACT and key is None and memory.source_rank < SourceRank.USER_STATED:
        # What the person states stands as said; what was extracted or inferred is checked.
        conn.execute("UPDATE memory_items SET checked_at = NULL WHERE num = ?", (num,))
        record_job(conn, RECONCILE_JOB, now)
    return WriteOutcome(_get_num(conn, num), created=True, superseded=tuple(r.id for _, r in current))


def supersede(conn: sqlite3.Connection, num: int, by_id: str, now: float) -> None:
    conn.execute("UPDATE memory_items SET status = 'superseded', superseded_by = ?, invalid_at = ?, updated_at = ? "
                 "WHERE num = ?", (by_id, now, now, num))


def _get_num(conn: sqlite3.Connection, num: int) -> MemoryRecord:
    return record_of(conn.execute(f"{SELECT_MEMORY} WHERE num = ?", (num,)).fetchone())[1]


# A session's messages worth archiving, with the channel and sender of their turn.
_ARCHIVABLE = (
    "SELECT m.seq, m.role, m.content, m.created_at, i.channel, i.sender_id, m.name FROM messages m "
    "LEFT JOIN inbox i ON i.turn_id = m.turn_id AND i.session_key = m.session_key "
    "WHERE m.session_key = ? AND m.role IN ('user', 'assistant') AND TRIM(m.content) != ''"
)


def _neighbours(texts: Sequence[str], index: int) -> Context:
    def at(offset: int) -> str:
        position = index + offset
        return texts[position] if 0 <= position < len(texts) else ""

    return Context(before=at(-1), after=at(1), far=tuple(text for text in (at(-2), at(2)) if text))


def _refresh_context(conn: sqlite3.Connection, session_key: str, seq: int, created_at: float, context: Context,
                     *, reembed: bool) -> None:
    row = conn.execute("SELECT num, identity, content, context_json FROM memory_items WHERE session_key = ? "
                       "AND seq_start = ? AND kind = 'archival'", (session_key, seq)).fetchone()
    if row is None or Context.from_json(row[3]) == context:
        return
    num, identity, content, _ = row
    conn.execute("DELETE FROM memory_fts WHERE rowid = ?", (num,))
    write_text_row(conn, num, identity, content, created_at, context)
    conn.execute("UPDATE memory_items SET context_json = ?" + (", embedding_model = NULL" if reembed else "")
                 + " WHERE num = ?", (context.to_json(), num))


def archive_messages(conn: sqlite3.Connection, session_key: str, resolve: Callable[[str, str], str], fallback: str,
                     now: float) -> int:
    """Copy the session's messages not yet archived into the archival tier (SqlMemoryStore.archive_session)."""
    mark = conn.execute("SELECT next_seq FROM memory_archive_marks WHERE session_key = ?",
                        (session_key,)).fetchone()
    start = mark[0] if mark else 0
    earlier = conn.execute(
        f"{_ARCHIVABLE} AND m.seq < ? ORDER BY m.seq DESC LIMIT 4", (session_key, start)).fetchall()[::-1]
    new = conn.execute(f"{_ARCHIVABLE} AND m.seq >= ? ORDER BY m.seq", (session_key, start)).fetchall()
    high = conn.execute("SELECT COALESCE(MAX(seq), -1) FROM messages WHERE session_key = ?",
                        (session_key,)).fetchone()[0]
    line = [*earlier, *new]
    # A named author is part of what was said: "Caroline: I went to the support group".
    texts = [f"{row[6].strip()}: {row[2].strip()}" if row[6] else row[2].strip() for row in line]
    for index, (seq, role, _, created_at, channel, sender, name) in enumerate(line):
        context = _neighbours(texts, index)
        if index < len(earlier):
            # The two before those only give their neighbours: their own reach further back.
            if index >= len(earlier) - 2:
                _refresh_context(conn, session_key, seq, created_at, context,
                                 reembed=index == len(earlier) - 1)
            continue
        if conn.execute("SELECT 1 FROM memory_items WHERE session_key = ? AND seq_start = ? "
                        "AND kind = 'archival'", (session_key, seq)).fetchone():
            continue
        insert_memory(conn, NewMemory(
            identity=resolve(channel, sender) if channel is not None else fallback,
            content=texts[index][:MAX_CONTENT_CHARS], kind=MemoryKind.ARCHIVAL, subject=name or role,
            source=f"session {session_key}",
            source_rank=SourceRank.USER_STATED if role == "user" else SourceRank.INFERRED,
            session_key=session_key, seq_start=seq, seq_end=seq + 1, created_at=created_at),
            now, context=context)
    conn.execute("INSERT INTO memory_archive_marks (session_key, next_seq) VALUES (?, ?) "
                 "ON CONFLICT (session_key) DO UPDATE SET next_seq = excluded.next_seq",
                 (session_key, high + 1))
    return len(new)
