"""Memory rows: episodic summaries, reviewed facts and skill notes."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import func, insert, select, update

from ember.store import schema
from ember.store.database import Database


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
        """Newest first; `session_key=None` means memories of any session."""
        m = schema.memories
        query = select(m).where(m.c.kind.in_(kinds))
        if session_key is not None:
            query = query.where(m.c.session_key == session_key)
        async with self._db.read() as conn:
            rows = (await conn.execute(query.order_by(m.c.created_at.desc()).limit(limit))).all()
        return [MemoryRecord(r.id, r.session_key, r.kind, r.content, r.created_at) for r in rows]

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
