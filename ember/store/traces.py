"""One trace row per turn: how it ended, and what it did.

Written behind: `record` keeps the trace in memory, and `flush` writes every
trace kept so far in one transaction (the agent loop flushes every second,
and at its stop), so a turn never waits for its trace, and many turns share
one commit. A crash loses at most the traces since the last flush; the turns
themselves are committed as ever. Every read here flushes first: this process
reads every trace it recorded.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Row, func, select

from ember.core.redact import redact, redact_text
from ember.core.traces import TurnTrace
from ember.store import schema
from ember.store.engine import Database
from ember.store.tx import Tx, upsert_row

_t = schema.traces
# A resumed or retried turn keeps its id: its latest run is the trace.
_RECORD = upsert_row(_t, ["turn_id"])


class SqlTraceStore:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._pending: list[dict[str, Any]] = []

    async def record(self, trace: TurnTrace) -> None:
        """Kept until the next `flush`, as it is now, redacted: whoever filled it in, a trace never
        holds a secret. Its detail by look only: its field names are counts ("input_tokens")."""
        error = None if trace.error is None else redact_text(trace.error)
        self._pending.append({
            "turn_id": trace.turn_id, "session_key": trace.session_key, "status": trace.status,
            "error": error, "detail": json.dumps(redact(trace.detail, by_name=False)), "started_at": trace.started_at,
            "finished_at": trace.finished_at})

    async def flush(self) -> None:
        """Write the traces kept so far, in one transaction (a resumed turn's latest run wins);
        on failure they are kept for the next flush."""
        rows, self._pending = self._pending, []
        if not rows:
            return

        latest = list({row["turn_id"]: row for row in rows}.values())  # one row per turn: its latest run

        def write(tx: Tx) -> None:
            tx.executemany(_RECORD, latest)

        try:
            await self._db.run_write(write)
        except BaseException:
            self._pending[:0] = rows
            raise

    async def get(self, turn_id: str) -> TurnTrace | None:
        await self.flush()
        t = schema.traces
        async with self._db.read() as conn:
            row = (await conn.execute(select(t).where(t.c.turn_id == turn_id))).first()
        return None if row is None else _trace(row)

    async def for_session(self, session_key: str) -> list[TurnTrace]:
        await self.flush()
        t = schema.traces
        query = select(t).where(t.c.session_key == session_key).order_by(t.c.started_at)
        async with self._db.read() as conn:
            return [_trace(row) for row in (await conn.execute(query)).all()]

    async def recent(self, limit: int, session_key: str | None = None, *, prefix: str = "") -> list[TurnTrace]:
        """The latest turns, newest first: of one session, and/or of the sessions whose key starts with `prefix`."""
        await self.flush()
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
        await self.flush()
        t = schema.traces
        query = select(t.c.turn_id).where(t.c.turn_id.startswith(prefix, autoescape=True)).limit(limit)
        async with self._db.read() as conn:
            return list((await conn.execute(query)).scalars())


def _trace(row: Row[Any]) -> TurnTrace:
    return TurnTrace(
        turn_id=row.turn_id, session_key=row.session_key, started_at=row.started_at,
        finished_at=row.finished_at, status=row.status, error=row.error, detail=json.loads(row.detail),
    )
