"""Durable background jobs: rows that survive a restart (I6).

At most one pending job exists per (kind, dedupe_key); enqueueing a duplicate
is a no-op. A job is claimed by compare-and-set from `pending` to `running`,
so two runners never execute it at once.

Alone on its store (SQLite, `SqlJobStore`), one runner per home, holding the
runner lock, requeues at start whatever a dead process left running. Shared by
several processes (PostgreSQL, `SharedJobStore`), every process runs jobs: a claim marks
the job its claimer's until `claimed_until`, which the claimer keeps moving
(`extend`); a job still running past it is a dead claimer's, and the next
claim takes it over. The rows a claim reads are locked FOR UPDATE SKIP LOCKED,
so claimers never wait on each other or take the same job.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from sqlalchemy import and_, bindparam, func, literal_column, or_, select, update

from ember.core.jobs import Claimed, Job, JobRequest
from ember.store import schema
from ember.store.engine import Database
from ember.store.tx import Statement, Tx, upsert

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
# A job that would have been retried while an equal one was already pending:
# the pending one covers its work.
SUPERSEDED = "superseded"

_j = schema.jobs
# The index's predicate as a literal: as a parameter, PostgreSQL's generic plan of the prepared
# statement (from its sixth run) cannot match it to the partial index.
_ENQUEUE = upsert(lambda ins: ins(_j).on_conflict_do_nothing(
    index_elements=["kind", "dedupe_key"], index_where=_j.c.status == literal_column(f"'{PENDING}'")))
_JOB = select(_j.c.id, _j.c.kind, _j.c.dedupe_key, _j.c.session_key, _j.c.attempts, _j.c.turn_id)
_due = _j.c.status == PENDING, _j.c.next_run_at <= bindparam("now")
_abandoned = _j.c.status == RUNNING, _j.c.claimed_until < bindparam("now")
_DUE = Statement(_JOB.where(*_due).order_by(_j.c.next_run_at).limit(bindparam("limit")))
# SQLite, with one writer, renders no FOR UPDATE.
_DUE_OR_ABANDONED = Statement(_JOB.where(or_(and_(*_due), and_(*_abandoned))).order_by(_j.c.next_run_at)
                              .limit(bindparam("limit")).with_for_update(skip_locked=True))
_RUNNING = Statement(_JOB.where(_j.c.status == RUNNING))
_CLAIM = Statement(update(_j).where(_j.c.id == bindparam("job_id"), or_(_j.c.status == PENDING, and_(*_abandoned)))
                   .values(status=RUNNING, updated_at=bindparam("now"), claimed_by=bindparam("claimer"),
                           claimed_until=bindparam("until")))
_EXTEND = Statement(update(_j).where(_j.c.id == bindparam("job_id"), _j.c.status == RUNNING,
                                     _j.c.claimed_by == bindparam("claimer"))
                    .values(claimed_until=bindparam("until")))
_COVERED = Statement(select(_j.c.id).where(_j.c.kind == bindparam("kind"), _j.c.dedupe_key == bindparam("dedupe_key"),
                                           _j.c.status == PENDING))
_SET = Statement(update(_j).where(_j.c.id == bindparam("job_id")).values(
    status=bindparam("status"), attempts=bindparam("attempts"), last_error=bindparam("last_error"),
    next_run_at=func.coalesce(bindparam("next_run_at"), _j.c.next_run_at), updated_at=bindparam("now"),
))
_NEXT_DUE = Statement(select(func.min(_j.c.next_run_at)).where(_j.c.status == PENDING))
_COUNTS = Statement(select(_j.c.status, func.count()).group_by(_j.c.status))





class SqlJobStore:
    """The queue of one home's own store: one runner at a time takes its jobs (holding the runner lock)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def enqueue(self, kind: str, dedupe_key: str, *, session_key: str | None = None) -> bool:
        """True when a new job was queued, False when an equal one was already pending."""
        request, now = JobRequest(kind, dedupe_key, session_key), time.time()
        return await self._db.run_write(lambda tx: record_job(tx, request, now))

    async def claim_due(self, limit: int) -> Claimed:
        """Move up to `limit` due jobs to running and return them, with when the next is due."""
        now = time.time()
        query, params = self._claiming(now)

        def claim(tx: Tx) -> Claimed:
            due = [Job(*row) for row in tx.execute(query, {"now": now, "limit": limit}).fetchall()]
            taken = [job for job in due if tx.execute(_CLAIM, {**params, "job_id": job.id}).rowcount == 1]
            return Claimed(taken, tx.execute(_NEXT_DUE).fetchone()[0])

        return await self._db.run_write(claim)

    def _claiming(self, now: float) -> tuple[Statement, dict[str, object]]:
        """Which jobs a claim takes, and what it marks them with: due ones, nobody's, for good."""
        return _DUE, {"now": now, "claimer": None, "until": None}

    async def complete(self, job: Job) -> None:
        await self._db.run_write(lambda tx: _set(tx, job.id, status=DONE, attempts=job.attempts + 1))

    async def fail(self, job: Job, error: str, *, retry_in_s: float | None) -> None:
        """Record a failed attempt: retried after `retry_in_s`, or given up when None."""
        if retry_in_s is None:
            await self._db.run_write(lambda tx: _set(tx, job.id, status=FAILED, attempts=job.attempts + 1,
                                                     last_error=error))
            return
        await self._db.run_write(lambda tx: _requeue(tx, job, delay_s=retry_in_s, attempts=job.attempts + 1,
                                                     last_error=error))

    async def release(self, job: Job) -> None:
        """A job stopped by a shutdown goes back to the queue, its attempt not counted."""
        await self._db.run_write(lambda tx: _requeue(tx, job, delay_s=0.0, attempts=job.attempts))

    async def requeue_interrupted(self) -> int:
        """Jobs left running by a process that died go back to the queue.

        Only the process holding the runner lock may call this: it proves no
        other live process is running them.
        """
        def requeue(tx: Tx) -> int:
            running = [Job(*row) for row in tx.execute(_RUNNING).fetchall()]
            for job in running:
                _requeue(tx, job, delay_s=0.0, attempts=job.attempts)
            return len(running)

        return await self._db.run_write(requeue)

    async def counts(self) -> dict[str, int]:
        return await self._db.run_read(lambda tx: dict(tx.execute(_COUNTS).fetchall()))


