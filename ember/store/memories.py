"""Memory rows: episodic summaries, reviewed facts and skill notes."""

from __future__ import annotations

import functools
import json
import sqlite3
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import bindparam, func, insert, select, update

from ember.store import schema
from ember.store.database import Database
from ember.store.direct import compiled


@dataclass(frozen=True, slots=True)
class MemoryRecord:
    id: str
    session_key: str | None
    kind: str
    content: str
    created_at: float


class SqlMemoryStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def add_new(self, kind: str, contents: list[str], *, session_key: str) -> int:
        """Insert the contents this session does not already have, in one transaction."""
        m = schema.memories
        now = time.time()
        async with self._db.write() as conn:
            known = set((await conn.execute(
                select(m.c.content).where(m.c.session_key == session_key, m.c.kind == kind, m.c.content.in_(contents))
            )).scalars())
            new = list(dict.fromkeys(c for c in contents if c not in known))
            if new:
                await conn.execute(insert(m), [
                    {"id": uuid.uuid4().hex, "session_key": session_key, "kind": kind, "content": c, "created_at": now}
                    for c in new
                ])
        return len(new)

    async def recent(self, session_key: str | None, kinds: tuple[str, ...], limit: int) -> list[MemoryRecord]:
        """Newest first; `session_key=None` means memories of any session.

        A turn's memory snapshot reads these: on the one-hop reader, so a burst
        of new sessions does not queue for the engine's few pooled connections.
        """
        sql = _recent_sql(len(kinds), session_key is not None)
        params = {"session_key": session_key, "limit": limit, **{f"kind{i}": kind for i, kind in enumerate(kinds)}}

        def read(conn: sqlite3.Connection) -> list[MemoryRecord]:
            return [MemoryRecord(*row) for row in conn.execute(sql, params)]

        return await self._db.run_read(read)

    async def without_embedding(self, limit: int) -> list[MemoryRecord]:
        m = schema.memories
        async with self._db.read() as conn:
            rows = (await conn.execute(select(m).where(m.c.embedding.is_(None)).limit(limit))).all()
        return [MemoryRecord(r.id, r.session_key, r.kind, r.content, r.created_at) for r in rows]

    async def count_without_embedding(self) -> int:
        m = schema.memories
        async with self._db.read() as conn:
            return (await conn.execute(select(func.count()).where(m.c.embedding.is_(None)))).scalar_one()

    async def set_embeddings(self, vectors: dict[str, list[float]]) -> None:
        m = schema.memories
        async with self._db.write() as conn:
            for memory_id, vector in vectors.items():
                await conn.execute(update(m).where(m.c.id == memory_id).values(embedding=json.dumps(vector)))


@functools.cache
def _recent_sql(kinds: int, of_session: bool) -> str:
    m = schema.memories
    query = select(m.c.id, m.c.session_key, m.c.kind, m.c.content, m.c.created_at).where(
        m.c.kind.in_([bindparam(f"kind{i}") for i in range(kinds)]))
    if of_session:
        query = query.where(m.c.session_key == bindparam("session_key"))
    return compiled(query.order_by(m.c.created_at.desc()).limit(bindparam("limit")))
