"""A memory's vectors in the caller's transaction: the statements that find what waits for
one, storing a batch of them, and on PostgreSQL scoring them (SqlMemoryStore's vector methods).

Both engines keep each vector as a float32 blob, which SQLite's processes read into matrices of
their own (memory/vectors.py). PostgreSQL also keeps it as pgvector's, and scores a query against
a person's vectors itself: no process of a cluster holds anyone's vectors, and a restarted worker
has none to read again.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import bindparam, delete, null, select, update

from ember.store import schema
from ember.store.memory_rows import Unembedded
from ember.store.pgvector import AS_VECTOR, embeddings_of
from ember.store.protocols import ScoredVectors
from ember.store.tx import Statement, Tx, upsert_row

_mi, _v = schema.memory_items, schema.memory_vectors

_unembedded = _mi.c.embedding_model.is_(None)
UNEMBEDDED = Statement(select(_mi.c.num, _mi.c.identity, _mi.c.content, _mi.c.context_json).where(_unembedded)
                        .order_by(_mi.c.num).limit(bindparam("limit")))
# Only the memory as it was embedded: its neighbours (context) unchanged since.
_STAMP = Statement(update(_mi).where(_mi.c.num == bindparam("memory_num"), _mi.c.identity == bindparam("owner"),
                                     _unembedded, _mi.c.context_json.is_not_distinct_from(bindparam("context")))
                   .values(embedding_model=bindparam("model")))
# The highest of `count` new revisions: the one row counts every vector written, in commit order.
_NEXT_VECTOR_REVS = Statement("UPDATE memory_vector_rev SET rev = rev + :count RETURNING rev")
# An update, not a replace: the database's triggers keep the per-identity counts.
_PUT_VECTOR = upsert_row(_v, ["num"])
# (num, rev, vector, window) of one memory's vectors; window is None where it is the vector itself.
VectorRow = tuple[int, int, bytes, bytes | None]
VECTOR_STATE = Statement("SELECT rows, rev FROM memory_vector_heads WHERE identity = :identity AND model = :model")
VECTORS_AFTER = Statement(select(_v.c.num, _v.c.rev, _v.c.vector, _v.c.window)
                           .where(_v.c.identity == bindparam("identity"), _v.c.model == bindparam("model"),
                                  _v.c.rev > bindparam("rev")).order_by(_v.c.rev))
UNEMBED = Statement(update(_mi).where(_mi.c.num == bindparam("memory_num")).values(embedding_model=null()))
UNEMBED_OTHER_MODELS = Statement(update(_mi).where(_mi.c.embedding_model.is_not(None),
                                                    _mi.c.embedding_model != bindparam("model"))
                                  .values(embedding_model=null()))
DELETE_OTHER_MODELS = Statement(delete(_v).where(_v.c.model != bindparam("model")))

# PostgreSQL only, from here on.
# _PUT_VECTOR with pgvector's form of the vectors, in the same statement.
_PUT_VECTOR_AND_EMBEDDINGS = Statement(None, postgresql=(
    'INSERT INTO memory_vectors (num, identity, model, rev, vector, "window", embedding, window_embedding) '
    f"VALUES (:num, :identity, :model, :rev, :vector, :window, {AS_VECTOR.format('own')}, "
    f"{AS_VECTOR.format('around')}) ON CONFLICT (num) DO UPDATE SET identity = excluded.identity, "
    'model = excluded.model, rev = excluded.rev, vector = excluded.vector, "window" = excluded."window", '
    "embedding = excluded.embedding, window_embedding = excluded.window_embedding"))
# Each of an identity's vectors' inner product with the query (what a matrix product gives on
# SQLite), as one row of arrays: far cheaper to read than a row each. The query is made a vector
# once (MATERIALIZED), not again for each row as a prepared statement's generic plan would. A
# vector of the query's size is read; its window has its size (pgvector.embeddings_of).
_SCORES = Statement(None, postgresql=f"""
    WITH query AS MATERIALIZED (SELECT {AS_VECTOR.format("query")} AS v)
    SELECT array_agg(num), array_agg(-(embedding <#> v)), array_agg(-(COALESCE(window_embedding, embedding) <#> v))
    FROM memory_vectors, query
    WHERE identity = :identity AND model = :model AND vector_dims(embedding) = :dimensions""")
# Those it could not read (none kept, or another size): asked only when some were not read.
_UNREADABLE = Statement(None, postgresql="""
    SELECT num FROM memory_vectors WHERE identity = :identity AND model = :model
      AND (embedding IS NULL OR vector_dims(embedding) <> :dimensions)""")


def scored_vectors(tx: Tx, identity: str, model: str, query: Sequence[float], most: int) -> ScoredVectors | None:
    """PostgreSQL scores each of the identity's vectors against `query`; None when it has `most` or
    more, whom a process's nearest-vector index serves faster than a scan (memory/vectors.py)."""
    state = tx.execute(VECTOR_STATE, {"identity": identity, "model": model}).fetchone()
    held = 0 if state is None else state[0]
    if held >= most:
        return None
    params = {"identity": identity, "model": model, "query": list(query), "dimensions": len(query)}
    nums, own, around = tx.execute(_SCORES, params).fetchone()
    nums = nums or []
    unreadable = [row[0] for row in tx.execute(_UNREADABLE, params).fetchall()] if len(nums) < held else []
    return nums, own or [], around or [], unreadable


def store_vectors(tx: Tx, model: str, rows: Sequence[tuple[Unembedded, bytes, bytes | None]]) -> int:
    """Each memory's vector and window vector, its row stamped with the model; returns how many."""
    kept = [(item, blob, window) for item, blob, window in rows if tx.execute(_STAMP, {
        "memory_num": item.num, "owner": item.identity, "context": item.context_json, "model": model,
    }).rowcount == 1]  # else purged, or its neighbours changed: not the memory that was embedded
    if not kept:
        return 0
    last = tx.execute(_NEXT_VECTOR_REVS, {"count": len(kept)}).fetchone()[0]
    written = [{"num": item.num, "identity": item.identity, "model": model, "rev": rev, "vector": blob,
                "window": window} for rev, (item, blob, window) in enumerate(kept, start=last - len(kept) + 1)]
    if tx.dialect == "postgresql":
        tx.executemany(_PUT_VECTOR_AND_EMBEDDINGS, [
            row | embeddings_of(row["num"], row["vector"], row["window"]) for row in written])
    else:
        tx.executemany(_PUT_VECTOR, written)
    return len(kept)
