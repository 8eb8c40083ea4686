"""Runs durable jobs (consolidation, embedding flush, reviews) beside the turns.

Jobs are rows (store/jobs.py), so queued work survives a restart. On a home's
own SQLite store, one process runs them: the one holding the runner lock, which
is also what makes requeueing jobs a dead process left `running` safe. Other
processes only enqueue, and take over if the lock holder exits. On a shared
store, every process runs jobs, renewing its claims every third of their time,
and takes over the claims of a process that stopped. Which of the two a runner
does is its `RunnerRight`, chosen where the runtime is built. A failing job is retried
with exponential backoff and logged as a warning; after `max_attempts` it is
marked failed. Nothing here can fail a turn: the turn only enqueues.

A turn's derived work is queued due a moment after its commit (`wake(delay_s)`
says when): the turns committed meanwhile queue equal jobs (archive this
session, upkeep), which the pending one covers, and the runner wakes once for
them all, so a busy server runs one job, with its claim and its completion, for
many turns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

from ember.core.errors import StoreError
from ember.core.jobs import Job
from ember.core.journal import Spans
from ember.core.usage import UsageScope, current_scope
from ember.runtime.leases import HostLock
from ember.runtime.tasks import cancel_task, stop_tasks
from ember.store.protocols import JobQueue, SharedJobQueue

log = logging.getLogger(__name__)

JobHandler = Callable[[Job], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 5
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 300.0

    def delay_after(self, attempts: int) -> float | None:
        """Seconds before the next attempt, or None to give up."""
        if attempts >= self.max_attempts:
            return None
        return min(self.backoff_cap_s, self.backoff_base_s * 2 ** (attempts - 1))


class RunnerRight(Protocol):
    """Whether this process may run jobs now, and what keeps the jobs it runs its own."""

    longest_sleep_s: float | None  # the most the runner may sleep between looks at the queue (None: any)

    async def acquire(self) -> bool: ...

    async def keep(self, running: Collection[Job]) -> None: ...

    def release(self) -> None: ...


class HostRunner:
    """One runner per home (its own SQLite store): the process holding the home's runner lock. Taking
    the lock proves nobody else runs jobs, so what a process that stopped left running is queued again."""

    longest_sleep_s = None

    def __init__(self, lock: HostLock, jobs: JobQueue) -> None:
        self._lock = lock
        self._jobs = jobs

    async def acquire(self) -> bool:
        if self._lock.held:
            return True
        if not self._lock.try_acquire():
            return False
        try:
            requeued = await self._jobs.requeue_interrupted()
        except BaseException:
            self._lock.release()  # so the next pass takes it again and retries the requeue
            raise
        if requeued:
            log.info("requeued %d background job(s) left running by a process that stopped", requeued)
        return True

    async def keep(self, running: Collection[Job]) -> None:
        pass  # the lock keeps them

    def release(self) -> None:
        self._lock.release()


class SharedClaims:
    """Every process of a shared store runs jobs, renewing its claims every third of their time; it
    looks at the queue as often, since other processes queue jobs too."""

    def __init__(self, jobs: SharedJobQueue) -> None:
        self._jobs = jobs
        self.longest_sleep_s = jobs.claim_ttl_s / 3
        self._extended_at = 0.0

    async def acquire(self) -> bool:
        return True

    async def keep(self, running: Collection[Job]) -> None:
        """Another process takes over a claim left to expire."""
        if running and time.monotonic() - self._extended_at >= self._jobs.claim_ttl_s / 3:
            await self._jobs.extend(running)
            self._extended_at = time.monotonic()

    def release(self) -> None:
        pass


class BackgroundRunner:
    def __init__(self, jobs: JobQueue, handlers: Mapping[str, JobHandler], right: RunnerRight, *,
                 retry: RetryPolicy = RetryPolicy(), concurrency: int = 2, poll_s: float = 5.0,
                 spans: Spans | None = None) -> None:
        self._jobs = jobs
        self._spans = spans
        self._handlers = dict(handlers)
        self._right = right
        self._retry = retry
        self._concurrency = concurrency
        self._poll_s = poll_s
        self._wake = asyncio.Event()
        self._soon: asyncio.TimerHandle | None = None  # a wake-up for jobs queued due later
        self._running: dict[asyncio.Task[None], Job] = {}
        # Whether something may be due that the last claim did not see (queued, woken, retried,
        # or a poll's time: other processes queue too); else the claim's next due time is known.
        self._look = True
        self._next_due: float | None = None
        self._loop_task: asyncio.Task[None] | None = None

    async def schedule(self, kind: str, dedupe_key: str, *, session_key: str | None = None) -> bool:
        """Queue a job unless an equal one is pending. Raises if the store fails:
        scheduling durable work is part of the turn's contract."""
        if kind not in self._handlers:
            raise ValueError(f"no handler for job kind {kind!r}")
        queued = await self._jobs.enqueue(kind, dedupe_key, session_key=session_key)
        self._look_now()
        return queued

    def wake(self, delay_s: float = 0.0) -> None:
        """Jobs were queued in some other transaction (a turn's commit), due in `delay_s`: claim
        them then. One wake-up serves every turn that commits before it."""
        if delay_s <= 0:
            self._look_now()
        elif self._soon is None:
            self._soon = asyncio.get_running_loop().call_later(delay_s, self._woken)

    def _woken(self) -> None:
        self._soon = None
        self._look_now()

    def _look_now(self) -> None:
        self._look = True
        self._wake.set()

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="ember-background")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop claiming work; give running jobs `grace_s`, then cancel them and
        put them back in the queue for the next start."""
        try:
            if self._soon is not None:
                self._soon.cancel()
                self._soon = None
            await cancel_task(self._loop_task)
            self._loop_task = None
            await stop_tasks(self._running, grace_s)
        finally:
            self._right.release()

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until no job is pending, running or waiting for a retry (tests, benchmarks, demo)."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = await self._jobs.counts()
            if not counts.get("pending") and not counts.get("running") and not self._running:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"background jobs still busy after {timeout_s}s: {counts}")
            self._look_now()
            await asyncio.sleep(0.02)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            timeout = self._poll_s
            try:
                if await self._right.acquire():
                    await self._right.keep(list(self._running.values()))
                    timeout = await self._claim()
            except Exception:  # the runner's edge: a locked store or a lock file error is retried, not fatal
                log.warning("background runner could not read the job queue; retrying", exc_info=True)
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
            # cancellation that arrives as the event is set, and stop() would hang.
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                self._look = True

    async def _claim(self) -> float:
        """Claim due jobs into the free slots; how long to sleep then. One write, and no read:
        the claim says when the next job is due."""
        cap = self._right.longest_sleep_s
        longest = self._poll_s if cap is None else min(self._poll_s, cap)
        free = self._concurrency - len(self._running)
        if free <= 0:
            return longest  # due jobs wait for a free slot, and a job finishing wakes the runner
        if self._look or (self._next_due is not None and self._next_due <= time.time()):
            self._look = False
            claimed = await self._jobs.claim_due(free)
            self._next_due = claimed.next_due_at
            for job in claimed.jobs:
                task = asyncio.create_task(self._execute(job), name=f"ember-job-{job.kind}")
                self._running[task] = job
                task.add_done_callback(self._finished)
            if len(self._running) >= self._concurrency:
                return longest
        if self._next_due is None:
            return longest
        return min(longest, max(0.0, self._next_due - time.time()))

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        self._wake.set()

    async def _execute(self, job: Job) -> None:
        # A job's model calls are charged to its kind and its session (and so the session's identity).
        current_scope.set(UsageScope(session_key=job.session_key, job_kind=job.kind))
        try:
            handler = self._handlers.get(job.kind)
            if handler is None:
                raise LookupError(f"no handler for job kind {job.kind!r} in this process")
            with self._spans.job(job.kind, job.id, job.session_key, job.turn_id) if self._spans else nullcontext():
                await handler(job)
        except asyncio.CancelledError:
            await self._record(self._jobs.release(job), job)
            self._look = True
            raise
        except Exception as exc:  # a background failure is logged and retried, never raised
            attempts = job.attempts + 1
            retry_in = self._retry.delay_after(attempts)
            log.warning(
                "background job %s (%s) failed on attempt %d/%d: %s%s",
                job.kind, job.dedupe_key, attempts, self._retry.max_attempts, exc,
                "; giving up" if retry_in is None else f"; retrying in {retry_in:.1f}s",
            )
            await self._record(self._jobs.fail(job, f"{type(exc).__name__}: {exc}", retry_in_s=retry_in), job)
            self._look = True  # its retry is due later than the last claim saw
            return
        await self._record(self._jobs.complete(job), job)

    async def _record(self, bookkeeping: Awaitable[None], job: Job) -> None:
        """A job's outcome not written stays `running` until the next start requeues it."""
        try:
            await bookkeeping
        except StoreError:
            log.warning("could not record the outcome of background job %s (%s)", job.kind, job.id, exc_info=True)
