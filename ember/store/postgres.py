"""The store on a PostgreSQL server, for several worker processes on one database (asyncpg).

An `AdminDatabase` (store/engine.py), as the embedded SQLite one (store/sqlite/): `write()` /
`read()` yield a SQLAlchemy AsyncConnection in a transaction; `run_write(work)`
/ `run_read(work)` run a store's unit `work(tx)` as one whole transaction,
each statement as its `Statement.postgresql` form (store/tx.py), on asyncpg
connections of their own (store/pg_direct.py), not through the engine.

Writes run at READ COMMITTED, each in its own transaction from the pool (no
batching here: concurrent commits share the server's WAL flushes).
Two writers of the same row queue on its lock, and the second then sees the
first's committed row, so `UPDATE ... SET n = n + 1` and compare-and-set
(`UPDATE ... WHERE next_seq = :expected`) lose nothing; a read followed by a
write that depends on it needs `SELECT ... FOR UPDATE`, which SQLite's single
writer never did. A lock waited for longer than `lock_timeout_ms`, a deadlock
or a serialization failure is `StoreBusy`: nothing of that write was kept.

Reads run at REPEATABLE READ, read-only: one snapshot for the whole unit, as
SQLite's read transaction is. Units read together share one transaction
(store/batches.py): a turn's reads, and under load many turns', cost one
connection and one BEGIN ... COMMIT.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, CursorResult, event, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from ember.core.errors import StoreBusy, StoreError, StoreUnavailable
from ember.core.leases import current_fence
from ember.store.batches import Outcome, ReadBatches, run_each
from ember.store.engine import BUSY_TIMEOUT_MS, as_store_errors, complete_despite_cancel, migrate_or_close
from ember.store.leases import check_fence, fenced
from ember.store.migrations import MigrationProgress
from ember.store.pg_direct import PgUnits
from ember.store.tx import Params, Statement, Tx, Work

T = TypeVar("T")

CONNECT_TIMEOUT_S = 10.0
POOL_TIMEOUT_S = 30.0  # a unit waits this long for a connection the others hold, then StoreBusy
# Read batches at once: the pool's other connections are left to the writes.
READ_BATCHES_IN_FLIGHT = 2
IDLE_PING_S = 5.0
# serialization_failure, deadlock_detected, lock_not_available (lock_timeout)
BUSY_STATES = frozenset({"40001", "40P01", "55P03"})
# Classes of SQLSTATE that say the server, not the statement, failed: connection exception,
# insufficient resources, operator intervention (a shutdown), system error, internal error.
UNAVAILABLE_CLASSES = ("08", "53", "57", "58", "XX")


class _Aborted(Exception):
    """A read batch's transaction, aborted by a unit's failed statement: rolled back, with what it read."""

    def __init__(self, outcomes: list[Outcome[Any]]) -> None:
        self.outcomes = outcomes


def pg_store_error(exc: SQLAlchemyError) -> StoreError | None:
    """Ember's own error for a failure of the server the runtime acts on; None for the rest
    (an IntegrityError is its caller's to read, a ProgrammingError a bug)."""
    if isinstance(exc, PoolTimeout):  # this process's other units held every connection past the pool's timeout
        return StoreBusy()
    if not isinstance(exc, DBAPIError):
        return None
    state = getattr(exc.orig, "sqlstate", None) or ""  # asyncpg's, on SQLAlchemy's adapted error
    if state in BUSY_STATES:
        return StoreBusy()
    if exc.connection_invalidated or isinstance(exc, InterfaceError) or state.startswith(UNAVAILABLE_CLASSES):
        return StoreUnavailable(f"the PostgreSQL store failed: {exc.orig}")
    return None


@asynccontextmanager
async def _transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One transaction on a connection from the pool: committed on success, rolled back on error.
    StoreUnavailable when the server cannot be reached or refuses the connection (down, an unknown
    database, bad credentials)."""
    async with as_store_errors(pg_store_error):
        try:
            conn = await engine.connect()
        except (OSError, DBAPIError) as exc:  # OSError: refused, unreachable, timed out
            raise StoreUnavailable(f"cannot connect to the PostgreSQL store: {exc}") from exc
        try:
            async with conn.begin():
                yield conn
        finally:
            await conn.close()


def _ping_when_idle(engine: AsyncEngine, idle_s: float) -> None:
    """A pooled connection idle longer than `idle_s` is pinged before it is used, and replaced if
    the server dropped it (a restart): a transaction then never fails on a dead connection. One in
    use all along is not: pinging every checkout (pool_pre_ping) costs a BEGIN and a ROLLBACK per
    transaction, a third of the server's work in a turn."""
    @event.listens_for(engine.sync_engine, "checkin")
    def _returned(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine.sync_engine, "checkout")
    def _taken(dbapi_connection: Any, record: ConnectionPoolEntry, proxy: Any) -> None:
        if time.monotonic() - record.info.get("idle_since", float("inf")) <= idle_s:
            return
        try:
            dbapi_connection.ping()
        except Exception as exc:  # the pool discards it and connects again
            raise DisconnectionError("the server closed this connection") from exc


class PgRows:
    """What a statement gave back, as `Rows` (store/tx.py): plain tuples, and the count of rows it changed."""

    __slots__ = ("_result",)

    def __init__(self, result: CursorResult[Any]) -> None:
        self._result = result

    @property
    def rowcount(self) -> int:
        return self._result.rowcount

    def fetchone(self) -> tuple[Any, ...] | None:
        row = self._result.fetchone()
        return None if row is None else tuple(row)

    def fetchall(self) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self._result.fetchall()]


