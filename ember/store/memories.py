"""The memory store: memory rows, their full-text index and their vectors, always
written together (one row at a time, in a transaction: memory_rows.py).

Every statement that reads or changes a memory names its identity, so no code
path can reach another person's memory.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ember.core.errors import MemoryNotFound
from ember.core.memory import (
    MemoryKind,
    MemoryRecord,
    MemoryStatus,
    NewMemory,
)
from ember.store.database import Database
from ember.store.jobs import record_job
from ember.store.memory_rows import (
    EMBED_JOB,
    SELECT_MEMORY,
    TEXT_WEIGHTS,
    Context,
    Unembedded,
    WriteOutcome,
    archive_messages,
    record_of,
    write_memory,
    write_text_row,
)
from ember.store.segment import COMMON_ROWS, distinctive, expression, indexed_form, owner_token

_BM25 = f"bm25(memory_fts, {', '.join(map(str, TEXT_WEIGHTS))})"
_LEXICAL = f"SELECT rowid, -{_BM25} FROM memory_fts WHERE memory_fts MATCH ? ORDER BY {_BM25} LIMIT ?"
REINDEX_BATCH = 500  # rows between two reports of reindex_text's progress
_REINDEX_ROWS = ("SELECT num, identity, content, created_at, context_json FROM memory_items "
                 "WHERE num > ? ORDER BY num LIMIT ?")
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
            f"{SELECT_MEMORY} WHERE identity = ? AND id = ?", (identity, memory_id)).fetchone())
        if row is None:
            raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
        return record_of(row)[1]

    async def by_nums(self, identity: str, nums: Sequence[int]) -> dict[int, MemoryRecord]:
        if not nums:
            return {}

        def read(conn: sqlite3.Connection) -> dict[int, MemoryRecord]:
            marks = ",".join("?" * len(nums))
            # `+identity`: look the rows up by number; SQLite would otherwise walk the identity's index.
            rows = conn.execute(f"{SELECT_MEMORY} WHERE num IN ({marks}) AND +identity = ?", (*nums, identity))
            return dict(record_of(row) for row in rows)

        return await self._db.run_read(read)

    async def profile(self, identity: str, limit: int) -> list[MemoryRecord]:
        """The identity's active facts that name an attribute (subject and key), in a stable order."""
        sql = (f"{SELECT_MEMORY} WHERE identity = ? AND kind = 'fact' AND status = 'active' AND fact_key IS NOT NULL "
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
        sql = f"{SELECT_MEMORY} WHERE {where} ORDER BY created_at DESC, num DESC LIMIT ?"
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

    async def text_rev(self, identity: str) -> int:
        """The highest text revision of the identity's memories (0 when it has none)."""
        return await self._db.run_read(lambda conn: conn.execute(
            "SELECT COALESCE(MAX(text_rev), 0) FROM memory_items WHERE identity = ?", (identity,)).fetchone()[0])

    async def count(self, identity: str) -> int:
        """How many memories the identity has, in any state."""
        return await self._db.run_read(lambda conn: conn.execute(
            "SELECT COUNT(*) FROM memory_items WHERE identity = ?", (identity,)).fetchone()[0])

    async def texts_after(self, identity: str, rev: int, limit: int) -> list[tuple[int, int, tuple[str, ...]]]:
        """(num, text revision, the text index row's columns after `owner`) of the identity's
        memories whose text was written after revision `rev`, in revision order."""
        sql = ("SELECT m.num, m.text_rev, f.body, f.before, f.after, f.far, f.day FROM memory_items m "
               "JOIN memory_fts f ON f.rowid = m.num WHERE m.identity = ? AND m.text_rev > ? "
               "ORDER BY m.text_rev LIMIT ?")
        rows = await self._db.run_read(lambda conn: conn.execute(sql, (identity, rev, limit)).fetchall())
        return [(num, text_rev, tuple(columns)) for num, text_rev, *columns in rows]

    async def history(self, identity: str, memory_id: str) -> list[MemoryRecord]:
        """The supersession chain through a fact, oldest first."""
        def read(conn: sqlite3.Connection) -> list[MemoryRecord]:
            found = conn.execute(f"{SELECT_MEMORY} WHERE identity = ? AND id = ?", (identity, memory_id)).fetchone()
            if found is None:
                raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
            chain = [record_of(found)[1]]
            while (older := conn.execute(f"{SELECT_MEMORY} WHERE identity = ? AND superseded_by = ?",
                                         (identity, chain[0].id)).fetchone()) is not None:
                chain.insert(0, record_of(older)[1])
            while chain[-1].superseded_by and (newer := conn.execute(
                    f"{SELECT_MEMORY} WHERE identity = ? AND id = ?", (identity, chain[-1].superseded_by)).fetchone()):
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
            return record_of(conn.execute(f"{SELECT_MEMORY} WHERE identity = ? AND id = ?",
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
            f"{SELECT_MEMORY} WHERE checked_at IS NULL AND kind = 'fact' AND fact_key IS NULL ORDER BY num LIMIT ?",
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
            f"{SELECT_MEMORY} WHERE status = 'active' AND kind IN ({marks})", [k.value for k in kinds]).fetchall())
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
        return await self._db.run_write(lambda conn: archive_messages(conn, session_key, resolve, fallback, now))

    # -- upkeep --------------------------------------------------------------------

    async def reindex_text(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Rebuild the text index from the rows, and drop vectors left without a
        row; returns how many rows the index holds.

        One transaction, so a search meanwhile sees the old index or the new
        one. `progress(done, total)` is called before the first row and after
        every REINDEX_BATCH rows, on the store's writer thread: keep it quick.
        """
        def rebuild(conn: sqlite3.Connection) -> int:
            conn.execute("DELETE FROM memory_fts")
            conn.execute("DELETE FROM memory_vectors WHERE num NOT IN (SELECT num FROM memory_items)")
            conn.execute("DELETE FROM memory_vector_heads")
            conn.execute(f"INSERT INTO memory_vector_heads (identity, model, rows, rev) SELECT identity, model, n, rev "
                         f"FROM ({_VECTOR_COUNTS})")
            total = conn.execute("SELECT COUNT(*) FROM memory_items").fetchone()[0]
            if progress is not None:
                progress(0, total)
            done = last = 0
            while batch := conn.execute(_REINDEX_ROWS, (last, REINDEX_BATCH)).fetchall():
                for num, identity, content, created_at, context in batch:
                    write_text_row(conn, num, identity, content, created_at, Context.from_json(context))
                done, last = done + len(batch), batch[-1][0]
                if progress is not None:
                    progress(done, total)
            return done

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
