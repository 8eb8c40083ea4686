"""Connections to the SQL database, with SQLite set up for durable, concurrent use.

Writes take SQLite's write lock at BEGIN (BEGIN IMMEDIATE) so two writers queue
on the busy timeout instead of failing when a read transaction upgrades.
Reads run on a separate engine and, in WAL mode, never wait for writers.

Two ways in, over the same file and settings: `run_write(work)` /
`run_read(work)` send a store's whole unit of work to a dedicated thread in
one hop (direct.py), which is all the stores use; `write()` / `read()` yield
a SQLAlchemy AsyncConnection (aiosqlite: each statement is a round trip to its
thread), the admin surface for migrations, copies and diagnostics. Writes that queue up meanwhile are committed
together, one fsync for all (group commit).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import event
from sqlalchemy.exc import DatabaseError, InterfaceError, InternalError, OperationalError, SQLAlchemyError

from ember.core.errors import StoreBusy, StoreError, StoreUnavailable
from ember.store.batches import Outcome, ReadBatches
from ember.store.engine import BUSY_TIMEOUT_MS, as_store_errors, complete_despite_cancel, migrate_or_close
from ember.store.migrations import SCHEMA_VERSION, MigrationProgress
from ember.store.sqlite.direct import ThreadConnection
from ember.store.tx import Statement, Tx, Work

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

T = TypeVar("T")

_HAS_VERSIONS = Statement("SELECT count(*) FROM sqlite_master WHERE name = 'schema_version'")
_VERSION = Statement("SELECT MAX(version) FROM schema_version")


def store_error(exc: SQLAlchemyError) -> StoreError | None:
    """Ember's own error for a driver's failure the runtime acts on, so no caller reads a driver's
    exception or its text; None for the rest (an IntegrityError is its caller's to read, a
    ProgrammingError a bug)."""
    if isinstance(exc, OperationalError) and any(word in str(exc.orig) for word in ("locked", "busy")):
        return StoreBusy()
    # A bare DatabaseError is a file that is not (or no longer) a database.
    if isinstance(exc, OperationalError | InterfaceError | InternalError) or type(exc) is DatabaseError:
        return StoreUnavailable(f"the store failed: {exc.orig}")
    return None


def _sqlite_engine(path: Path, *, synchronous: str, immediate: bool) -> AsyncEngine:
    from sqlalchemy.ext.asyncio import create_async_engine  # with aiosqlite, a tenth of a second to import

    engine = create_async_engine(f"sqlite+aiosqlite:///{path}", pool_size=4, max_overflow=4)

    @event.listens_for(engine.sync_engine, "connect")
    def _configure(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        # Let SQLAlchemy's "begin" event issue BEGIN itself, so it can be IMMEDIATE.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn) -> None:  # type: ignore[no-untyped-def]
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


class SqliteDatabase:
    """The embedded SQLite database in one file (WAL): a `Database` (store/engine.py)."""

    dialect = "sqlite"

    def __init__(self, path: Path, *, synchronous: str = "FULL") -> None:
        self.path = path
        self._synchronous = synchronous
        self._write_turn = asyncio.Lock()
        self._direct_writer = ThreadConnection(path, synchronous=synchronous, busy_timeout_ms=BUSY_TIMEOUT_MS,
                                               name="ember-db-writer")
        self._direct_reader = ThreadConnection(path, synchronous=synchronous, busy_timeout_ms=BUSY_TIMEOUT_MS,
                                               name="ember-db-reader")
        # One reader thread: the reads asked while it reads go together in its next transaction.
        self._reads = ReadBatches(self._direct_reader.read, in_flight=1)
        self._write_epoch = 0
        self._queued: list[_Queued] = []
        self._committer: asyncio.Task[None] | None = None

    @property
    def write_epoch(self) -> int:
        """How many transactions went through `write()`. Their statements are
        arbitrary, so whoever caches what it read must assume they changed it."""
        return self._write_epoch

    async def open(self, progress: MigrationProgress | None = None) -> None:
        """Create or migrate the store; `progress` follows the migrations, if any are pending."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            current = await self.run_read(_schema_version) == SCHEMA_VERSION
        except BaseException:  # not a database, or unreadable: its threads go with it
            await self.close()
            raise
        if not current:
            await migrate_or_close(self, progress)

    # The SQLAlchemy engines serve migrations, copies and diagnostics; the stores run on the threads.
    @cached_property
    def _writer(self) -> AsyncEngine:
        return _sqlite_engine(self.path, synchronous=self._synchronous, immediate=True)

    @cached_property
    def _reader(self) -> AsyncEngine:
        return _sqlite_engine(self.path, synchronous=self._synchronous, immediate=False)

    async def close(self) -> None:
        if self._committer is not None:
            await asyncio.shield(self._committer)  # the writes already queued are committed first
        await self._direct_writer.close()
        await self._direct_reader.close()
        for engine in ("_writer", "_reader"):
            if engine in self.__dict__:
                await self.__dict__[engine].dispose()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction: committed on success, rolled back on error.

        Writers of this process queue here, in arrival order, rather than in
        SQLite's busy handler, which polls with sleeps and lets a late writer win.
        """
        try:
            async with as_store_errors(store_error), self._write_turn, self._writer.begin() as conn:
                yield conn
        finally:
            # Counted once it has ended, so whatever was read while it was open counts as older.
            self._write_epoch += 1

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        async with as_store_errors(store_error), self._reader.connect() as conn, conn.begin():
            yield conn

    async def run_write(self, work: Work[T]) -> T:
        """`work(conn)` as one write transaction on the writer thread, undone if it raises.

        Writes queued while the thread is busy are committed together (group
        commit): each in its own savepoint, all under one COMMIT, so they
        share one fsync, and each caller is answered only once that COMMIT is
        durable. Once queued, the write runs even if the caller is cancelled:
        the cancellation is raised after the commit.
        """
        queued = _Queued(work, asyncio.get_running_loop().create_future())
        self._queued.append(queued)
        if self._committer is None:
            self._committer = asyncio.create_task(self._commit_queued(), name="ember-db-commit")
        async with as_store_errors(store_error):
            result, cancelled = await complete_despite_cancel(queued.done)
        if cancelled:
            raise asyncio.CancelledError
        return result

    async def run_read(self, work: Work[T]) -> T:
        """`work(conn)` in one read transaction (one snapshot) on the reader thread, with the
        reads asked together with it (store/batches.py)."""
        async with as_store_errors(store_error):
            return await self._reads.run(work)

    async def _commit_queued(self) -> None:
        """Commit the queue in batches, until it is empty. Each batch takes the
        write lock, so it queues with `write()` in arrival order, and keeps it
        until the thread is done, even if this task is cancelled."""
        batch: list[_Queued] = []
        try:
            while self._queued:
                async with self._write_turn:
                    batch, self._queued = self._queued, []
                    try:
                        outcomes, cancelled = await complete_despite_cancel(
                            self._direct_writer.write([queued.work for queued in batch]))
                    except Exception as exc:  # nothing of the batch was committed
                        outcomes, cancelled = [Outcome(error=exc)] * len(batch), False
                for queued, outcome in zip(batch, outcomes):
                    queued.settle(outcome)
                if cancelled:
                    raise asyncio.CancelledError
        finally:
            self._committer = None
            for queued in [*batch, *self._queued]:  # stopped before their batch was written
                if not queued.done.done():
                    queued.done.cancel()
            self._queued = []


@dataclass(frozen=True, slots=True)
class _Queued:
    work: Work[Any]
    done: asyncio.Future[Any]

    def settle(self, outcome: Outcome[Any]) -> None:
        if outcome.error is not None:
            self.done.set_exception(outcome.error)
        else:
            self.done.set_result(outcome.value)


def _schema_version(tx: Tx) -> int | None:
    """The store's schema version, None before its first migration."""
    if not tx.execute(_HAS_VERSIONS).fetchone()[0]:
        return None
    return tx.execute(_VERSION).fetchone()[0]
