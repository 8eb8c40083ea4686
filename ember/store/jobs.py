"""Durable background jobs: rows that survive a restart (I6).

At most one pending job exists per (kind, dedupe_key); enqueueing a duplicate
is a no-op. A job is claimed by compare-and-set from `pending` to `running`,
so two runners never execute it twice.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from ember.store import schema
from ember.store.database import Database

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
# A job that would have been retried while an equal one was already pending:
# the pending one covers its work.
SUPERSEDED = "superseded"


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    kind: str
    dedupe_key: str
    session_key: str | None
    attempts: int


class SqlJobStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def enqueue(self, kind: str, dedupe_key: str, *, session_key: str | None = None) -> bool:
        """True when a new job was queued, False when an equal one was already pending."""
        now = time.time()
        statement = (
            sqlite_insert(schema.jobs)
            .values(
                id=uuid.uuid4().hex, kind=kind, dedupe_key=dedupe_key, session_key=session_key,
                status=PENDING, attempts=0, next_run_at=now, created_at=now, updated_at=now,
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
        due = select(j).where(j.c.status == PENDING, j.c.next_run_at <= now).order_by(j.c.next_run_at).limit(limit)
        async with self._db.write() as conn:
            rows = (await conn.execute(due)).all()
            claimed = []
            for row in rows:
                done = await conn.execute(
                    update(j).where(j.c.id == row.id, j.c.status == PENDING).values(status=RUNNING, updated_at=now)
                )
                if done.rowcount == 1:
                    claimed.append(Job(row.id, row.kind, row.dedupe_key, row.session_key, row.attempts))
        return claimed

    async def complete(self, job: Job) -> None:
        await self._set(job.id, status=DONE, attempts=job.attempts + 1, last_error=None)

    async def fail(self, job: Job, error: str, *, retry_in_s: float | None) -> None:
        """Record a failed attempt: retried after `retry_in_s`, or given up when None."""
        if retry_in_s is None:
            await self._set(job.id, status=FAILED, attempts=job.attempts + 1, last_error=error)
            return
        async with self._db.write() as conn:
            await self._requeue(conn, job.id, job.kind, job.dedupe_key, delay_s=retry_in_s,
                                attempts=job.attempts + 1, last_error=error)

    async def release(self, job: Job) -> None:
        """A job stopped by a shutdown goes back to the queue, its attempt not counted."""
        async with self._db.write() as conn:
            await self._requeue(conn, job.id, job.kind, job.dedupe_key, delay_s=0.0, attempts=job.attempts)

    async def requeue_interrupted(self) -> int:
        """Jobs left running by a process that died go back to the queue.

        Only the process holding the runner lock may call this: it proves no
        other live process is running them.
        """
        j = schema.jobs
        async with self._db.write() as conn:
            rows = (await conn.execute(select(j).where(j.c.status == RUNNING))).all()
            for row in rows:
                await self._requeue(conn, row.id, row.kind, row.dedupe_key, delay_s=0.0, attempts=row.attempts)
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

    async def _requeue(self, conn: AsyncConnection, job_id: str, kind: str, dedupe_key: str, *, delay_s: float,
                       attempts: int, last_error: str | None = None) -> None:
        """Back to pending, unless an equal pending job already covers the work."""
        j = schema.jobs
        now = time.time()
        covered = await conn.execute(
            select(j.c.id).where(j.c.kind == kind, j.c.dedupe_key == dedupe_key, j.c.status == PENDING)
        )
        status = SUPERSEDED if covered.first() is not None else PENDING
        await conn.execute(update(j).where(j.c.id == job_id).values(
            status=status, attempts=attempts, last_error=last_error, next_run_at=now + delay_s, updated_at=now,
        ))

    async def _set(self, job_id: str, *, status: str, attempts: int, last_error: str | None) -> None:
        j = schema.jobs
        async with self._db.write() as conn:
            await conn.execute(update(j).where(j.c.id == job_id).values(
                status=status, attempts=attempts, last_error=last_error, updated_at=time.time(),
            ))
