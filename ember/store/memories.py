"""The memory store: memory rows, their full-text index and their vectors, always
written together (one row at a time, in a transaction: memory_rows.py).

Every statement that reads or changes a memory names its identity, so no code
path can reach another person's memory.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Select, bindparam, func, select, update

from ember.core.errors import MemoryNotFound
from ember.core.memory import LexicalHits, MemoryKind, MemoryRecord, MemoryStatus, NewMemory, WriteOutcome
from ember.store import memory_upkeep, schema
from ember.store.archive_rows import archive_messages
from ember.store.engine import Database
from ember.store.jobs import record_job
from ember.store.memory_rows import (
    EMBED_JOB,
    MEMORY,
    TEXTS_AFTER,
    Archived,
    Unembedded,
    hold_memory_writes,
    revise_memory,
    write_memory,
)
from ember.store.memory_search import BY_NUMS, lexical_hits
from ember.store.records import record_of
from ember.store.tx import Statement, Tx, in_json_array, per_dialect
from ember.store.vector_rows import (
    DELETE_OTHER_MODELS,
    UNEMBED,
    UNEMBED_OTHER_MODELS,
    UNEMBEDDED,
    VECTOR_STATE,
    VECTORS_AFTER,
    ScoredVectors,
    VectorRow,
    scored_vectors,
    store_vectors,
)

T = TypeVar("T")

REINDEX_BATCH = 500  # rows between two reports of reindex_text's progress

_mi, _v, _i = schema.memory_items, schema.memory_vectors, schema.inbox


def _listing(dialect: str, inactive: bool, in_session: bool, of_kinds: bool) -> Select[Any]:
    query = MEMORY.where(_mi.c.identity == bindparam("identity"))
    if not inactive:
        query = query.where(_mi.c.status == "active")
    if in_session:
        query = query.where(_mi.c.session_key == bindparam("session_key"))
    if of_kinds:
        query = query.where(in_json_array(_mi.c.kind, "kinds", dialect))
    return query.order_by(_mi.c.created_at.desc(), _mi.c.num.desc()).limit(bindparam("limit"))


_of = (_mi.c.identity == bindparam("owner"), _mi.c.id == bindparam("memory_id"))
_GET = Statement(MEMORY.where(*_of))
_NUM_OF = Statement(select(_mi.c.num).where(*_of))
# Every active fact, with or without an attribute: what the person stated first, then those that
# name an attribute; within each, an order that a new fact extends rather than reshuffles.
_PROFILE = Statement(MEMORY.where(_mi.c.identity == bindparam("identity"), _mi.c.kind == "fact",
                                  _mi.c.status == "active")
                     .order_by(_mi.c.source_rank.desc(), _mi.c.fact_key.is_(None), func.coalesce(_mi.c.subject, ""),
                               func.coalesce(_mi.c.fact_key, ""), _mi.c.num)
                     .limit(bindparam("limit")))
# By (include_inactive, session_key given, kinds given).
_LISTINGS = {flags: per_dialect(lambda dialect, flags=flags: _listing(dialect, *flags))
             for flags in itertools.product((False, True), repeat=3)}
_TEXT_REV = Statement(select(func.coalesce(func.max(_mi.c.text_rev), 0))
                      .where(_mi.c.identity == bindparam("identity")))
_COUNT = Statement(select(func.count()).select_from(_mi).where(_mi.c.identity == bindparam("identity")))
_OLDER = Statement(MEMORY.where(_mi.c.identity == bindparam("owner"), _mi.c.superseded_by == bindparam("memory_id")))
_SET_STATUS = Statement(update(_mi).where(*_of).values(status=bindparam("status"), updated_at=bindparam("now"),
                                                       invalid_at=func.coalesce(_mi.c.invalid_at,
                                                                                bindparam("invalid_at"))))

# Contradictions, recall and forgetting.
_UNCHECKED_FACTS = Statement(MEMORY.where(_mi.c.checked_at.is_(None), _mi.c.kind == "fact", _mi.c.fact_key.is_(None))
                             .order_by(_mi.c.num).limit(bindparam("limit")))
_MARK_CHECKED = Statement(update(_mi).where(*_of).values(checked_at=bindparam("now")))
_BOTH_ACTIVE = Statement(select(func.count()).select_from(_mi).where(
    _mi.c.identity == bindparam("owner"), _mi.c.id.in_([bindparam("old_id"), bindparam("new_id")]),
    _mi.c.status == "active"))
_SUPERSEDE_BY = Statement(update(_mi).where(_mi.c.identity == bindparam("owner"), _mi.c.id == bindparam("old_id"))
                          .values(status="superseded", superseded_by=bindparam("new_id"), invalid_at=bindparam("now"),
                                  updated_at=bindparam("now")))
_SENDERS = Statement(select(_i.c.turn_id, _i.c.channel, _i.c.sender_id)
                     .where(_i.c.session_key == bindparam("session_key")))


class SqlMemoryStore:
    """The embedded default: SQLite rows, FTS5 BM25 and vectors as float32 blobs."""

    def __init__(self, db: Database, *, embeds: bool = True) -> None:
        self._db = db
        self._embeds = embeds  # a memory with an embedder: each write queues the embedding job

    async def _write(self, work: Callable[[Tx], T]) -> T:
        """`work` as one write unit, holding the memory's writes first (memory_rows.hold_memory_writes)."""
        def unit(tx: Tx) -> T:
            hold_memory_writes(tx)
            return work(tx)

        return await self._db.run_write(unit)

    async def write(self, memory: NewMemory) -> WriteOutcome:
        now = time.time()
        return await self._write(lambda tx: write_memory(tx, memory, now, embed=self._embeds))

    async def write_many(self, memories: Sequence[NewMemory]) -> list[WriteOutcome]:
        """One transaction for the batch (imports)."""
        now = time.time()
        return await self._write(lambda tx: [write_memory(tx, m, now, embed=self._embeds) for m in memories])

    async def revise(self, identity: str, memory_id: str, content: str) -> WriteOutcome:
        """Replace the identity's active fact `memory_id` by `content`, stated by the person, in one
        transaction (store/memory_rows.revise_memory); MemoryNotFound for another's or no memory."""
        def unit(tx: Tx) -> WriteOutcome:
            row = tx.execute(_GET, {"owner": identity, "memory_id": memory_id}).fetchone()
            if row is None:
                raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
            return revise_memory(tx, *record_of(row), content, time.time(), embed=self._embeds)

        return await self._write(unit)

    async def get(self, identity: str, memory_id: str) -> MemoryRecord:
        row = await self._db.run_read(lambda tx: tx.execute(
            _GET, {"owner": identity, "memory_id": memory_id}).fetchone())
        if row is None:
            raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
        return record_of(row)[1]

    async def by_nums(self, identity: str, nums: Sequence[int]) -> dict[int, MemoryRecord]:
        if not nums:
            return {}
        found = {"nums": json.dumps(list(nums)), "identity": identity}
        rows = await self._db.run_read(lambda tx: tx.execute(BY_NUMS, found).fetchall())
        return dict(map(record_of, rows))

    async def prompt_records(self, identity: str, profile_limit: int, episode_owners: Sequence[str],
                             session_key: str, episode_limit: int) -> tuple[list[MemoryRecord], list[MemoryRecord]]:
        """In one read: the identity's active facts (the profile), stated ones first, in a stable
        order, and the session's latest episodes of each of `episode_owners`, newest first."""
        listing = _LISTINGS[False, True, True]
        kinds = json.dumps([MemoryKind.EPISODIC.value])

        def read(tx: Tx) -> tuple[list[Any], list[Any]]:
            profile = tx.execute(_PROFILE, {"identity": identity, "limit": profile_limit}).fetchall()
            episodes = [row for owner in episode_owners for row in tx.execute(listing, {
                "identity": owner, "session_key": session_key, "kinds": kinds, "limit": episode_limit}).fetchall()]
            return profile, episodes

        profile, episodes = await self._db.run_read(read)
        return [record_of(row)[1] for row in profile], [record_of(row)[1] for row in episodes]

    async def list(self, identity: str, *, kinds: Sequence[MemoryKind] = (), include_inactive: bool = False,
                   limit: int = 100, session_key: str | None = None) -> list[MemoryRecord]:
        """Newest first."""
        listing = _LISTINGS[include_inactive, session_key is not None, bool(kinds)]
        params = {"identity": identity, "session_key": session_key, "kinds": json.dumps([k.value for k in kinds]),
                  "limit": limit}
        rows = await self._db.run_read(lambda tx: tx.execute(listing, params).fetchall())
        return [record_of(row)[1] for row in rows]

    async def lexical(self, identity: str, terms: Sequence[str], limit: int, *, records: int = 0) -> LexicalHits:
        """The full-text search's hits and the records of the first `records`, in one read (memory_search.py)."""
        return await self._db.run_read(lambda tx: lexical_hits(tx, identity, terms, limit, records))

    async def text_rev(self, identity: str) -> int:
        """The highest text revision of the identity's memories (0 when it has none)."""
        return await self._db.run_read(lambda tx: tx.execute(_TEXT_REV, {"identity": identity}).fetchone()[0])

    async def count(self, identity: str) -> int:
        """How many memories the identity has, in any state."""
        return await self._db.run_read(lambda tx: tx.execute(_COUNT, {"identity": identity}).fetchone()[0])

    async def texts_after(self, identity: str, rev: int, limit: int) -> list[tuple[int, int, tuple[str, ...]]]:
        """(num, text revision, the text index row's columns after `owner`) of the identity's
        memories whose text was written after revision `rev`, in revision order."""
        rows = await self._db.run_read(lambda tx: tx.execute(
            TEXTS_AFTER, {"identity": identity, "rev": rev, "limit": limit}).fetchall())
        return [(num, text_rev, tuple(columns)) for num, text_rev, *columns in rows]

    async def history(self, identity: str, memory_id: str) -> list[MemoryRecord]:
        """The supersession chain through a fact, oldest first."""
        def read(tx: Tx) -> list[MemoryRecord]:
            found = tx.execute(_GET, {"owner": identity, "memory_id": memory_id}).fetchone()
            if found is None:
                raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
            chain = [record_of(found)[1]]
            while (older := tx.execute(_OLDER, {"owner": identity, "memory_id": chain[0].id}).fetchone()) is not None:
                chain.insert(0, record_of(older)[1])
            while chain[-1].superseded_by and (newer := tx.execute(
                    _GET, {"owner": identity, "memory_id": chain[-1].superseded_by}).fetchone()):
                chain.append(record_of(newer)[1])
            return chain

        return await self._db.run_read(read)

    async def set_status(self, identity: str, memory_id: str, status: MemoryStatus) -> MemoryRecord:
        now = time.time()

        def change(tx: Tx) -> MemoryRecord:
            memory = {"owner": identity, "memory_id": memory_id}
            done = tx.execute(_SET_STATUS, {**memory, "status": status.value, "now": now,
                                            "invalid_at": now if status is not MemoryStatus.ACTIVE else None})
            if done.rowcount != 1:
                raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
            return record_of(tx.execute(_GET, memory).fetchone())[1]

        return await self._write(change)

    async def purge(self, identity: str, memory_id: str) -> None:
        """Delete for real: the row, its text index row and its vector."""
        def delete(tx: Tx) -> None:
            row = tx.execute(_NUM_OF, {"owner": identity, "memory_id": memory_id}).fetchone()
            if row is None:
                raise MemoryNotFound(f"no memory {memory_id!r}; `ember memory list` shows them")
            memory_upkeep.delete_memory(tx, row[0], identity, memory_id)

        await self._write(delete)

    async def purge_sessions(self, keys: Sequence[str]) -> int:
        """Delete for real every memory made of the sessions `keys`, or kept in them; how many."""
        return await self._write(lambda tx: memory_upkeep.delete_of_sessions(tx, keys)) if keys else 0

    # -- vectors ---------------------------------------------------------------

    async def unembedded(self, limit: int) -> list[Unembedded]:
        """Memories with no vector yet, of any identity (the embedding job's)."""
        rows = await self._db.run_read(lambda tx: tx.execute(UNEMBEDDED, {"limit": limit}).fetchall())
        return [Unembedded(*row) for row in rows]

    async def count_unembedded(self) -> int:
        return await self._db.run_read(lambda tx: tx.execute(memory_upkeep.COUNT_UNEMBEDDED).fetchone()[0])

    async def set_vectors(self, model: str, vectors: Iterable[tuple[Unembedded, bytes, bytes | None]]) -> int:
        """Store each memory's vector and window vector, and stamp its row with the model; returns how many.

        A row whose neighbours changed since it was read keeps waiting: its
        window was made from the old ones, and the next run embeds it again.
        """
        rows = list(vectors)
        return await self._write(lambda tx: store_vectors(tx, model, rows))

    async def vectors_since(self, identity: str, model: str,
                            rev: int) -> tuple[tuple[int, int], list[tuple[int, int, bytes, bytes | None]]]:
        """In one read: (count, highest rev) of the identity's vectors by `model`, what a cached matrix
        checks against, and the (num, rev, vector, window) written after `rev`, in order."""
        def read(tx: Tx) -> tuple[tuple[int, int], list[VectorRow]]:
            state = tx.execute(VECTOR_STATE, {"identity": identity, "model": model}).fetchone()
            rows = tx.execute(VECTORS_AFTER, {"identity": identity, "model": model, "rev": rev}).fetchall()
            return (0, 0) if state is None else (state[0], state[1]), [tuple(row) for row in rows]

        return await self._db.run_read(read)

    @property
    def scores_vectors(self) -> bool:
        """Whether the database scores vectors itself (PostgreSQL's pgvector), rather than a process."""
        return self._db.dialect == "postgresql"

    async def vector_scores(self, identity: str, model: str, query: Sequence[float], *,
                            most: int) -> ScoredVectors | None:
        """On PostgreSQL: each of the identity's vectors scored against `query`, unless it has `most`
        or more (vector_rows.scored_vectors)."""
        return await self._db.run_read(lambda tx: scored_vectors(tx, identity, model, query, most))

    async def quarantine_vector(self, num: int) -> None:
        """A vector that cannot be read is dropped and its memory queued for embedding again."""
        now = time.time()

        def drop(tx: Tx) -> None:
            tx.execute(memory_upkeep.DELETE_VECTOR, {"num": num})
            tx.execute(UNEMBED, {"memory_num": num})
            record_job(tx, EMBED_JOB, now)

        await self._write(drop)

    async def queue_embedding(self) -> None:
        """Queue the embedding job, which embeds every memory still without a vector."""
        await self._write(lambda tx: record_job(tx, EMBED_JOB, time.time()))

    async def forget_other_models(self, model: str) -> int:
        """Queue every memory embedded by another model for a new embedding; returns how many."""
        now = time.time()

        def requeue(tx: Tx) -> int:
            changed = tx.execute(UNEMBED_OTHER_MODELS, {"model": model}).rowcount
            tx.execute(DELETE_OTHER_MODELS, {"model": model})
            if changed:
                record_job(tx, EMBED_JOB, now)
            return changed

        return await self._write(requeue)

    # -- contradictions ----------------------------------------------------------

    async def unchecked_facts(self, limit: int) -> list[MemoryRecord]:
        """Keyless facts of any identity not yet compared with older ones, oldest first."""
        rows = await self._db.run_read(lambda tx: tx.execute(_UNCHECKED_FACTS, {"limit": limit}).fetchall())
        return [record_of(row)[1] for row in rows]

    async def mark_checked(self, identity: str, memory_id: str) -> None:
        now = time.time()
        await self._write(lambda tx: tx.execute(
            _MARK_CHECKED, {"owner": identity, "memory_id": memory_id, "now": now}))

    async def supersede_by(self, identity: str, old_id: str, new_id: str) -> None:
        """The newer fact replaces the older one, if both are still active; the old one keeps its history."""
        now = time.time()

        def change(tx: Tx) -> None:
            pair = {"owner": identity, "old_id": old_id, "new_id": new_id}
            if tx.execute(_BOTH_ACTIVE, pair).fetchone()[0] == 2:
                tx.execute(_SUPERSEDE_BY, {**pair, "now": now})

        await self._write(change)

    # -- recall and forgetting ---------------------------------------------------

    async def note_recalls(self, recalls: dict[tuple[str, str], tuple[int, float]]) -> None:
        """Add recall counts ((identity, id) -> (times, last time)) in one write; a recall restores full strength."""
        rows = [{"owner": identity, "memory_id": id_, "times": times, "last": last}
                for (identity, id_), (times, last) in recalls.items()]
        await self._write(lambda tx: tx.executemany(memory_upkeep.RECALLED, rows))

    async def decay_candidates(self, kinds: Sequence[MemoryKind]) -> list[MemoryRecord]:
        rows = await self._db.run_read(lambda tx: tx.execute(
            memory_upkeep.DECAY_CANDIDATES, {"kinds": json.dumps([k.value for k in kinds])}).fetchall())
        return [record_of(row)[1] for row in rows]

    async def set_strengths(self, strengths: dict[str, float], archive: Sequence[str]) -> None:
        now = time.time()

        def store(tx: Tx) -> None:
            tx.executemany(memory_upkeep.SET_STRENGTH,
                           [{"memory_id": id_, "strength": value} for id_, value in strengths.items()])
            tx.executemany(memory_upkeep.ARCHIVE_FADED, [{"memory_id": id_, "now": now} for id_ in archive])

        await self._write(store)

    # -- archival tier -----------------------------------------------------------

    async def senders(self, session_key: str) -> dict[str, tuple[str, str]]:
        """turn id -> (channel, sender id) of every message the session accepted."""
        rows = await self._db.run_read(lambda tx: tx.execute(_SENDERS, {"session_key": session_key}).fetchall())
        return {turn_id: (channel, sender) for turn_id, channel, sender in rows}

    async def archive_session(self, session_key: str, resolve: Callable[[str, str], str], *,
                              queue_embedding: bool = True, pending: int = 0) -> Archived:
        """Copy the session's committed user and assistant messages not yet archived
        into the archival tier, in one transaction; how many, and up to `pending` of the
        memories then waiting for their vectors (read in it, for the caller to embed).

        Each goes to the identity `resolve(channel, sender)` of its turn's
        message, read in the same transaction (a message without a receipt, to the
        session's). Nothing of an evaluation session is archived. Each is indexed
        with its neighbours; the two archived before these learn their new
        neighbours too, and their window vectors are made again (they now reach
        the first new ones). Without `queue_embedding` no embedding job is
        queued: the caller embeds them before its own job completes.
        """
        now, embed = time.time(), self._embeds and queue_embedding

        def unit(tx: Tx) -> Archived:
            count = archive_messages(tx, session_key, resolve, now, embed=embed)
            waiting = tx.execute(UNEMBEDDED, {"limit": pending}).fetchall() if pending else []
            return Archived(count, [Unembedded(*row) for row in waiting])

        return await self._write(unit)

    # -- upkeep --------------------------------------------------------------------

    async def reindex_text(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Rebuild the text index from the rows, and drop vectors left without a
        row; returns how many rows the index holds.

        One transaction, so a search meanwhile sees the old index or the new
        one. `progress(done, total)` is called before the first row and after
        every REINDEX_BATCH rows, on the store's writer thread: keep it quick.
        """
        return await self._write(lambda tx: memory_upkeep.rebuild(tx, REINDEX_BATCH, progress))

    async def consistency(self) -> dict[str, int]:
        """Counts that must agree: rows against text index rows, vectors without a row,
        each identity's vectors against the count its searches check."""
        return await self._db.run_read(memory_upkeep.counts)