def record_job(tx: Tx, request: JobRequest, now: float) -> bool:
    """Queue `request` inside the caller's transaction; False when an equal job is already pending."""
    row = {"id": uuid.uuid4().hex, "kind": request.kind, "dedupe_key": request.dedupe_key,
           "session_key": request.session_key, "status": PENDING, "attempts": 0,
           "next_run_at": now + request.delay_s,
           "last_error": None, "created_at": now, "updated_at": now, "turn_id": request.turn_id,
           "claimed_by": None, "claimed_until": None}
    return tx.execute(_ENQUEUE, row).rowcount == 1


def _requeue(tx: Tx, job: Job, *, delay_s: float, attempts: int,
             last_error: str | None = None) -> None:
    """Back to pending, unless an equal pending job already covers the work."""
    covered = tx.execute(_COVERED, {"kind": job.kind, "dedupe_key": job.dedupe_key}).fetchone() is not None
    _set(tx, job.id, status=SUPERSEDED if covered else PENDING, attempts=attempts, last_error=last_error,
         next_run_at=time.time() + delay_s)


def _set(tx: Tx, job_id: str, *, status: str, attempts: int, last_error: str | None = None,
         next_run_at: float | None = None) -> None:
    """A job's new state; its next run time is kept unless given."""
    tx.execute(_SET, {"job_id": job_id, "status": status, "attempts": attempts, "last_error": last_error,
                      "next_run_at": next_run_at, "now": time.time()})


class SharedJobStore(SqlJobStore):
    """The queue of a store several processes share, each running jobs as `claimer`: its claims
    hold for `claim_ttl_s`, renewed by `extend`; one left to expire is a dead claimer's, and the
    next claim takes it over."""

    def __init__(self, db: Database, *, claimer: str, claim_ttl_s: float) -> None:
        super().__init__(db)
        self.claimer = claimer
        self.claim_ttl_s = claim_ttl_s

    def _claiming(self, now: float) -> tuple[Statement, dict[str, object]]:
        return _DUE_OR_ABANDONED, {"now": now, "claimer": self.claimer, "until": now + self.claim_ttl_s}

    async def extend(self, jobs: Iterable[Job]) -> int:
        """Keep this claimer's running `jobs` its own for another `claim_ttl_s`; how many still were."""
        rows = [{"job_id": job.id, "claimer": self.claimer, "until": time.time() + self.claim_ttl_s} for job in jobs]
        return await self._db.run_write(lambda tx: sum(tx.execute(_EXTEND, row).rowcount for row in rows))
