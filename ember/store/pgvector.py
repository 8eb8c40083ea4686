"""Vectors as PostgreSQL's pgvector holds them, beside the float32 blobs both engines keep: how one
is written, and how the vectors kept only as blobs (a store migrated or copied from SQLite) are
made pgvector's."""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING

from sqlalchemy import text

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

# A parameter `:name` given as a list of floats (asyncpg sends it as float8[]).
AS_VECTOR = "CAST(CAST(:{} AS float8[]) AS vector)"
PUT_EMBEDDINGS = (f"UPDATE memory_vectors SET embedding = {AS_VECTOR.format('own')}, "
                  f"window_embedding = {AS_VECTOR.format('around')} WHERE num = :num")
FILL_BATCH = 1_000
_UNFILLED = text('SELECT num, vector, "window" FROM memory_vectors WHERE embedding IS NULL AND num > :after '
                 "ORDER BY num LIMIT :limit")


def _floats(blob: bytes | None) -> list[float] | None:
    """A float32 blob's values, or None where it holds none pgvector would take (NaN, a torn blob)."""
    if not blob or len(blob) % 4:
        return None
    values = array("f", blob).tolist()
    return values if all(map(math.isfinite, values)) else None


def embeddings_of(num: int, blob: bytes, window: bytes | None) -> dict[str, object]:
    """PUT_EMBEDDINGS's parameters for one memory's blobs. A vector that cannot be read, or a window
    of another size than it, leaves both none: read as unreadable (store/vector_rows.py), it is set
    aside and embedded again."""
    own, around = _floats(blob), _floats(window)
    if own is None or (window is not None and (around is None or len(around) != len(own))):
        return {"num": num, "own": None, "around": None}
    return {"num": num, "own": own, "around": around}


async def fill_embeddings(conn: AsyncConnection) -> int:
    """On PostgreSQL, pgvector's form of every vector kept only as a blob; returns how many. Nothing
    on SQLite."""
    if conn.dialect.name != "postgresql":
        return 0
    filled, after = 0, 0
    while rows := (await conn.execute(_UNFILLED, {"after": after, "limit": FILL_BATCH})).fetchall():
        await conn.execute(text(PUT_EMBEDDINGS), [embeddings_of(*row) for row in rows])
        filled, after = filled + len(rows), rows[-1][0]
    return filled
