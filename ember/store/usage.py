"""Model usage rows: written in batches, summed by session, identity, job kind or model."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any, Literal

from ember.core.memory import session_identity
from ember.core.usage import UsageRow
from ember.store.database import Database

UsageGrouping = Literal["session", "identity", "job", "model"]
_GROUP_COLUMN = {"session": "COALESCE(session_key, '-')", "identity": "COALESCE(identity, '-')",
                 "job": "COALESCE(job_kind, 'turn')", "model": "model"}
_INSERT = ("INSERT INTO model_usage (at, model, session_key, identity, turn_id, job_kind, input_tokens, "
           "output_tokens, cache_read_tokens, cache_write_tokens, cost_usd) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


class SqlUsageStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def record(self, rows: Sequence[UsageRow]) -> None:
        """One transaction for the batch. A call charged to a session but to no identity
        (a background job's) is charged to the session's identity."""
        def write(conn: sqlite3.Connection) -> None:
            owners: dict[str, str] = {}
            for row in rows:
                scope = row.scope
                identity = scope.identity
                if identity is None and scope.session_key is not None:
                    if scope.session_key not in owners:
                        found = conn.execute("SELECT metadata_json FROM sessions WHERE key = ?",
                                             (scope.session_key,)).fetchone()
                        owners[scope.session_key] = session_identity(scope.session_key,
                                                                     json.loads(found[0]) if found else {})
                    identity = owners[scope.session_key]
                conn.execute(_INSERT, (row.at, row.model, scope.session_key, identity, scope.turn_id, scope.job_kind,
                                       row.input_tokens, row.output_tokens, row.cache_read_tokens,
                                       row.cache_write_tokens, row.cost_usd))

        if rows:
            await self._db.run_write(write)

    async def totals(self, by: UsageGrouping, since: float = 0.0) -> list[dict[str, Any]]:
        """Per group, costliest first: calls, tokens of each kind, cost of the priced calls,
        and how many calls had no price."""
        key = _GROUP_COLUMN[by]
        sql = (f"SELECT {key} AS k, COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cache_read_tokens), "
               "SUM(cache_write_tokens), COALESCE(SUM(cost_usd), 0), SUM(cost_usd IS NULL) FROM model_usage "
               "WHERE at >= ? GROUP BY k ORDER BY 7 DESC, 3 + 4 DESC, k")
        rows = await self._db.run_read(lambda conn: conn.execute(sql, (since,)).fetchall())
        return [{"key": k, "calls": calls, "input_tokens": i, "output_tokens": o, "cache_read_tokens": cr,
                 "cache_write_tokens": cw, "cost_usd": round(cost, 6), "unpriced_calls": unpriced}
                for k, calls, i, o, cr, cw, cost, unpriced in rows]

    async def spent(self, identity: str, since: float) -> float:
        """USD the identity's priced calls cost since `since`."""
        return await self._db.run_read(lambda conn: conn.execute(
            "SELECT COALESCE(SUM(cost_usd), 0) FROM model_usage WHERE identity = ? AND at >= ?",
            (identity, since)).fetchone()[0])
