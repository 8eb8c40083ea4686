"""Model usage rows: written in batches, summed by session, identity, job kind or model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import bindparam, func, insert, select

from ember.core.memory import session_identity
from ember.core.usage import UsageCell, UsageRow
from ember.store import schema
from ember.store.engine import Database
from ember.store.records import usage_totals
from ember.store.tx import Statement, Tx

UsageGrouping = Literal["session", "identity", "job", "model", "agent"]
_GROUP_COLUMN = {"session": "COALESCE(session_key, '-')", "identity": "COALESCE(identity, '-')",
                 "job": "COALESCE(job_kind, 'turn')", "model": "model", "agent": "COALESCE(agent, '-')"}

_u, _s = schema.model_usage, schema.sessions
_OWNER = Statement(select(_s.c.metadata_json).where(_s.c.key == bindparam("key")))
_INSERT = Statement(insert(_u).values({c: bindparam(c.name) for c in _u.c if c.name != "id"}))
_TOTALS = {by: Statement(
    f"SELECT {key} AS k, COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cache_read_tokens), "
    "SUM(cache_write_tokens), COALESCE(SUM(cost_usd), 0), SUM(CASE WHEN cost_usd IS NULL THEN 1 ELSE 0 END) "
    "FROM model_usage WHERE at >= :since GROUP BY k ORDER BY 7 DESC, 3 + 4 DESC, k")
    for by, key in _GROUP_COLUMN.items()}
_SUMS = ("COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cache_read_tokens), SUM(cache_write_tokens), "
         "COALESCE(SUM(cost_usd), 0), SUM(CASE WHEN cost_usd IS NULL THEN 1 ELSE 0 END)")
_WHERE_OWN = "FROM model_usage WHERE identity = :identity AND at >= :since GROUP BY 1, 2"
_BY_DAY_AND_SESSION = Statement(  # CAST truncates, a floor for the times after 1970 a row has
    f"SELECT CAST((at + :shift) / 86400 AS INTEGER), session_key, {_SUMS} {_WHERE_OWN}",
    postgresql=f"SELECT CAST(FLOOR((at + :shift) / 86400) AS BIGINT), session_key, {_SUMS} {_WHERE_OWN}")
_SPENT = Statement(select(func.coalesce(func.sum(_u.c.cost_usd), 0))
                   .where(_u.c.identity == bindparam("identity"), _u.c.at >= bindparam("since")))
_SPENT_BY_AGENT = Statement(select(func.coalesce(func.sum(_u.c.cost_usd), 0))
                            .where(_u.c.agent == bindparam("agent"), _u.c.at >= bindparam("since")))


class SqlUsageStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def record(self, rows: Sequence[UsageRow]) -> None:
        """One transaction for the batch. A call charged to a session but to no identity
        (a background job's) is charged to the session's identity."""
        def write(tx: Tx) -> None:
            owners: dict[str, str] = {}
            for row in rows:
                scope = row.scope
                identity = scope.identity
                if identity is None and scope.session_key is not None:
                    if scope.session_key not in owners:
                        found = tx.execute(_OWNER, {"key": scope.session_key}).fetchone()
                        owners[scope.session_key] = session_identity(scope.session_key,
                                                                     json.loads(found[0]) if found else {})
                    identity = owners[scope.session_key]
                tx.execute(_INSERT, {
                    "at": row.at, "model": row.model, "session_key": scope.session_key, "identity": identity,
                    "turn_id": scope.turn_id, "job_kind": scope.job_kind, "input_tokens": row.input_tokens,
                    "output_tokens": row.output_tokens, "cache_read_tokens": row.cache_read_tokens,
                    "cache_write_tokens": row.cache_write_tokens, "cost_usd": row.cost_usd, "agent": scope.agent})

        if rows:
            await self._db.run_write(write)

    async def totals(self, by: UsageGrouping, since: float = 0.0) -> list[dict[str, Any]]:
        """Per group, costliest first: calls, tokens of each kind, cost of the priced calls,
        and how many calls had no price."""
        rows = await self._db.run_read(lambda tx: tx.execute(_TOTALS[by], {"since": since}).fetchall())
        return usage_totals(rows)

    async def by_day_and_session(self, identity: str, since: float, shift_s: int) -> list[UsageCell]:
        """The identity's calls since `since`, summed per day and session; a day runs from midnight
        in the time zone `shift_s` seconds ahead of UTC."""
        params = {"identity": identity, "since": since, "shift": float(shift_s)}
        rows = await self._db.run_read(lambda tx: tx.execute(_BY_DAY_AND_SESSION, params).fetchall())
        # int(): PostgreSQL sums BIGINT columns as NUMERIC, which arrives as a Decimal.
        return [UsageCell(int(day), key, calls, int(i), int(o), int(cr), int(cw), float(cost), int(unpriced))
                for day, key, calls, i, o, cr, cw, cost, unpriced in rows]

    async def spent(self, identity: str, since: float) -> float:
        """USD the identity's priced calls cost since `since`."""
        return await self._db.run_read(lambda tx: tx.execute(
            _SPENT, {"identity": identity, "since": since}).fetchone()[0])

    async def spent_by_agent(self, agent: str, since: float) -> float:
        """USD the named agent's priced calls cost since `since`, whoever they were for."""
        return await self._db.run_read(lambda tx: tx.execute(
            _SPENT_BY_AGENT, {"agent": agent, "since": since}).fetchone()[0])
