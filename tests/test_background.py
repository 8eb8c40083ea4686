"""Durable background jobs (I6): survive restarts, retry with backoff, dedupe."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Collection
from pathlib import Path

import pytest

from ember.core.jobs import Claimed, Job
from ember.runtime.background import BackgroundRunner, HostRunner, RetryPolicy, RunnerRight, SharedClaims
from ember.runtime.leases import HostLock
from ember.store.engine import Database
from ember.store.jobs import SharedJobStore, SqlJobStore
from ember.store.postgres import PostgresDatabase
from ember.store.sqlite.database import SqliteDatabase
from tests.pgserver import ENGINES, engine_database

CLAIM_TTL_S = 0.5  # a shared store's claim, unrenewed: a dead claimer's job is taken over after it


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    """The job queue on SQLite, and on PostgreSQL, which processes share by claims that expire."""
    database = await engine_database(request.param, request, tmp_path)
    yield database
    await database.close()


def job_store(db: Database, claimer: str = "p1", ttl_s: float = CLAIM_TTL_S) -> CountedLooks:
    """The queue as build_runtime opens it (one home's own on SQLite, shared by claimers on
    PostgreSQL), counting how often the runner looks for due jobs."""
    if isinstance(db, SqliteDatabase):
        return CountedLooks(db)
    return SharedCountedLooks(db, claimer=claimer, claim_ttl_s=ttl_s)


def right(jobs: SqlJobStore) -> RunnerRight:
    # On a home's own store every runner of a test shares one lock file, as the processes of one
    # EMBER_HOME do; on a shared store each renews its claims, as build_runtime makes it.
    if isinstance(jobs, SharedJobStore):
        return SharedClaims(jobs)
    return HostRunner(HostLock(Path(os.environ["EMBER_HOME"]) / "runner.lock"), jobs)


def runner(jobs: SqlJobStore, handler, *, max_attempts: int = 5,  # type: ignore[no-untyped-def]
           right_: RunnerRight | None = None) -> BackgroundRunner:
    return BackgroundRunner(jobs, {"work": handler}, right_ or right(jobs),
                            retry=RetryPolicy(max_attempts=max_attempts, backoff_base_s=0.01), poll_s=0.05)


class Tally:
    """A count a test waits on, rather than on a guessed time."""

    def __init__(self) -> None:
        self.n = 0
        self._changed = asyncio.Event()

    def add(self) -> None:
        self.n += 1
        self._changed.set()

    async def reaching(self, n: int, timeout_s: float = 10) -> None:
        async with asyncio.timeout(timeout_s):
            while self.n < n:
                self._changed.clear()
                await self._changed.wait()


class CountedPasses:
    """A runner's right, counting its passes over the queue: each asks for the right (`asked`),
    and one that has it keeps its claims (`kept`) just before it decides whether to look."""

    def __init__(self, inner: RunnerRight) -> None:
        self._inner = inner
        self.longest_sleep_s = inner.longest_sleep_s
        self.asked, self.kept = Tally(), Tally()

    async def acquire(self) -> bool:
        try:
            return await self._inner.acquire()
        finally:
            self.asked.add()

    async def keep(self, running: Collection[Job]) -> None:
        await self._inner.keep(running)
        self.kept.add()

    def release(self) -> None:
        self._inner.release()


async def until_ran(runs: list[tuple[str, str]], run: tuple[str, str], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while run not in runs:
            await asyncio.sleep(0.01)


async def test_one_pending_job_per_kind_and_key(db: Database) -> None:
    jobs = job_store(db)
    assert await jobs.enqueue("work", "s1")
    assert not await jobs.enqueue("work", "s1")
    assert await jobs.enqueue("work", "s2")
    assert await jobs.enqueue("other", "s1")
    [claimed, *_] = (await jobs.claim_due(1)).jobs
    # While one runs, one more may wait: it covers what arrived after the run started.
    assert await jobs.enqueue(claimed.kind, claimed.dedupe_key)
    assert not await jobs.enqueue(claimed.kind, claimed.dedupe_key)


async def test_a_failing_job_is_retried_with_backoff_then_succeeds(db: Database, caplog) -> None:  # type: ignore[no-untyped-def]
    attempts: list[int] = []

    async def flaky(job: Job) -> None:
        attempts.append(job.attempts)
        if len(attempts) < 3:
            raise ConnectionError("model unreachable")

    caplog.set_level(logging.WARNING)
    jobs = job_store(db)
    background = runner(jobs, flaky)
    await background.start()
    await background.schedule("work", "s1")
    await background.wait_idle()
    await background.stop()
    assert attempts == [0, 1, 2]
    assert await jobs.counts() == {"done": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("model unreachable" in w and "retrying" in w for w in warnings)


async def test_a_job_that_keeps_failing_is_given_up(db: Database) -> None:
    async def broken(job: Job) -> None:
        raise ValueError("bad data")

    jobs = job_store(db)
    background = runner(jobs, broken, max_attempts=3)
    await background.start()
    await background.schedule("work", "s1")
    await background.wait_idle()
    await background.stop()
    assert await jobs.counts() == {"failed": 1}


@pytest.mark.parametrize("engine", ENGINES)
async def test_jobs_survive_a_restart(engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    db = await engine_database(engine, request, tmp_path)
    jobs = job_store(db, "died")
    await jobs.enqueue("work", "queued")
    await jobs.enqueue("work", "was-running")
    await jobs.claim_due(1)  # the process dies with this job running
    await db.close()

    ran: list[str] = []

    async def record(job: Job) -> None:
        ran.append(job.dedupe_key)

    # The next process; on PostgreSQL another claimer, which takes the job over once its claim runs out.
    reopened = (SqliteDatabase(tmp_path / "ember.db") if engine == "sqlite"
                else PostgresDatabase(request.getfixturevalue("pg_store_database")))
    await reopened.open()
    background = runner(job_store(reopened, "next"), record)
    await background.start()
    await background.wait_idle()
    await background.stop()
    assert sorted(ran) == ["queued", "was-running"]
    await reopened.close()


async def test_stop_cancels_a_hung_job_and_it_runs_again_next_start(db: Database) -> None:
    started = asyncio.Event()
    runs: list[str] = []

    async def hangs_once(job: Job) -> None:
        runs.append(job.id)
        if len(runs) == 1:
            started.set()
            await asyncio.Event().wait()

    jobs = job_store(db)
    first = runner(jobs, hangs_once)
    await first.start()
    await first.schedule("work", "s1")
    await asyncio.wait_for(started.wait(), 5)
    await first.stop(grace_s=0.05)
    assert await jobs.counts() == {"pending": 1}  # put back, its attempt not counted

    second = runner(jobs, hangs_once)
    await second.start()
    await second.wait_idle()
    await second.stop()
    assert len(runs) == 2 and runs[0] == runs[1]
    assert await jobs.counts() == {"done": 1}


async def test_unknown_job_kind_is_refused_at_scheduling(db: Database) -> None:
    background = runner(job_store(db), lambda job: None)
    with pytest.raises(ValueError, match="no handler"):
        await background.schedule("nonsense", "s1")


# SQLite only: it is about the runner lock of one home; on a shared store every process runs
# jobs, and none takes a running one (tests/test_shared_store.py).
@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
async def test_only_one_runner_per_home_runs_jobs_and_none_steals_a_running_job(db: Database) -> None:
    """A second process (say `ember chat -m` beside `ember run`) must not requeue
    and rerun the jobs the first one is running."""
    release = asyncio.Event()
    runs: list[tuple[str, str]] = []

    def handler(name: str):  # type: ignore[no-untyped-def]
        async def run(job: Job) -> None:
            runs.append((name, job.dedupe_key))
            await release.wait()
        return run

    jobs = job_store(db)
    second_right = CountedPasses(right(jobs))
    first, second = runner(jobs, handler("first")), runner(jobs, handler("second"), right_=second_right)
    await first.start()
    await first.schedule("work", "s1")
    await until_ran(runs, ("first", "s1"))
    await second.start()
    await second.schedule("work", "s2")
    # The second asked to run jobs at its start and when s2 woke it (refused: its pass ends there),
    # and the first, polling, took s2: neither moment let the second run or requeue a job.
    await second_right.asked.reaching(2)
    await until_ran(runs, ("first", "s2"))
    assert runs == [("first", "s1"), ("first", "s2")]
    release.set()
    await first.wait_idle()
    await first.stop()
    # The first process is gone: the second takes over the queue.
    await second.schedule("work", "s3")
    await second.wait_idle()
    await second.stop()
    assert runs[-1] == ("second", "s3")
    assert await jobs.counts() == {"done": 3}


async def test_stop_just_after_a_wake_up_returns(db: Database) -> None:
    """On Python 3.11, asyncio.wait_for swallows a cancel that arrives as its
    event is set; a runner built on it hung in stop() after a schedule()."""
    async def nothing(job: Job) -> None:
        return None

    jobs = job_store(db)
    for i in range(5):
        background = runner(jobs, nothing)
        await background.start()
        await jobs.looked.reaching(i + 1)  # its first look is over: the runner waits to be woken
        await background.schedule("work", f"s{i}")  # sets the wake-up event as it returns
        async with asyncio.timeout(15):  # stop() runs in this very step, as an app's shutdown would
            await background.stop()


class CountedLooks(SqlJobStore):
    """Counts the runner's looks for due jobs: as each begins (`looks`), and as each is over
    (`looked`), after which the runner goes on to sleep without awaiting anything else."""

    looks = 0

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.looked = Tally()

    async def claim_due(self, limit: int) -> Claimed:
        self.looks += 1
        try:
            return await super().claim_due(limit)
        finally:
            self.looked.add()


class SharedCountedLooks(CountedLooks, SharedJobStore):
    pass


async def test_a_runner_that_ran_its_last_job_looks_no_more_until_something_is_queued(db: Database) -> None:
    """The claim says when the next job is due: no empty claim after a job, no separate read."""
    ran: list[int] = []
    # When the job last ran: the runner's passes and looks so far. The job's end wakes it for one
    # more pass, which must not look.
    at_last_run: list[int] = []

    async def flaky(job: Job) -> None:
        ran.append(job.attempts)
        at_last_run[:] = [passes.kept.n, jobs.looks]
        if len(ran) == 1:
            raise RuntimeError("first attempt fails")

    # A shared store is polled every third of a claim's time (other processes queue jobs too): long here.
    jobs = job_store(db, ttl_s=30)
    passes = CountedPasses(right(jobs))
    background = BackgroundRunner(jobs, {"work": flaky}, passes,
                                  retry=RetryPolicy(backoff_base_s=0.05), poll_s=5.0)
    await background.start()
    await background.schedule("work", "once")
    async with asyncio.timeout(5):
        while (await jobs.counts()).get("done") != 1:
            await asyncio.sleep(0.02)
    kept, looks = at_last_run
    # That pass decides, without awaiting anything, whether to look (a look counts as it begins).
    await passes.kept.reaching(kept + 1)
    assert ran == [0, 1] and jobs.looks == looks
    await background.schedule("work", "again")
    async with asyncio.timeout(5):
        while (await jobs.counts()).get("done") != 2:
            await asyncio.sleep(0.02)
    assert jobs.looks == looks + 1
    await background.stop()


async def test_a_runner_with_every_slot_busy_waits_for_one_without_polling_the_store(db: Database) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(job: Job) -> None:
        started.set()
        await release.wait()

    jobs = job_store(db)
    passes = CountedPasses(right(jobs))
    background = BackgroundRunner(jobs, {"work": slow}, passes, concurrency=1, poll_s=5.0)
    await background.start()
    await background.schedule("work", "first")
    await asyncio.wait_for(started.wait(), 5)
    await background.schedule("work", "second")  # due now, and no slot is free for it
    before, kept = jobs.looks, passes.kept.n
    # The pass the wake-up brings decides, without awaiting anything, whether to look: it must not.
    await passes.kept.reaching(kept + 1)
    assert jobs.looks == before
    release.set()
    await background.wait_idle()
    await background.stop()
    assert await jobs.counts() == {"done": 2}