class PgTx:
    """A `Tx` on a SQLAlchemy connection to PostgreSQL (the sync side of an AsyncConnection,
    inside `run_sync`): each statement as its `postgresql` form."""

    __slots__ = ("connection",)
    dialect = "postgresql"

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def execute(self, statement: Statement, params: Params | None = None) -> PgRows:
        return PgRows(self.connection.execute(statement.postgresql, params))

    def executemany(self, statement: Statement, rows: Sequence[Params]) -> None:
        if rows:  # SQLAlchemy would run an empty list once, without parameters
            self.connection.execute(statement.postgresql, list(rows))


class PostgresDatabase:
    """Ember's store in a PostgreSQL database, `url` as `postgresql://user@host:port/name`."""

    dialect = "postgresql"

    def __init__(self, url: str, *, pool_size: int = 8, lock_timeout_ms: int = BUSY_TIMEOUT_MS,
                 idle_ping_s: float = IDLE_PING_S) -> None:
        self.url = url
        connect_args = {"timeout": CONNECT_TIMEOUT_S,
                        "server_settings": {"lock_timeout": str(lock_timeout_ms), "application_name": "ember"}}
        self._engine = create_async_engine(
            make_url(url).set(drivername="postgresql+asyncpg"),
            pool_size=pool_size, max_overflow=pool_size // 2, pool_timeout=POOL_TIMEOUT_S, connect_args=connect_args)
        _ping_when_idle(self._engine, idle_ping_s)
        # The stores' units, every turn's statements, bypass the engine (store/pg_direct.py).
        _, from_url = self._engine.dialect.create_connect_args(self._engine.url)
        self._units = PgUnits({**from_url, **connect_args}, max_size=pool_size + pool_size // 2,
                              acquire_timeout_s=POOL_TIMEOUT_S, idle_ping_s=idle_ping_s)
        self._reader = self._engine.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        self._reads = ReadBatches(self._read_batch, in_flight=READ_BATCHES_IN_FLIGHT)
        self._write_epoch = 0
        self._writing: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def write_epoch(self) -> int:
        """How many transactions went through `write()` in this process. Their statements are
        arbitrary, so whoever caches what it read must assume they changed it."""
        return self._write_epoch

    async def open(self, progress: MigrationProgress | None = None) -> None:
        """Create or migrate the schema; `progress` follows the migrations, if any are pending.
        Processes opening the same database together migrate it once."""
        await migrate_or_close(self, progress)

    async def close(self) -> None:
        """Wait for the writes already started (they commit), then close every connection."""
        self._closed = True
        if self._writing:
            await asyncio.wait(set(self._writing))
        await self._units.close()
        await self._engine.dispose()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction: committed on success, rolled back on error; refused with
        LeaseLost, like `run_write`, when it runs under a lease this process lost."""
        fence = current_fence.get()
        try:
            async with _transaction(self._engine) as conn:
                if fence is not None:
                    await conn.run_sync(lambda connection: check_fence(PgTx(connection), fence))
                yield conn
        finally:
            # Counted once it has ended, so whatever was read while it was open counts as older.
            self._write_epoch += 1

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """One read-only transaction on one snapshot."""
        async with _transaction(self._reader) as conn:
            yield conn

    async def run_write(self, work: Work[T]) -> T:
        """`work(tx)` as one write transaction, undone if it raises. Once started, the write runs
        to its end even if the caller is cancelled: the cancellation is raised after the commit.
        Under a session lease (`current_fence`), LeaseLost, with nothing kept, once another
        process has taken the lease (store/leases.py)."""
        if self._closed:
            raise RuntimeError("the PostgreSQL store was closed")
        task = asyncio.ensure_future(self._write_unit(work))
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)
        result, cancelled = await complete_despite_cancel(task)
        if cancelled:
            raise asyncio.CancelledError
        return result

    async def run_read(self, work: Work[T]) -> T:
        """`work(tx)` in one read-only transaction (one snapshot), with the reads asked together with it."""
        async with as_store_errors(pg_store_error):
            return await self._reads.run(work)

    async def _read_batch(self, works: Sequence[Work[Any]]) -> list[Outcome[Any]]:
        # A failed statement aborts the transaction, which is then rolled back, not committed;
        # the units after it are read in the next.
        def batch(tx: Tx) -> list[Outcome[Any]]:
            outcomes = run_each(works, tx, aborted=lambda exc: isinstance(exc, DBAPIError))
            if isinstance(outcomes[-1].error, DBAPIError):
                raise _Aborted(outcomes)
            return outcomes

        try:
            return await self._units.run(batch, readonly=True)
        except _Aborted as aborted:
            return aborted.outcomes

    async def _write_unit(self, work: Work[T]) -> T:
        async with as_store_errors(pg_store_error):
            return await self._units.run(fenced(work, current_fence.get()))
