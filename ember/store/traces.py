"""One trace row per turn: how it ended, and what it did."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row, func, select

from ember.store import schema
from ember.store.engine import Database
from ember.store.tx import Tx, upsert_row

_t = schema.traces
# A resumed or retried turn keeps its id: its latest run is the trace.
_RECORD = upsert_row(_t, ["turn_id"])


@dataclass(slots=True, kw_only=True)
class TurnTrace:
    turn_id: str
    session_key: str
    started_at: float
    finished_at: float = 0.0
    status: str = "running"
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class SqlTraceStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def record(self, trace: TurnTrace) -> None:
        row = {"turn_id": trace.turn_id, "session_key": trace.session_key, "status": trace.status,
               "error": trace.error, "detail": json.dumps(trace.detail), "started_at": trace.started_at,
               "finished_at": trace.finished_at}

        def write(tx: Tx) -> None:
            tx.execute(_RECORD, row)

        await self._db.run_write(write)

    async def get(self, turn_id: str) -> TurnTrace | None:
        t = schema.traces
        async with self._db.read() as conn:
            row = (await conn.execute(select(t).where(t.c.turn_id == turn_id))).first()
        return None if row is None else _trace(row)

    async def for_session(self, session_key: str) -> list[TurnTrace]:
        t = schema.traces
        query = select(t).where(t.c.session_key == session_key).order_by(t.c.started_at)
        async with self._db.read() as conn:
            return [_trace(row) for row in (await conn.execute(query)).all()]

    async def recent(self, limit: int, session_key: str | None = None, *, prefix: str = "") -> list[TurnTrace]:
        """The latest turns, newest first: of one session, and/or of the sessions whose key starts with `prefix`."""
        t = schema.traces
        query = select(t).order_by(t.c.started_at.desc()).limit(limit)
        if session_key is not None:
            query = query.where(t.c.session_key == session_key)
        if prefix:
            # Not LIKE: SQLite's LIKE ignores case, and "Alice" must not see "alice"'s turns.
            query = query.where(func.substr(t.c.session_key, 1, len(prefix)) == prefix)
        async with self._db.read() as conn:
            return [_trace(row) for row in (await conn.execute(query)).all()]


    async def turn_ids(self, prefix: str, limit: int = 5) -> list[str]:
        """The turn ids that start with `prefix` (a whole id included), at most `limit`."""
        t = schema.traces
        query = select(t.c.turn_id).where(t.c.turn_id.startswith(prefix, autoescape=True)).limit(limit)
        async with self._db.read() as conn:
            return list((await conn.execute(query)).scalars())


def _trace(row: Row[Any]) -> TurnTrace:
    return TurnTrace(
        turn_id=row.turn_id, session_key=row.session_key, started_at=row.started_at,
        finished_at=row.finished_at, status=row.status, error=row.error, detail=json.loads(row.detail),
    )
