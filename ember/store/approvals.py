"""Approval requests as rows: pending while a turn waits, then how each ended.

The waiting itself is in memory (runtime/approvals.py); the row is what lets
an answer that comes too late be told "expired" rather than "unknown", what
carries an answer given to one process (a gateway) to the turn waiting in
another (a worker), and what a turn resumed after a restart finds again, asked
or already answered: the first to close a row decides.
"""

from __future__ import annotations

import time

from sqlalchemy import bindparam, insert, select, update

from ember.core.approvals import ApprovalRow, ApprovalStatus, AskedBefore
from ember.store import schema
from ember.store.engine import Database
from ember.store.tx import Statement, upsert

PENDING, EXPIRED = ApprovalStatus.PENDING.value, ApprovalStatus.EXPIRED.value  # plain strings: inlined as SQL literals
_a = schema.approvals
_OPEN = Statement(insert(_a).values(
    id=bindparam("id"), session_key=bindparam("session_key"), turn_id=bindparam("turn_id"),
    identity=bindparam("identity"), tool=bindparam("tool"), summary=bindparam("summary"), status=PENDING,
    created_at=bindparam("now"), request_json=bindparam("request_json")))
_PENDING = Statement(select(_a.c.request_json).where(_a.c.status == PENDING, _a.c.created_at >= bindparam("since"),
                                                      _a.c.request_json.is_not(None))
                     .order_by(_a.c.created_at))
_CLOSE = Statement(update(_a).where(_a.c.id == bindparam("approval"), _a.c.status == PENDING).values(
    status=bindparam("status"), decided_by=bindparam("decided_by"), decided_at=bindparam("now")))
_GET = Statement(select(_a.c.id, _a.c.session_key, _a.c.identity, _a.c.status, _a.c.decided_by)
                 .where(_a.c.id == bindparam("id")))
_g = schema.session_grants
_GRANT = upsert(lambda ins: ins(_g).values(session_key=bindparam("key"), tool=bindparam("tool"),
                                          granted_at=bindparam("now"))
                .on_conflict_do_nothing(index_elements=["session_key", "tool"]))
_GRANTED = Statement(select(_g.c.tool).where(_g.c.session_key == bindparam("key"), _g.c.tool == bindparam("tool")))
_ASKED = Statement(select(_a.c.id, _a.c.status, _a.c.decided_by, _a.c.created_at)
                   .where(_a.c.turn_id == bindparam("turn_id"), _a.c.tool == bindparam("tool"),
                          _a.c.summary == bindparam("summary"), _a.c.created_at >= bindparam("since"))
                   .order_by(_a.c.created_at))
_EXPIRE_TURN = Statement(update(_a).where(_a.c.turn_id == bindparam("turn"), _a.c.status == PENDING)
                         .values(status=EXPIRED, decided_by=bindparam("decided_by"), decided_at=bindparam("now")))
_EXPIRE = Statement(update(_a).where(_a.c.status == PENDING, _a.c.created_at < bindparam("before"))
                    .values(status=EXPIRED, decided_by="restart", decided_at=bindparam("now")))


class SqlApprovalStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def opened(self, approval_id: str, session_key: str, turn_id: str, identity: str, tool: str,
                     summary: str, request_json: str | None = None) -> None:
        row = {"id": approval_id, "session_key": session_key, "turn_id": turn_id, "identity": identity,
               "tool": tool, "summary": summary[:500], "now": time.time(), "request_json": request_json}
        await self._db.run_write(lambda tx: tx.execute(_OPEN, row))

    async def closed(self, approval_id: str, status: str, decided_by: str) -> bool:
        """Record how a pending request ended; False when it had already ended otherwise."""
        params = {"approval": approval_id, "status": status, "decided_by": decided_by, "now": time.time()}
        return await self._db.run_write(lambda tx: tx.execute(_CLOSE, params).rowcount == 1)

    async def pending_requests(self, since: float) -> list[str]:
        """The kept requests still pending that were opened at `since` or later, oldest first."""
        return [row[0] for row in await self._db.run_read(
            lambda tx: tx.execute(_PENDING, {"since": since}).fetchall())]

    async def get(self, approval_id: str) -> ApprovalRow | None:
        row = await self._db.run_read(lambda tx: tx.execute(_GET, {"id": approval_id}).fetchone())
        if row is None:
            return None
        id_, session_key, identity, status, decided_by = row
        return ApprovalRow(id_, session_key, identity, ApprovalStatus(status), decided_by)

    async def asked_before(self, turn_id: str, tool: str, summary: str, *, since: float) -> list[AskedBefore]:
        """The requests `turn_id` made for this call (its tool and summary) from `since` on, oldest first."""
        params = {"turn_id": turn_id, "tool": tool, "summary": summary[:500], "since": since}
        return [AskedBefore(id_, ApprovalStatus(status), decided_by, created_at)
                for id_, status, decided_by, created_at in await self._db.run_read(
                    lambda tx: tx.execute(_ASKED, params).fetchall())]

    async def expire_turn(self, turn_id: str, decided_by: str) -> int:
        """The turn ended without its pending requests answered: they can no longer be."""
        params = {"turn": turn_id, "decided_by": decided_by, "now": time.time()}
        return await self._db.run_write(lambda tx: tx.execute(_EXPIRE_TURN, params).rowcount)

    async def expire_pending(self, *, older_than_s: float = 0.0) -> int:
        """At start: the requests a stopped process was waiting on can no longer be answered. On a
        store other live processes share, only those older than their timeout (`older_than_s`)."""
        now = time.time()
        return await self._db.run_write(lambda tx: tx.execute(
            _EXPIRE, {"now": now, "before": now - older_than_s}).rowcount)

    async def grant(self, session_key: str, tool: str) -> None:
        """The person allowed `tool` for the rest of the session."""
        params = {"key": session_key, "tool": tool, "now": time.time()}
        await self._db.run_write(lambda tx: tx.execute(_GRANT, params))

    async def granted(self, session_key: str, tool: str) -> bool:
        params = {"key": session_key, "tool": tool}
        return await self._db.run_read(lambda tx: tx.execute(_GRANTED, params).fetchone() is not None)
