"""One memory row at a time, in the caller's transaction: what a memory row and its
text row are, writing one (deduplicated, superseding), archiving a message.

Every write of a memory row writes its full-text row in the same transaction,
and queues the embedding job there too (I6): a crash keeps all or none.

A memory is derived from what was said, so its text is redacted (core/redact.py) and
its thinking left out (I4) here, where every memory is written: the row, its text index
row and its vectors never hold a secret or a `<think>` block, whichever path wrote it
(an archived message, the remember tool, a review, an episode, an import, the API).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import dataclass

from sqlalchemy import bindparam, null, select, update

from ember.core.errors import MemoryInputError
from ember.core.jobs import JobKind, JobRequest
from ember.core.memory import (
    MemoryKind,
    MemoryRecord,
    MemoryStatus,
    NewMemory,
    SourceRank,
    WriteOutcome,
    check_content,
    content_hash,
    normalized_key,
)
from ember.core.redact import redact_text
from ember.store import schema
from ember.store.jobs import record_job
from ember.store.records import record_of
from ember.store.segment import index_text, owner_token
from ember.store.tx import Statement, Tx

_mi = schema.memory_items
# The columns record_of reads, in its order.
MEMORY = select(*(_mi.c[name] for name in (
    "num", "id", "identity", "kind", "status", "content", "subject", "fact_key", "source", "source_rank",
    "session_key", "seq_start", "seq_end", "created_at", "valid_from", "invalid_at", "superseded_by", "recall_count",
    "last_recalled_at", "strength")))
_INSERT = Statement(
    "INSERT INTO memory_items (id, identity, kind, status, content, content_hash, subject, fact_key, source, "
    "source_rank, session_key, seq_start, seq_end, valid_from, recall_count, strength, context_json, checked_at, "
    "created_at, updated_at) VALUES (:id, :identity, :kind, :status, :content, :hash, :subject, :key, :source, "
    ":rank, :session_key, :seq_start, :seq_end, :created_at, 0, 1.0, :context, :now, :created_at, :now)"
)
# Read back by id rather than RETURNING: SQLite runs an INSERT ... RETURNING in a statement savepoint,
# which makes the text index flush its pending terms at every memory of a transaction.
_NUM_OF_ID = Statement(select(_mi.c.num).where(_mi.c.id == bindparam("id")))
_BUMP_TEXT_REV = Statement("UPDATE memory_items SET text_rev = (SELECT COALESCE(MAX(text_rev), 0) + 1 "
                           "FROM memory_items WHERE identity = :identity) WHERE num = :num")
_KNOWN = Statement(MEMORY.where(_mi.c.identity == bindparam("identity"), _mi.c.content_hash == bindparam("hash"),
                                _mi.c.kind == bindparam("kind"), _mi.c.status != "archived")
                   .order_by(_mi.c.status == "pending").limit(1))
_CURRENT_FACTS = Statement(MEMORY.where(_mi.c.identity == bindparam("identity"),
                                        _mi.c.subject.is_not_distinct_from(bindparam("subject")),
                                        _mi.c.fact_key == bindparam("key"), _mi.c.status == "active"))
_UNCHECKED = Statement(update(_mi).where(_mi.c.num == bindparam("memory_num")).values(checked_at=null()))
_SUPERSEDE = Statement(update(_mi).where(_mi.c.num == bindparam("memory_num")).values(
    status="superseded", superseded_by=bindparam("by_id"), invalid_at=bindparam("now"), updated_at=bindparam("now")))
_BY_NUM = Statement(MEMORY.where(_mi.c.num == bindparam("num")))

# The full-text index memory_fts, its rows keyed by their memory's num as `rowid`: FTS5's virtual
# table on SQLite, searched with MATCH and bm25 and counted by its vocabulary table memory_fts_terms;
# on PostgreSQL a table with a weighted tsvector, searched with @@ and ranked by ts_rank
# (migration_memory.py). BM25 weights of its columns: owner, body, before, after, far, day.
TEXT_WEIGHTS = (0.0, 1.0, 0.5, 0.5, 0.35, 0.6)
_BM25 = f"bm25(memory_fts, {', '.join(map(str, TEXT_WEIGHTS))})"
INSERT_TEXT = Statement("INSERT INTO memory_fts (rowid, owner, body, before, after, far, day) "
                        "VALUES (:num, :owner, :body, :before, :after, :far, :day)")
DELETE_TEXT = Statement("DELETE FROM memory_fts WHERE rowid = :num")
# On PostgreSQL a row's ts_rank is weighed by the BM25 idf of the query's terms it has, each
# from the number of the person's matching rows it is in against :total: a rare word outweighs a
# common one. A row's tsvector is read whole once (`document || ''`), not again for every term.
LEXICAL = Statement(f"SELECT rowid, -{_BM25} FROM memory_fts WHERE memory_fts MATCH :match ORDER BY {_BM25} "
                    "LIMIT :limit",
                    "WITH q AS MATERIALIZED (SELECT to_tsquery('ember_text', t) AS query "
                    "                        FROM json_array_elements_text(CAST(:terms AS json)) AS t), "
                    "m AS MATERIALIZED (SELECT rowid, document || ''::tsvector AS document, "
                    "                          ts_rank('{0.35, 0.5, 0.6, 1.0}', document, "
                    "                                  to_tsquery('ember_text', :any_of)) AS r FROM memory_fts "
                    "      WHERE owner = :owner AND document @@ to_tsquery('ember_text', :any_of)), "
                    "idf AS MATERIALIZED (SELECT q.query, "
                    "                            ln(1 + (CAST(:total AS DOUBLE PRECISION) - n + 0.5) / (n + 0.5)) AS w "
                    "        FROM q, LATERAL (SELECT count(*) AS n FROM m WHERE m.document @@ q.query) AS df) "
                    "SELECT rowid, r * (SELECT SUM(w) FROM idf WHERE m.document @@ idf.query) AS s "
                    "FROM m ORDER BY s DESC LIMIT :limit")
TERM_ROWS = Statement(None, postgresql=
    "SELECT t, (SELECT count(*) FROM memory_fts WHERE owner = :owner AND document @@ to_tsquery('ember_text', t)) "
    "FROM json_array_elements_text(CAST(:terms AS json)) AS t "
    "UNION ALL SELECT NULL, count(*) FROM memory_fts WHERE owner = :owner")
TERM_ROWS = Statement("SELECT term, doc FROM memory_fts_terms WHERE term IN (SELECT value FROM json_each(:terms))",
                      portable=False)
TEXTS_AFTER = Statement(
    "SELECT m.num, m.text_rev, f.body, f.before, f.after, f.far, f.day FROM memory_items m "
    "JOIN memory_fts f ON f.rowid = m.num WHERE m.identity = :identity AND m.text_rev > :rev "
    "ORDER BY m.text_rev LIMIT :limit")

# SQLite runs one write at a time; PostgreSQL runs them side by side at READ COMMITTED. A memory
# write reads, then writes on what it read (is this content known, which fact of the key is active,
# the identity's next text revision, which a text index catches up by, so revisions must follow the
# commits), and the rows it updates are many (an upkeep's strengths, a batch of vectors): side by side,
# two such writes would both add one content, number two texts alike, or deadlock. So every
# unit that writes memory rows holds this lock first, to its commit: across every process on the
# database, the memory's writes queue as they do on SQLite.
_MEMORY_WRITES_LOCK = 0x656D6265725F6D65  # b"ember_me"
_HOLD_MEMORY_WRITES = Statement(f"SELECT pg_advisory_xact_lock({_MEMORY_WRITES_LOCK})")

EMBED_JOB = JobRequest(JobKind.EMBED, "all")
# How much of a neighbouring message an archived one keeps as its context: a pasted document
# beside it is indexed once, as itself, not again in each neighbour.
NEIGHBOUR_CHARS = 1_000
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

    @property
    def adjacent(self) -> tuple[str, ...]:
        """The messages right before and after."""
        return tuple(part for part in (self.before, self.after) if part)


def _day(timestamp: float) -> str:
    moment = dt.datetime.fromtimestamp(timestamp, dt.UTC)
    return f"{moment.day} {moment:%B} {moment.year}"


def write_text_row(tx: Tx, num: int, identity: str, content: str, created_at: float,
                   context: Context = Context()) -> None:
    tx.execute(INSERT_TEXT, {"num": num, "owner": owner_token(identity), "body": index_text(content),
                             "before": index_text(context.before), "after": index_text(context.after),
                             "far": index_text("\n".join(context.far)), "day": _day(created_at)})
    tx.execute(_BUMP_TEXT_REV, {"identity": identity, "num": num})


def hold_memory_writes(tx: Tx) -> None:
    """Queue behind any other unit writing memory rows, until this one commits (PostgreSQL; SQLite's
    one writer already does). First in a unit, before it reads what it will write on."""
    if tx.dialect == "postgresql":
        tx.execute(_HOLD_MEMORY_WRITES)


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def stored_content(content: str) -> str:
    """A memory's text as it is kept: checked (which leaves the thinking out), redacted, then checked
    again (redaction can change its length)."""
    return check_content(redact_text(check_content(content)))


def insert_memory(tx: Tx, memory: NewMemory, now: float, *, status: MemoryStatus = MemoryStatus.ACTIVE,
                  context: Context = Context(), embed: bool = True) -> tuple[int, str]:
    """Write one memory row, its text index row and (with `embed`: a memory runs with an
    embedder) the embedding job, in the caller's transaction. `context` comes redacted
    (archive_messages)."""
    content = stored_content(memory.content)
    created_at = memory.created_at if memory.created_at is not None else now
    id_ = new_id()
    tx.execute(_INSERT, {
        "id": id_, "identity": memory.identity, "kind": memory.kind.value, "status": status.value,
        "content": content, "hash": content_hash(content), "subject": normalized_key(memory.subject),
        "key": normalized_key(memory.key), "source": memory.source, "rank": int(memory.source_rank),
        "session_key": memory.session_key, "seq_start": memory.seq_start, "seq_end": memory.seq_end,
        "created_at": created_at, "now": now, "context": context.to_json(),
    })
    num = tx.execute(_NUM_OF_ID, {"id": id_}).fetchone()[0]
    write_text_row(tx, num, memory.identity, content, created_at, context)
    if embed:
        record_job(tx, EMBED_JOB, now)
    return num, id_


@dataclass(frozen=True, slots=True)
class Archived:
    """What an archive wrote: how many messages, and memories waiting for their vectors then."""

    count: int
    pending: list[Unembedded]


@dataclass(frozen=True, slots=True)
class Unembedded:
    """A memory waiting for its vectors, as it was when read."""

    num: int
    identity: str
    content: str
    context_json: str | None

    @property
    def context(self) -> Context | None:
        """Its neighbours, which its window vector is made with; None for a memory that has none (no window)."""
        return Context.from_json(self.context_json) if self.context_json else None





def write_memory(tx: Tx, memory: NewMemory, now: float, *, embed: bool = True) -> WriteOutcome:
    """Add a memory unless this identity already has its content, in any state
    but forgotten: a fact said twice is one fact, and an import run again adds
    nothing, superseded facts included. (An episode is always added: its
    source span makes it new.) A pending fact said again by a better source
    takes effect, or still waits if an even better one stands against it: one
    row waits either way.

    A fact with a subject and key supersedes the active fact of the same
    subject and key at once, unless that one has a better source: then the
    new fact is parked as pending (needs confirmation) and nothing changes.

    The caller's unit holds the memory's writes (hold_memory_writes).
    """
    content = stored_content(memory.content)
    existing = None if memory.kind is MemoryKind.EPISODIC else tx.execute(_KNOWN, {
        "identity": memory.identity, "hash": content_hash(content), "kind": memory.kind.value}).fetchone()
    confirmed: int | None = None
    if existing is not None:
        existing_num, known = record_of(existing)
        if known.status is not MemoryStatus.PENDING or memory.source_rank <= known.source_rank:
            return WriteOutcome(known, created=False)
        confirmed = existing_num
    subject, key = normalized_key(memory.subject), normalized_key(memory.key)
    current: list[tuple[int, MemoryRecord]] = []
    if key is not None:
        current = [record_of(row) for row in tx.execute(
            _CURRENT_FACTS, {"identity": memory.identity, "subject": subject, "key": key}).fetchall()]
    parked = any(record.source_rank > memory.source_rank for _, record in current)
    num, id_ = insert_memory(tx, memory, now, status=MemoryStatus.PENDING if parked else MemoryStatus.ACTIVE,
                             embed=embed)
    if confirmed is not None:
        # Said again by a better source: the new row replaces the weaker one, active or still waiting.
        supersede(tx, confirmed, id_, now)
    if parked:
        return WriteOutcome(_get_num(tx, num), created=True)
    for old_num, _ in current:
        supersede(tx, old_num, id_, now)
    if memory.kind is MemoryKind.FACT and key is None and memory.source_rank < SourceRank.USER_STATED:
        # What the person states stands as said; what was extracted or inferred is checked.
        tx.execute(_UNCHECKED, {"memory_num": num})
        record_job(tx, RECONCILE_JOB, now)
    return WriteOutcome(_get_num(tx, num), created=True, superseded=tuple(r.id for _, r in current))


def revise_memory(tx: Tx, num: int, old: MemoryRecord, content: str, now: float, *, embed: bool) -> WriteOutcome:
    """The person's correction of fact `old` (row `num`): a fact they state, of the same subject and
    key, that supersedes `old`; both stay in its history. The caller's unit holds the memory's writes."""
    if old.kind is not MemoryKind.FACT or old.status is not MemoryStatus.ACTIVE:
        raise MemoryInputError(f"only an active fact can be changed; {old.id} is {old.status.value} "
                               f"({old.kind.value}): forget it instead")
    if stored_content(content) == old.content:
        return WriteOutcome(old, created=False)
    # A row of its own even where an earlier version said the same: the person may change it back.
    new_num, new_id = insert_memory(tx, NewMemory(identity=old.identity, content=content, subject=old.subject,
                                                  key=old.key, source="corrected by the person"), now, embed=embed)
    supersede(tx, num, new_id, now)
    return WriteOutcome(_get_num(tx, new_num), created=True, superseded=(old.id,))


def supersede(tx: Tx, num: int, by_id: str, now: float) -> None:
    tx.execute(_SUPERSEDE, {"memory_num": num, "by_id": by_id, "now": now})


def _get_num(tx: Tx, num: int) -> MemoryRecord:
    return record_of(tx.execute(_BY_NUM, {"num": num}).fetchone())[1]
