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

from sqlalchemy import Integer, bindparam, func, select
from sqlalchemy.sql import ColumnElement

from ember.core.redact import redact, redact_text
from ember.core.traces import TurnTrace
from ember.store import schema
from ember.store.engine import Database
from ember.store.records import turn_trace
from ember.store.tx import Statement, Tx, upsert_row

_t = schema.traces
# A resumed or retried turn keeps its id: its latest run is the trace.
_RECORD = upsert_row(_t, ["turn_id"])
_ONE = Statement(select(_t).where(_t.c.turn_id == bindparam("turn_id")))
_OF_SESSION = Statement(select(_t).where(_t.c.session_key == bindparam("session_key")).order_by(_t.c.started_at))
_LIMIT = bindparam("limit", type_=Integer)


def _starts_with_prefix(column: ColumnElement[str]) -> ColumnElement[bool]:
    # Not LIKE: SQLite's LIKE ignores case, and "Alice" must not see "alice"'s turns.
    return func.substr(column, 1, bindparam("prefix_chars", type_=Integer)) == bindparam("prefix")


_LATEST = select(_t).where(_starts_with_prefix(_t.c.session_key)).order_by(_t.c.started_at.desc()).limit(_LIMIT)
_RECENT = Statement(_LATEST)
_RECENT_OF_SESSION = Statement(_LATEST.where(_t.c.session_key == bindparam("session_key")))
_IDS = Statement(select(_t.c.turn_id).where(_starts_with_prefix(_t.c.turn_id)).limit(_LIMIT))


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
        row = await self._db.run_read(lambda tx: tx.execute(_ONE, {"turn_id": turn_id}).fetchone())
        return None if row is None else turn_trace(row)

    async def for_session(self, session_key: str) -> list[TurnTrace]:
        await self.flush()
        rows = await self._db.run_read(lambda tx: tx.execute(_OF_SESSION, {"session_key": session_key}).fetchall())
        return [turn_trace(row) for row in rows]

    async def recent(self, limit: int, session_key: str | None = None, *, prefix: str = "") -> list[TurnTrace]:
        """The latest turns, newest first: of one session, and/or of the sessions whose key starts with `prefix`."""
        await self.flush()
        params: dict[str, Any] = {"limit": limit, "prefix": prefix, "prefix_chars": len(prefix)}
        statement = _RECENT
        if session_key is not None:
            statement, params["session_key"] = _RECENT_OF_SESSION, session_key
        return [turn_trace(row) for row in await self._db.run_read(lambda tx: tx.execute(statement, params).fetchall())]

    async def turn_ids(self, prefix: str, limit: int = 5) -> list[str]:
        """The turn ids that start with `prefix` (a whole id included), at most `limit`."""
        await self.flush()
        params = {"prefix": prefix, "prefix_chars": len(prefix), "limit": limit}
        return [row[0] for row in await self._db.run_read(lambda tx: tx.execute(_IDS, params).fetchall())]

