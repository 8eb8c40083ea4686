"""The migration steps of long-term memory: the one that gave Ember its memories owned by identities
(people), in tiers (ember/core/memory.py), with their full-text index and vectors, and the memories
of the version before moved into it; and the one that has PostgreSQL score their vectors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import text

from ember.store.migration_step import ByDialect, Step
from ember.store.pgvector import fill_embeddings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection


async def _move_old_memories(conn: AsyncConnection) -> None:
    """Memories were a session's; now they are a person's, with an id the CLI can name."""
    from ember.core.memory import content_hash, default_identity
    from ember.store.segment import index_text, owner_token

    rows = (await conn.execute(text("SELECT id, session_key, kind, content, source_start, source_end, created_at "
                                    "FROM memories ORDER BY created_at"))).all()
    kinds = {"episodic": ("episodic", 2), "fact": ("fact", 1), "skill_note": ("procedural", 1)}
    for id_, session_key, kind, content, start, end, created_at in rows:
        new_kind, rank = kinds.get(kind, ("fact", 1))
        await conn.execute(text(
            "INSERT INTO memory_items (id, identity, kind, status, content, content_hash, source, source_rank, "
            "session_key, seq_start, seq_end, valid_from, recall_count, strength, created_at, updated_at) "
            "VALUES (:id, :identity, :kind, 'active', :content, :hash, :source, :rank, :session_key, :start, :end, "
            ":t, 0, 1.0, :t, :t)"), {
            "id": id_[:12], "identity": default_identity(session_key or ""), "kind": new_kind, "content": content,
            "hash": content_hash(content), "source": f"session {session_key}" if session_key else None,
            "rank": rank, "session_key": session_key, "start": start, "end": end, "t": created_at})
    for num, identity, content in (await conn.execute(text("SELECT num, identity, content FROM memory_items"))).all():
        await conn.execute(text("INSERT INTO memory_fts (rowid, owner, body, before, after, far, day) "
                                "VALUES (:num, :owner, :body, '', '', '', '')"),
                           {"num": num, "owner": owner_token(identity), "body": index_text(content)})
    await conn.execute(text("DROP TABLE memories"))


MEMORY_TIERS: tuple[Step, ...] = (
    # Long-term memory, owned by identities (people), in tiers (ember/core/memory.py).
    # AUTOINCREMENT: a purged memory's number is never given to another, whose vector it could get
    # (nor is an identity column's, on PostgreSQL).
    ByDialect.edited("""CREATE TABLE memory_items (
        num INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        identity TEXT NOT NULL,
        kind TEXT NOT NULL,
        status TEXT NOT NULL,
        content TEXT NOT NULL,
        content_hash TEXT NOT NULL,
        subject TEXT,
        fact_key TEXT,
        source TEXT,
        source_rank INTEGER NOT NULL,
        session_key TEXT,
        seq_start BIGINT,
        seq_end BIGINT,
        valid_from DOUBLE PRECISION NOT NULL,
        invalid_at DOUBLE PRECISION,
        superseded_by TEXT,
        recall_count INTEGER NOT NULL DEFAULT 0,
        last_recalled_at DOUBLE PRECISION,
        strength DOUBLE PRECISION NOT NULL DEFAULT 1.0,
        embedding_model TEXT,
        context_json TEXT,
        checked_at DOUBLE PRECISION,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL)""",
        "num INTEGER PRIMARY KEY AUTOINCREMENT", "num BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY"),
    "CREATE INDEX memory_by_owner ON memory_items (identity, status, kind, created_at)",
    "CREATE INDEX memory_by_fact ON memory_items (identity, subject, fact_key, status)",
    "CREATE INDEX memory_by_hash ON memory_items (identity, content_hash)",
    # An archived message is indexed once, however often its indexing job runs.
    "CREATE UNIQUE INDEX memory_archive_once ON memory_items (session_key, seq_start) WHERE kind = 'archival'",
    "CREATE INDEX memory_unembedded ON memory_items (num) WHERE embedding_model IS NULL",
    # Facts without a key not yet compared with the person's older facts (memory/reconcile.py).
    "CREATE INDEX memory_unchecked ON memory_items (num) WHERE checked_at IS NULL AND kind = 'fact' "
    "AND fact_key IS NULL",
    # The owner column holds the identity, so a search matches within one person's memories only.
    # An archived message is indexed with its neighbours (before, after, two away) and its day.
    ByDialect(
        "CREATE VIRTUAL TABLE memory_fts USING fts5(owner, body, before, after, far, day, "
        "tokenize='porter unicode61 remove_diacritics 2')",
        # As FTS5's tokenizer: words split by PostgreSQL's parser (segment.py has spaced out CJK runs),
        # folded, ASCII words stemmed (snowball's English, close to porter), stop words kept;
        # unlike it, diacritics are kept.
        ("CREATE TEXT SEARCH DICTIONARY ember_stem (TEMPLATE = snowball, LANGUAGE = english)",
         "CREATE TEXT SEARCH CONFIGURATION ember_text (COPY = simple)",
         "ALTER TEXT SEARCH CONFIGURATION ember_text ALTER MAPPING FOR asciiword, asciihword, hword_asciipart "
         "WITH ember_stem",
         # BM25's column weights (memory_rows.TEXT_WEIGHTS) are ts_rank's four classes, one per weight:
         # ts_rank('{0.35, 0.5, 0.6, 1.0}', document, query) ranks as the FTS5 query does.
         """CREATE TABLE memory_fts (
            rowid BIGINT PRIMARY KEY,
            owner TEXT NOT NULL,
            body TEXT NOT NULL,
            before TEXT NOT NULL,
            after TEXT NOT NULL,
            far TEXT NOT NULL,
            day TEXT NOT NULL,
            document TSVECTOR NOT NULL GENERATED ALWAYS AS (
                setweight(to_tsvector('ember_text', body), 'A')
                || setweight(to_tsvector('ember_text', day), 'B')
                || setweight(to_tsvector('ember_text', before), 'C')
                || setweight(to_tsvector('ember_text', after), 'C')
                || setweight(to_tsvector('ember_text', far), 'D')) STORED)""",
         "CREATE INDEX memory_fts_search ON memory_fts USING GIN (document)",
         "CREATE INDEX memory_fts_by_owner ON memory_fts (owner)"),
    ),
    # `rev` grows with every write, so a cached matrix knows which rows to read again.
    ByDialect(
        """CREATE TABLE memory_vectors (
        num INTEGER PRIMARY KEY,
        identity TEXT NOT NULL,
        model TEXT NOT NULL,
        rev INTEGER NOT NULL,
        vector BLOB NOT NULL,
        window BLOB)""",
        # The same float32 blobs, which the cached matrices read, and `embedding`, the vector as
        # pgvector's for a search by the database. An HNSW index needs a dimension, which only the
        # model knows: one per model, on `(embedding::vector(N))` WHERE model = it.
        ("CREATE EXTENSION IF NOT EXISTS vector",
         """CREATE TABLE memory_vectors (
            num BIGINT PRIMARY KEY,
            identity TEXT NOT NULL,
            model TEXT NOT NULL,
            rev BIGINT NOT NULL,
            vector BYTEA NOT NULL,
            "window" BYTEA,
            embedding VECTOR)"""),
    ),
    "CREATE INDEX memory_vectors_by_owner ON memory_vectors (identity, model, rev)",
    # Revisions only grow, purges or not, so a cached matrix never mistakes an old state for the current one.
    "CREATE TABLE memory_vector_rev (rev INTEGER NOT NULL)",
    "INSERT INTO memory_vector_rev (rev) VALUES (0)",
    # Whose turn a message was (archival memory goes to its sender), and who wrote in a session.
    "CREATE INDEX inbox_by_session ON inbox (session_key, turn_id)",
    # Per session, the first message not yet copied into the archival tier.
    "CREATE TABLE memory_archive_marks (session_key TEXT PRIMARY KEY, next_seq BIGINT NOT NULL)",
    _move_old_memories,
)


async def _fill_embeddings(conn: AsyncConnection) -> None:
    await fill_embeddings(conn)


# PostgreSQL scores a query against a person's vectors itself (store/vector_rows.py), so each
# vector's window is kept as pgvector's too, and the vectors kept only as blobs until now are copied.
# Both are kept in the row (PLAIN), not in TOAST: a search reads every one of a person's, and
# fetching each from the TOAST table made a search of 2,000 memories cost 30 ms instead of a few.
VECTORS_IN_DATABASE: tuple[Step, ...] = (
    ByDialect((), ("ALTER TABLE memory_vectors ADD COLUMN window_embedding VECTOR",
                   "ALTER TABLE memory_vectors ALTER COLUMN embedding SET STORAGE PLAIN",
                   "ALTER TABLE memory_vectors ALTER COLUMN window_embedding SET STORAGE PLAIN")),
    _fill_embeddings,
)
