"""Durable background jobs: rows that survive a restart (I6).

At most one pending job exists per (kind, dedupe_key); enqueueing a duplicate
is a no-op. A job is claimed by compare-and-set from `pending` to `running`,
so two runners never execute it twice.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from ember.store import schema
from ember.store.database import Database

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    kind: str
    dedupe_key: str
    session_key: str | None
    payload: dict[str, Any]
    attempts: int


class SqlJobStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def enqueue(self, kind: str, dedupe_key: str, *, session_key: str | None = None,
                      payload: dict[str, Any] | None = None, delay_s: float = 0.0) -> bool:
        """True when a new job was queued, False when an equal one was already pending."""
        now = time.time()
        statement = (
            sqlite_insert(schema.jobs)
            .values(
                id=uuid.uuid4().hex, kind=kind, dedupe_key=dedupe_key, session_key=session_key,
                payload=json.dumps(payload or {}), status=PENDING, attempts=0,
                next_run_at=now + delay_s, created_at=now, updated_at=now,
            )
            .on_conflict_do_nothing(
                index_elements=["kind", "dedupe_key"], index_where=schema.jobs.c.status == PENDING
            )
        )
        async with self._db.write() as conn:
            return (await conn.execute(statement)).rowcount == 1

    async def claim_due(self, limit: int) -> list[Job]:
        """Move up to `limit` due jobs to running and return them."""
        j = schema.jobs
        now = time.time()
        async with self._db.write() as conn:
            rows = (
                await conn.execute(
                    select(j).where(j.c.status == PENDING, j.c.next_run_at <= now).order_by(j.c.next_run_at).limit(limit)
                )
            ).all()
            claimed = []
            for row in rows:
                done = await conn.execute(
                    update(j).where(j.c.id == row.id, j.c.status == PENDING).values(status=RUNNING, updated_at=now)
                )
                if done.rowcount == 1:
                    claimed.append(Job(row.id, row.kind, row.dedupe_key, row.session_key, json.loads(row.payload), row.attempts))
        return claimed

    async def complete(self, job: Job) -> None:
        await self._finish(job, status=DONE, attempts=job.attempts + 1, error=None, next_run_at=None)

    async def fail(self, job: Job, error: str, *, retry_in_s: float | None) -> None:
        """Record a failed attempt; retried after `retry_in_s`, or given up when None.

        A retry only goes back to pending if no newer pending job of the same
        kind and key exists (that one covers the work); otherwise it is dropped.
        """
        if retry_in_s is None:
            await self._finish(job, status=FAILED, attempts=job.attempts + 1, error=error, next_run_at=None)
            return
        j = schema.jobs
        now = time.time()
        async with self._db.write() as conn:
            newer = await conn.execute(
                select(j.c.id).where(j.c.kind == job.kind, j.c.dedupe_key == job.dedupe_key, j.c.status == PENDING)
            )
            status = DONE if newer.first() is not None else PENDING
            await conn.execute(
                update(j).where(j.c.id == job.id).values(
                    status=status, attempts=job.attempts + 1, last_error=error,
                    next_run_at=now + retry_in_s, updated_at=now,
                )
            )

    async def requeue_interrupted(self) -> int:
        """At start-up: jobs left running by a crash go back to pending (or are
        dropped when an equal pending job already covers them)."""
        j = schema.jobs
        now = time.time()
        async with self._db.write() as conn:
            rows = (await conn.execute(select(j.c.id, j.c.kind, j.c.dedupe_key).where(j.c.status == RUNNING))).all()
            for row in rows:
                covered = await conn.execute(
                    select(j.c.id).where(and_(j.c.kind == row.kind, j.c.dedupe_key == row.dedupe_key, j.c.status == PENDING))
                )
                status = DONE if covered.first() is not None else PENDING
                await conn.execute(update(j).where(j.c.id == row.id).values(status=status, next_run_at=now, updated_at=now))
        return len(rows)

    async def next_due_at(self) -> float | None:
        j = schema.jobs
        async with self._db.read() as conn:
            return (await conn.execute(select(func.min(j.c.next_run_at)).where(j.c.status == PENDING))).scalar()

    async def counts(self) -> dict[str, int]:
        j = schema.jobs
        async with self._db.read() as conn:
            rows = (await conn.execute(select(j.c.status, func.count()).group_by(j.c.status))).all()
        return {status: count for status, count in rows}

    async def _finish(self, job: Job, *, status: str, attempts: int, error: str | None, next_run_at: float | None) -> None:
        j = schema.jobs
        now = time.time()
        values: dict[str, Any] = {"status": status, "attempts": attempts, "last_error": error, "updated_at": now}
        if next_run_at is not None:
            values["next_run_at"] = next_run_at
        async with self._db.write() as conn:
            await conn.execute(update(j).where(j.c.id == job.id).values(**values))
