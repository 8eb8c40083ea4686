"""Memory rows, their full-text index and their vectors, always written together.

Every write of a memory row writes its full-text row in the same transaction,
and queues the embedding job there too (I6): a crash keeps all or none. Every
statement that reads or changes a memory names its identity, so no code path
can reach another person's memory.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ember.core.errors import MemoryNotFound
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
from ember.store.database import Database
from ember.store.jobs import record_job
from ember.store.segment import COMMON_ROWS, distinctive, expression, index_text, indexed_form, owner_token

_COLUMNS = ("num, id, identity, kind, status, content, subject, fact_key, source, source_rank, session_key, "
            "seq_start, seq_end, created_at, valid_from, invalid_at, superseded_by, recall_count, "
            "last_recalled_at, strength")
_SELECT = f"SELECT {_COLUMNS} FROM memory_items"
_INSERT = (
    "INSERT INTO memory_items (id, identity, kind, status, content, content_hash, subject, fact_key, source, "
    "source_rank, session_key, seq_start, seq_end, valid_from, recall_count, strength, context_json, checked_at, "
    "created_at, updated_at) VALUES (:id, :identity, :kind, :status, :content, :hash, :subject, :key, :source, "
    ":rank, :session_key, :seq_start, :seq_end, :created_at, 0, 1.0, :context, :now, :created_at, :now)"
)
_INSERT_TEXT = "INSERT INTO memory_fts (rowid, owner, body, before, after, far, day) VALUES (?, ?, ?, ?, ?, ?, ?)"
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
        f"{_SELECT} WHERE identity = ? AND content_hash = ? AND kind = ? AND status != 'archived' "
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
            f"{_SELECT} WHERE identity = ? AND subject IS ? AND fact_key = ? AND status = 'active'",
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
    return record_of(conn.execute(f"{_SELECT} WHERE num = ?", (num,)).fetchone())[1]


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


_BM25 = f"bm25(memory_fts, {', '.join(map(str, TEXT_WEIGHTS))})"
_LEXICAL = f"SELECT rowid, -{_BM25} FROM memory_fts WHERE memory_fts MATCH ? ORDER BY {_BM25} LIMIT ?"
_VECTOR_COUNTS = "SELECT identity, model, COUNT(*) AS n, MAX(rev) AS rev FROM memory_vectors GROUP BY identity, model"


def _statuses(include_inactive: bool) -> str:
    return "" if include_inactive else " AND status = 'active'"


class SqlMemoryStore:
    """The embedded default: SQLite rows, FTS5 BM25 and vectors as float32 blobs."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def write(self, memory: NewMemory) -> WriteOutcome:
        now = time.time()
        return await self._db.run_write(lambda conn: write_memory(conn, memory, now))

    async def write_many(self, memories: Sequence[NewMemory]) -> list[WriteOutcome]:
        """One transaction for the batch (imports)."""
        now = time.time()
        return await self._db.run_write(lambda conn: [write_memory(conn, m, now) for m in memories])

    async def get(self, identity: str, memory_id: str) -> MemoryRecord:
        row = await self._db.run_read(lambda conn: conn.execute(
            f"{_SELECT} WHERE identity = ? AND id = ?", (identity, memory_id)).fetchone())
        if row is None:
            raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
        return record_of(row)[1]

    async def by_nums(self, identity: str, nums: Sequence[int]) -> dict[int, MemoryRecord]:
        if not nums:
            return {}

        def read(conn: sqlite3.Connection) -> dict[int, MemoryRecord]:
            marks = ",".join("?" * len(nums))
            # `+identity`: look the rows up by number; SQLite would otherwise walk the identity's index.
            rows = conn.execute(f"{_SELECT} WHERE num IN ({marks}) AND +identity = ?", (*nums, identity))
            return dict(record_of(row) for row in rows)

        return await self._db.run_read(read)

    async def profile(self, identity: str, limit: int) -> list[MemoryRecord]:
        """The identity's active facts that name an attribute (subject and key), in a stable order."""
        sql = (f"{_SELECT} WHERE identity = ? AND kind = 'fact' AND status = 'active' AND fact_key IS NOT NULL "
               "ORDER BY source_rank DESC, subject, fact_key, num LIMIT ?")
        rows = await self._db.run_read(lambda conn: conn.execute(sql, (identity, limit)).fetchall())
        return [record_of(row)[1] for row in rows]

    async def list(self, identity: str, *, kinds: Sequence[MemoryKind] = (), include_inactive: bool = False,
                   limit: int = 100, session_key: str | None = None) -> list[MemoryRecord]:
        """Newest first."""
        where = f"identity = ?{_statuses(include_inactive)}"
        params: list[Any] = [identity]
        if session_key is not None:
            where += " AND session_key = ?"
            params.append(session_key)
        if kinds:
            where += f" AND kind IN ({','.join('?' * len(kinds))})"
            params += [k.value for k in kinds]
        sql = f"{_SELECT} WHERE {where} ORDER BY created_at DESC, num DESC LIMIT ?"
        rows = await self._db.run_read(lambda conn: conn.execute(sql, (*params, limit)).fetchall())
        return [record_of(row)[1] for row in rows]

    async def lexical(self, identity: str, terms: Sequence[str], limit: int) -> list[tuple[int, float]]:
        """(num, BM25 score; higher is better) of the identity's memories, in any state, matching
        any of the query's distinctive terms (segment.distinctive).

        The owner token keeps the search within the identity's rows; their states are
        filtered with the records (a join here cost a third of the query).
        """
        def read(conn: sqlite3.Connection) -> list[tuple[int, float]]:
            kept = list(terms)
            total = conn.execute("SELECT COALESCE(MAX(num), 0) FROM memory_items").fetchone()[0]
            if total > COMMON_ROWS:
                forms = {term: indexed_form(term) for term in terms}
                rows = dict(conn.execute(
                    f"SELECT term, doc FROM memory_fts_terms WHERE term IN ({', '.join('?' * len(forms))})",
                    list(forms.values())).fetchall())
                kept = distinctive(terms, {term: rows.get(form, 0) for term, form in forms.items()}, total)
            match = f"owner:{owner_token(identity)} AND {{body before after far day}}:({expression(kept)})"
            return conn.execute(_LEXICAL, (match, limit)).fetchall()

        return await self._db.run_read(read)

    async def history(self, identity: str, memory_id: str) -> list[MemoryRecord]:
        """The supersession chain through a fact, oldest first."""
        def read(conn: sqlite3.Connection) -> list[MemoryRecord]:
            found = conn.execute(f"{_SELECT} WHERE identity = ? AND id = ?", (identity, memory_id)).fetchone()
            if found is None:
                raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
            chain = [record_of(found)[1]]
            while (older := conn.execute(f"{_SELECT} WHERE identity = ? AND superseded_by = ?",
                                         (identity, chain[0].id)).fetchone()) is not None:
                chain.insert(0, record_of(older)[1])
            while chain[-1].superseded_by and (newer := conn.execute(
                    f"{_SELECT} WHERE identity = ? AND id = ?", (identity, chain[-1].superseded_by)).fetchone()):
                chain.append(record_of(newer)[1])
            return chain

        return await self._db.run_read(read)

    async def set_status(self, identity: str, memory_id: str, status: MemoryStatus) -> MemoryRecord:
        now = time.time()

        def change(conn: sqlite3.Connection) -> MemoryRecord:
            done = conn.execute("UPDATE memory_items SET status = ?, updated_at = ?, "
                                "invalid_at = COALESCE(invalid_at, ?) WHERE identity = ? AND id = ?",
                                (status.value, now, now if status is not MemoryStatus.ACTIVE else None,
                                 identity, memory_id))
            if done.rowcount != 1:
                raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
            return record_of(conn.execute(f"{_SELECT} WHERE identity = ? AND id = ?",
                                          (identity, memory_id)).fetchone())[1]

        return await self._db.run_write(change)

    async def purge(self, identity: str, memory_id: str) -> None:
        """Delete for real: the row, its text index row and its vector."""
        def delete(conn: sqlite3.Connection) -> None:
            row = conn.execute("SELECT num FROM memory_items WHERE identity = ? AND id = ?",
                               (identity, memory_id)).fetchone()
            if row is None:
                raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
            conn.execute("DELETE FROM memory_fts WHERE rowid = ?", row)
            conn.execute("DELETE FROM memory_vectors WHERE num = ?", row)
            conn.execute("UPDATE memory_items SET superseded_by = NULL WHERE identity = ? AND superseded_by = ?",
                         (identity, memory_id))
            conn.execute("DELETE FROM memory_items WHERE num = ?", row)

        await self._db.run_write(delete)

    # -- vectors ---------------------------------------------------------------

    async def unembedded(self, limit: int) -> list[Unembedded]:
        """Memories with no vector yet, of any identity (the embedding job's)."""
        rows = await self._db.run_read(lambda conn: conn.execute(
            "SELECT num, identity, content, context_json FROM memory_items WHERE embedding_model IS NULL "
            "ORDER BY num LIMIT ?", (limit,)).fetchall())
        return [Unembedded(num, identity, content, context) for num, identity, content, context in rows]

    async def count_unembedded(self) -> int:
        return await self._db.run_read(lambda conn: conn.execute(
            "SELECT COUNT(*) FROM memory_items WHERE embedding_model IS NULL").fetchone()[0])

    async def set_vectors(self, model: str, vectors: Iterable[tuple[Unembedded, bytes, bytes | None]]) -> int:
        """Store each memory's vector and window vector, and stamp its row with the model; returns how many.

        A row whose neighbours changed since it was read keeps waiting: its
        window was made from the old ones, and the next run embeds it again.
        """
        rows = list(vectors)

        def store(conn: sqlite3.Connection) -> int:
            stored = 0
            for item, blob, window in rows:
                stamped = conn.execute(
                    "UPDATE memory_items SET embedding_model = ? WHERE num = ? AND identity = ? "
                    "AND embedding_model IS NULL AND context_json IS ?",
                    (model, item.num, item.identity, item.context_json))
                if stamped.rowcount != 1:
                    continue  # purged, or its neighbours changed: not the memory that was embedded
                rev = conn.execute("UPDATE memory_vector_rev SET rev = rev + 1 RETURNING rev").fetchone()[0]
                # An update, not a replace: the database's triggers keep the per-identity counts.
                conn.execute("INSERT INTO memory_vectors (num, identity, model, rev, vector, window) "
                             "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (num) DO UPDATE SET identity = excluded.identity, "
                             "model = excluded.model, rev = excluded.rev, vector = excluded.vector, "
                             "window = excluded.window", (item.num, item.identity, model, rev, blob, window))
                stored += 1
            return stored

        return await self._db.run_write(store)

    async def vector_state(self, identity: str, model: str) -> tuple[int, int]:
        """(count, highest rev) of the identity's vectors by `model`: what a cached matrix checks against."""
        row = await self._db.run_read(lambda conn: conn.execute(
            "SELECT rows, rev FROM memory_vector_heads WHERE identity = ? AND model = ?", (identity, model)).fetchone())
        return (0, 0) if row is None else (row[0], row[1])

    async def vectors_after(self, identity: str, model: str, rev: int) -> list[tuple[int, int, bytes, bytes | None]]:
        """(num, rev, vector, window) written after `rev`, in order."""
        return await self._db.run_read(lambda conn: conn.execute(
            "SELECT num, rev, vector, window FROM memory_vectors WHERE identity = ? AND model = ? AND rev > ? "
            "ORDER BY rev", (identity, model, rev)).fetchall())

    async def quarantine_vector(self, num: int) -> None:
        """A vector that cannot be read is dropped and its memory queued for embedding again."""
        now = time.time()

        def drop(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM memory_vectors WHERE num = ?", (num,))
            conn.execute("UPDATE memory_items SET embedding_model = NULL WHERE num = ?", (num,))
            record_job(conn, EMBED_JOB, now)

        await self._db.run_write(drop)

    async def forget_other_models(self, model: str) -> int:
        """Queue every memory embedded by another model for a new embedding; returns how many."""
        now = time.time()

        def requeue(conn: sqlite3.Connection) -> int:
            changed = conn.execute("UPDATE memory_items SET embedding_model = NULL "
                                   "WHERE embedding_model IS NOT NULL AND embedding_model != ?", (model,)).rowcount
            conn.execute("DELETE FROM memory_vectors WHERE model != ?", (model,))
            if changed:
                record_job(conn, EMBED_JOB, now)
            return changed

        return await self._db.run_write(requeue)

    # -- contradictions ----------------------------------------------------------

    async def unchecked_facts(self, limit: int) -> list[MemoryRecord]:
        """Keyless facts of any identity not yet compared with older ones, oldest first."""
        rows = await self._db.run_read(lambda conn: conn.execute(
            f"{_SELECT} WHERE checked_at IS NULL AND kind = 'fact' AND fact_key IS NULL ORDER BY num LIMIT ?",
            (limit,)).fetchall())
        return [record_of(row)[1] for row in rows]

    async def mark_checked(self, identity: str, memory_id: str) -> None:
        now = time.time()
        await self._db.run_write(lambda conn: conn.execute(
            "UPDATE memory_items SET checked_at = ? WHERE identity = ? AND id = ?", (now, identity, memory_id)))

    async def supersede_by(self, identity: str, old_id: str, new_id: str) -> None:
        """The newer fact replaces the older one, if both are still active; the old one keeps its history."""
        now = time.time()

        def change(conn: sqlite3.Connection) -> None:
            both = conn.execute("SELECT COUNT(*) FROM memory_items WHERE identity = ? AND id IN (?, ?) "
                                "AND status = 'active'", (identity, old_id, new_id)).fetchone()[0]
            if both == 2:
                conn.execute("UPDATE memory_items SET status = 'superseded', superseded_by = ?, invalid_at = ?, "
                             "updated_at = ? WHERE identity = ? AND id = ?", (new_id, now, now, identity, old_id))

        await self._db.run_write(change)

    # -- recall and forgetting ---------------------------------------------------

    async def note_recalls(self, recalls: dict[tuple[str, str], tuple[int, float]]) -> None:
        """Add recall counts ((identity, id) -> (times, last time)) in one write; a recall restores full strength."""
        def store(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "UPDATE memory_items SET recall_count = recall_count + ?, strength = 1.0, "
                "last_recalled_at = MAX(COALESCE(last_recalled_at, 0), ?) WHERE identity = ? AND id = ?",
                [(times, last, identity, id_) for (identity, id_), (times, last) in recalls.items()])

        await self._db.run_write(store)

    async def decay_candidates(self, kinds: Sequence[MemoryKind]) -> list[MemoryRecord]:
        marks = ",".join("?" * len(kinds))
        rows = await self._db.run_read(lambda conn: conn.execute(
            f"{_SELECT} WHERE status = 'active' AND kind IN ({marks})", [k.value for k in kinds]).fetchall())
        return [record_of(row)[1] for row in rows]

    async def set_strengths(self, strengths: dict[str, float], archive: Sequence[str]) -> None:
        now = time.time()

        def store(conn: sqlite3.Connection) -> None:
            conn.executemany("UPDATE memory_items SET strength = ? WHERE id = ?",
                             [(value, id_) for id_, value in strengths.items()])
            conn.executemany("UPDATE memory_items SET status = 'archived', invalid_at = ?, updated_at = ? "
                             "WHERE id = ? AND status = 'active'", [(now, now, id_) for id_ in archive])

        await self._db.run_write(store)

    # -- archival tier -----------------------------------------------------------

    async def senders(self, session_key: str) -> dict[str, tuple[str, str]]:
        """turn id -> (channel, sender id) of every message the session accepted."""
        rows = await self._db.run_read(lambda conn: conn.execute(
            "SELECT turn_id, channel, sender_id FROM inbox WHERE session_key = ?", (session_key,)).fetchall())
        return {turn_id: (channel, sender) for turn_id, channel, sender in rows}

    async def archive_session(self, session_key: str, resolve: Callable[[str, str], str], fallback: str) -> int:
        """Copy the session's committed user and assistant messages not yet archived
        into the archival tier, in one transaction; returns how many.

        Each goes to the identity `resolve(channel, sender)` of its turn's
        message, read in the same transaction (`fallback` takes a message
        without a receipt). Each is indexed with its neighbours; the two
        archived before these learn their new neighbours too, and the one just
        before is embedded again (its window now reaches the first new one).
        """
        now = time.time()

        def copy(conn: sqlite3.Connection) -> int:
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

        return await self._db.run_write(copy)

    # -- upkeep --------------------------------------------------------------------

    async def reindex_text(self) -> int:
        """Rebuild the text index from the rows, and drop vectors left without a
        row; returns how many rows the index holds."""
        def rebuild(conn: sqlite3.Connection) -> int:
            conn.execute("DELETE FROM memory_fts")
            conn.execute("DELETE FROM memory_vectors WHERE num NOT IN (SELECT num FROM memory_items)")
            conn.execute("DELETE FROM memory_vector_heads")
            conn.execute(f"INSERT INTO memory_vector_heads (identity, model, rows, rev) SELECT identity, model, n, rev "
                         f"FROM ({_VECTOR_COUNTS})")
            rows = conn.execute("SELECT num, identity, content, created_at, context_json FROM memory_items").fetchall()
            for num, identity, content, created_at, context in rows:
                write_text_row(conn, num, identity, content, created_at, Context.from_json(context))
            return len(rows)

        return await self._db.run_write(rebuild)

    async def consistency(self) -> dict[str, int]:
        """Counts that must agree: rows against text index rows, vectors without a row,
        each identity's vectors against the count its searches check."""
        def count(conn: sqlite3.Connection) -> dict[str, int]:
            def one(sql: str) -> int:
                return conn.execute(sql).fetchone()[0]
            return {
                "rows": one("SELECT COUNT(*) FROM memory_items"),
                "text_rows": one("SELECT COUNT(*) FROM memory_fts"),
                "rows_without_text": one("SELECT COUNT(*) FROM memory_items m WHERE NOT EXISTS "
                                         "(SELECT 1 FROM memory_fts f WHERE f.rowid = m.num)"),
                "orphan_vectors": one("SELECT COUNT(*) FROM memory_vectors v WHERE NOT EXISTS "
                                      "(SELECT 1 FROM memory_items m WHERE m.num = v.num)"),
                "unembedded": one("SELECT COUNT(*) FROM memory_items WHERE embedding_model IS NULL"),
                "miscounted_vectors": one(f"SELECT COUNT(*) FROM ({_VECTOR_COUNTS}) c FULL JOIN memory_vector_heads h "
                                          "USING (identity, model) WHERE COALESCE(c.n, 0) != COALESCE(h.rows, 0)"),
            }

        return await self._db.run_read(count)
