"""Upkeep of what the memory store derives from its rows: the text index rebuilt, the vectors
without a row dropped and each identity's recounted (`ember memory reindex`), and the counts that
must agree (`ember doctor`), each a unit of work of one `Tx`; memories deleted for real; and the
statements of recall and forgetting."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from sqlalchemy import Float, bindparam, case, delete, func, literal_column, null, select, update

from ember.core.memory import remembered_in
from ember.store import schema
from ember.store.memory_rows import DELETE_TEXT, MEMORY, Context, write_text_row
from ember.store.tx import Statement, Tx, in_json_array, per_dialect

_mi, _v = schema.memory_items, schema.memory_vectors
_VECTOR_COUNTS = "SELECT identity, model, COUNT(*) AS n, MAX(rev) AS rev FROM memory_vectors GROUP BY identity, model"
_DELETE_ORPHAN_VECTORS = Statement(delete(_v).where(_v.c.num.not_in(select(_mi.c.num))))
_CLEAR_VECTOR_HEADS = Statement("DELETE FROM memory_vector_heads")
_COUNT_VECTOR_HEADS = Statement("INSERT INTO memory_vector_heads (identity, model, rows, rev) "
                                f"SELECT identity, model, n, rev FROM ({_VECTOR_COUNTS}) AS c")
_COUNT_ROWS = Statement(select(func.count()).select_from(_mi))
_ROWS_AFTER = Statement(select(_mi.c.num, _mi.c.identity, _mi.c.content, _mi.c.created_at, _mi.c.context_json)
                        .where(_mi.c.num > bindparam("after")).order_by(_mi.c.num).limit(bindparam("limit")))
COUNT_UNEMBEDDED = Statement(select(func.count()).select_from(_mi).where(_mi.c.embedding_model.is_(None)))
_ORPHAN_VECTORS = Statement("SELECT COUNT(*) FROM memory_vectors v WHERE NOT EXISTS "
                            "(SELECT 1 FROM memory_items m WHERE m.num = v.num)")
_MISCOUNTED_VECTORS = Statement(f"SELECT COUNT(*) FROM ({_VECTOR_COUNTS}) AS c FULL JOIN memory_vector_heads h "
                                "USING (identity, model) WHERE COALESCE(c.n, 0) != COALESCE(h.rows, 0)")
DELETE_VECTOR = Statement(delete(_v).where(_v.c.num == bindparam("num")))
_UNLINK = Statement(update(_mi).where(_mi.c.identity == bindparam("owner"),
                                      _mi.c.superseded_by == bindparam("memory_id")).values(superseded_by=null()))
_DELETE = Statement(delete(_mi).where(_mi.c.num == bindparam("num")))
_OF_SESSIONS = per_dialect(lambda dialect: select(_mi.c.num, _mi.c.identity, _mi.c.id).where(
    in_json_array(_mi.c.session_key, "keys", dialect) | in_json_array(_mi.c.source, "sources", dialect)))

# Recall strengthens a memory; what fades is archived (MemoryService.upkeep).
_last = bindparam("last", type_=Float)
_last_recalled = func.coalesce(_mi.c.last_recalled_at, 0)
RECALLED = Statement(update(_mi).where(_mi.c.identity == bindparam("owner"), _mi.c.id == bindparam("memory_id")).values(
    recall_count=_mi.c.recall_count + bindparam("times"), strength=literal_column("1.0"),
    last_recalled_at=case((_last > _last_recalled, _last), else_=_last_recalled)))
DECAY_CANDIDATES = per_dialect(lambda dialect: MEMORY.where(_mi.c.status == "active",
                                                             in_json_array(_mi.c.kind, "kinds", dialect)))
SET_STRENGTH = Statement(update(_mi).where(_mi.c.id == bindparam("memory_id")).values(strength=bindparam("strength")))
ARCHIVE_FADED = Statement(update(_mi).where(_mi.c.id == bindparam("memory_id"), _mi.c.status == "active")
                     .values(status="archived", invalid_at=bindparam("now"), updated_at=bindparam("now")))
# SQLite-only: the text index is FTS5's memory_fts, its rows keyed by their memory's rowid.
_CLEAR_TEXT = Statement("DELETE FROM memory_fts")
_COUNT_TEXT_ROWS = Statement("SELECT COUNT(*) FROM memory_fts")
_ROWS_WITHOUT_TEXT = Statement("SELECT COUNT(*) FROM memory_items m WHERE NOT EXISTS "
                               "(SELECT 1 FROM memory_fts f WHERE f.rowid = m.num)")

_COUNTS = {"rows": _COUNT_ROWS, "text_rows": _COUNT_TEXT_ROWS, "rows_without_text": _ROWS_WITHOUT_TEXT,
           "orphan_vectors": _ORPHAN_VECTORS, "unembedded": COUNT_UNEMBEDDED, "miscounted_vectors": _MISCOUNTED_VECTORS}


def rebuild(tx: Tx, batch: int, progress: Callable[[int, int], None] | None) -> int:
    """Rebuild the text index and the vector counts; returns how many rows the index holds.
    `progress(done, total)` is called before the first row and after every `batch` rows."""
    for statement in (_CLEAR_TEXT, _DELETE_ORPHAN_VECTORS, _CLEAR_VECTOR_HEADS, _COUNT_VECTOR_HEADS):
        tx.execute(statement)
    total = tx.execute(_COUNT_ROWS).fetchone()[0]
    if progress is not None:
        progress(0, total)
    done = last = 0
    while rows := tx.execute(_ROWS_AFTER, {"after": last, "limit": batch}).fetchall():
        for num, identity, content, created_at, context in rows:
            write_text_row(tx, num, identity, content, created_at, Context.from_json(context))
        done, last = done + len(rows), rows[-1][0]
        if progress is not None:
            progress(done, total)
    return done


def counts(tx: Tx) -> dict[str, int]:
    """Rows against text index rows, vectors without a row, memories waiting for a vector, and
    the identities whose vectors are miscounted."""
    return {name: tx.execute(statement).fetchone()[0] for name, statement in _COUNTS.items()}


def delete_memory(tx: Tx, num: int, identity: str, memory_id: str) -> None:
    """The memory's row, its text index row and its vector; what it superseded no longer points at it."""
    tx.execute(DELETE_TEXT, {"num": num})
    tx.execute(DELETE_VECTOR, {"num": num})
    tx.execute(_UNLINK, {"owner": identity, "memory_id": memory_id})
    tx.execute(_DELETE, {"num": num})


def delete_of_sessions(tx: Tx, keys: Sequence[str]) -> int:
    """Every memory, of any identity, made of the sessions `keys` or kept in them with the remember
    tool, deleted; how many."""
    rows = tx.execute(_OF_SESSIONS, {"keys": json.dumps(list(keys)),
                                     "sources": json.dumps([remembered_in(key) for key in keys])}).fetchall()
    for num, identity, memory_id in rows:
        delete_memory(tx, num, identity, memory_id)
    return len(rows)
