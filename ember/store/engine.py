"""The seam between the stores and the engine that holds them: a `Database`, and the
`AdminDatabase` beside it for migrations, copies and diagnostics.

Every store (sessions, inbox and outbox, jobs, memory, traces, approvals, tasks,
skills, usage, leases) is one implementation written against this protocol
and its units of work (`Tx`, store/tx.py). Two engines provide it: the
embedded SQLite file (store/sqlite/, with its sqlite3 fast path) and
PostgreSQL (store/postgres.py). The errors the runtime acts on are Ember's own
(`StoreBusy`, `StoreUnavailable`, `LeaseLost`), never a driver's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Protocol, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from ember.core.errors import StoreError
from ember.store.migrations import MigrationProgress, migrate
from ember.store.tx import Work

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

BUSY_TIMEOUT_MS = 10_000

T = TypeVar("T")


class Database(Protocol):
    """An open store, as the stores use it: `run_write(work)` / `run_read(work)` run a store's
    unit `work(tx)` as one whole transaction. Nothing else: a store never holds a raw connection."""

    dialect: str  # "sqlite" or "postgresql": what a store may ask of the database besides its rows

    @property
    def write_epoch(self) -> int:
        """How many admin transactions (`AdminDatabase.write()`) this process ran. Their statements
        are arbitrary, so whoever caches what it read must assume they changed it."""
        ...

    async def open(self, progress: MigrationProgress | None = None) -> None: ...

    async def close(self) -> None: ...

    async def run_write(self, work: Work[T]) -> T: ...

    async def run_read(self, work: Work[T]) -> T: ...


class AdminDatabase(Database, Protocol):
    """The same store with raw SQLAlchemy connections, for what is not a store's everyday work:
    migrating it, copying it to another engine, diagnosing it (`ember doctor`), and tests that
    edit rows by hand. Only the composition root hands it out."""

    def write(self) -> AbstractAsyncContextManager[AsyncConnection]: ...

    def read(self) -> AbstractAsyncContextManager[AsyncConnection]: ...


async def complete_despite_cancel(write: Awaitable[T]) -> tuple[T, bool]:
    """Run a write to its end even if the caller is cancelled meanwhile.

    Returns the result and whether a cancellation arrived; the caller records
    the result, then re-raises CancelledError. A plain `asyncio.shield` would
    return control at once, letting the caller release its session lease
    while the write is still running.
    """
    task = asyncio.ensure_future(write)
    interrupted = False
    while True:
        try:
            return await asyncio.shield(task), interrupted
        except asyncio.CancelledError:
            if task.done() and not task.cancelled():
                return task.result(), True  # finished in the same step; raises the write's own error
            if task.done():
                raise
            interrupted = True


@asynccontextmanager
async def as_store_errors(
        own_error: Callable[[SQLAlchemyError], StoreError | None]) -> AsyncIterator[None]:
    """Raise the driver's failures the runtime acts on as Ember's own (`own_error`: the engine's mapping)."""
    try:
        yield
    except SQLAlchemyError as exc:
        if (own := own_error(exc)) is not None:
            raise own from exc
        raise


async def migrate_or_close(db: AdminDatabase, progress: MigrationProgress | None) -> None:
    """`db.open`'s work on either engine: migrate in one write transaction; close `db` if that fails."""
    try:
        async with db.write() as conn:
            await migrate(conn, progress)
    except BaseException:
        await db.close()
        raise
