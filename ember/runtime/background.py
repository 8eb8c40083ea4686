"""Runs durable jobs (consolidation, embedding flush, reviews) beside the turns.

Jobs are rows (store/jobs.py), so queued work survives a restart; a job left
running by a crash is requeued at start. A failing job is retried with
exponential backoff and logged as a warning; after `max_attempts` it is marked
failed. Nothing here can fail a turn: the turn only enqueues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Mapping

from ember.store.jobs import Job, SqlJobStore

log = logging.getLogger(__name__)

JobHandler = Callable[[Job], Awaitable[None]]


class BackgroundRunner:
    def __init__(self, jobs: SqlJobStore, handlers: Mapping[str, JobHandler], *, max_attempts: int = 5,
                 concurrency: int = 2, backoff_base_s: float = 1.0, backoff_cap_s: float = 300.0,
                 poll_s: float = 5.0) -> None:
        self._jobs = jobs
        self._handlers = dict(handlers)
        self._max_attempts = max_attempts
        self._concurrency = concurrency
        self._backoff_base_s = backoff_base_s
        self._backoff_cap_s = backoff_cap_s
        self._poll_s = poll_s
        self._wake = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    async def schedule(self, kind: str, dedupe_key: str, *, session_key: str | None = None) -> bool:
        """Queue a job unless an equal one is pending. Raises if the store fails:
        scheduling durable work is part of the turn's contract."""
        if kind not in self._handlers:
            raise ValueError(f"no handler for job kind {kind!r}")
        queued = await self._jobs.enqueue(kind, dedupe_key, session_key=session_key)
        self._wake.set()
        return queued

    async def start(self) -> None:
        requeued = await self._jobs.requeue_interrupted()
        if requeued:
            log.info("requeued %d background job(s) interrupted by the last shutdown", requeued)
        self._loop_task = asyncio.create_task(self._run(), name="ember-background")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop claiming work; give running jobs `grace_s`, then cancel them.
        A cancelled job stays 'running' in the store and is requeued next start."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self._running:
            _, pending = await asyncio.wait(set(self._running), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until no job is pending, running or waiting for a retry (tests, benchmarks, demo)."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = await self._jobs.counts()
            if not counts.get("pending") and not counts.get("running") and not self._running:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"background jobs still busy after {timeout_s}s: {counts}")
            self._wake.set()
            await asyncio.sleep(0.02)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._claim()
                timeout = await self._sleep_for()
            except Exception:  # the store may be briefly unavailable; keep the runner alive
                log.warning("background runner could not read the job queue; retrying", exc_info=True)
                timeout = self._poll_s
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except TimeoutError:
                pass

    async def _claim(self) -> None:
        free = self._concurrency - len(self._running)
        if free <= 0:
            return
        for job in await self._jobs.claim_due(free):
            task = asyncio.create_task(self._execute(job), name=f"ember-job-{job.kind}")
            self._running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._wake.set()

    async def _sleep_for(self) -> float:
        due = await self._jobs.next_due_at()
        if due is None:
            return self._poll_s
        return min(self._poll_s, max(0.0, due - time.time()))

    async def _execute(self, job: Job) -> None:
        try:
            await self._handlers[job.kind](job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a background failure is logged and retried, never raised
            attempts = job.attempts + 1
            give_up = attempts >= self._max_attempts
            retry_in = None if give_up else min(self._backoff_cap_s, self._backoff_base_s * 2 ** job.attempts)
            log.warning(
                "background job %s (%s) failed on attempt %d/%d: %s%s",
                job.kind, job.dedupe_key, attempts, self._max_attempts, exc,
                "; giving up" if give_up else f"; retrying in {retry_in:.1f}s",
            )
            await self._jobs.fail(job, f"{type(exc).__name__}: {exc}", retry_in_s=retry_in)
            return
        await self._jobs.complete(job)
