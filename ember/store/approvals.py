"""Approval requests as rows: pending while a turn waits, then how each ended.

The waiting itself is in memory (runtime/approvals.py); the row is what lets
an answer that comes too late, or after a restart, be told "expired" rather
than "unknown".
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass

from ember.store.database import Database

PENDING, EXPIRED = "pending", "expired"


@dataclass(frozen=True, slots=True)
class ApprovalRow:
    id: str
    session_key: str
    identity: str
    status: str  # pending | approve_once | approve_session | deny | expired
    decided_by: str | None


class SqlApprovalStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def opened(self, approval_id: str, session_key: str, turn_id: str, identity: str, tool: str,
                     summary: str) -> None:
        await self._db.run_write(lambda conn: conn.execute(
            "INSERT INTO approvals (id, session_key, turn_id, identity, tool, summary, status, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (approval_id, session_key, turn_id, identity, tool, summary[:500], PENDING, time.time())))

    async def closed(self, approval_id: str, status: str, decided_by: str) -> None:
        await self._db.run_write(lambda conn: conn.execute(
            "UPDATE approvals SET status = ?, decided_by = ?, decided_at = ? WHERE id = ? AND status = ?",
            (status, decided_by, time.time(), approval_id, PENDING)))

    async def get(self, approval_id: str) -> ApprovalRow | None:
        row = await self._db.run_read(lambda conn: conn.execute(
            "SELECT id, session_key, identity, status, decided_by FROM approvals WHERE id = ?",
            (approval_id,)).fetchone())
        return ApprovalRow(*row) if row else None

    async def expire_pending(self) -> int:
        """At start: the requests a stopped process was waiting on can no longer be answered."""
        def expire(conn: sqlite3.Connection) -> int:
            return conn.execute("UPDATE approvals SET status = ?, decided_by = 'restart', decided_at = ? "
                                "WHERE status = ?", (EXPIRED, time.time(), PENDING)).rowcount

        return await self._db.run_write(expire)
