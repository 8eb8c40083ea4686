"""Whole transactions in one hop to a thread that owns a stdlib sqlite3 connection.

Through aiosqlite every statement, BEGIN and COMMIT included, is a round trip
between the event loop and the connection's thread; a three-statement commit
makes about a dozen thread switches. Here the caller hands over the whole
transaction as one synchronous function, which runs start to finish on the
connection's own thread: one switch there, one back.

The function gets a `SqliteTx` (the store's `Tx`, store/tx.py): each
`Statement` runs as its SQLite text, compiled once (`tx.compiled`); rows come back
as plain tuples in the order of the selected columns.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError

from ember.store.batches import Outcome, run_each
from ember.store.tx import Params, Statement, Work

T = TypeVar("T")

def connect(path: Path, *, synchronous: str, busy_timeout_ms: int) -> sqlite3.Connection:
    """A connection set up like the engines' (WAL, `synchronous`, busy timeout); no implicit transactions."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_ms / 1000)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
    except sqlite3.Error:
        conn.close()
        raise
    return conn


class SqliteTx:
    """A `Tx` on a sqlite3 connection: each statement as its SQLite text, with its named parameters."""

    __slots__ = ("connection",)
    dialect = "sqlite"

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection  # for what only SQLite has (a trace callback); stores go through execute

    def execute(self, statement: Statement, params: Params | None = None) -> sqlite3.Cursor:
        return self.connection.execute(statement.sqlite_sql, params or {})

    def executemany(self, statement: Statement, rows: Sequence[Params]) -> None:
        self.connection.executemany(statement.sqlite_sql, rows)


class ThreadConnection:
    """One sqlite3 connection, opened, used and closed on one dedicated thread.

    `read(works)` runs a batch of units in one read transaction. `write(works)`
    runs a batch of units in one write transaction, each unit in its own
    savepoint, so a unit that raises is undone alone and the others still
    commit, together, under one COMMIT (one fsync). sqlite3's own errors are
    raised as SQLAlchemy's (IntegrityError, OperationalError, ...), so callers
    handle both paths of the store alike.

    Both return a future, not a coroutine: it can be shielded without
    wrapping it in a task. The thread is the connection's own, fed by a
    queue, rather than a ThreadPoolExecutor: each hop then costs the event
    loop half the CPU (no concurrent.futures.Future to create and chain).
    It is a daemon thread: a process that exits without closing the
    database loses at most a transaction nobody was told had committed.
    """

    def __init__(self, path: Path, *, synchronous: str, busy_timeout_ms: int, name: str) -> None:
        self._path = path
        self._synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started by the first job
        self._tx: SqliteTx | None = None  # its connection is touched only on the thread
        self._closed = False

    def read(self, works: Sequence[Work[Any]]) -> asyncio.Future[list[Outcome[Any]]]:
        """The outcomes of the batch's units that ran (store/batches.py's `run_each`)."""
        return self._submit(self._read, works)

    def write(self, works: Sequence[Work[Any]]) -> asyncio.Future[list[Outcome[Any]]]:
        """The batch's outcomes, in order, once committed; raises when nothing of it could be."""
        return self._submit(self._write, works)

    async def close(self) -> None:
        """Close the connection on its thread and end the thread; a second close does nothing."""
        if self._closed:
            return
        self._closed = True  # from here on, no job is taken: the close is the last one
        if self._thread is not None:
            closed = self._enqueue(self._close, None)
            self._jobs.put(None)
            await closed

    def _submit(self, fn: Callable[[Any], T], argument: Any) -> asyncio.Future[T]:
        if self._closed:
            raise RuntimeError(f"{self._name}: the database was closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        return self._enqueue(fn, argument)

    def _enqueue(self, fn: Callable[[Any], T], argument: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put(_Job(fn, argument, future, loop))
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                outcome = Outcome(job.fn(job.argument))
            except BaseException as exc:  # the caller's to handle, on its loop
                outcome = Outcome(error=exc)
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody is waiting any more
                job.loop.call_soon_threadsafe(_settle, job.future, outcome)

    def _opened(self) -> SqliteTx:
        """The connection's `Tx`, the connection opened on first use."""
        if self._tx is None:
            try:
                conn = connect(self._path, synchronous=self._synchronous, busy_timeout_ms=self._busy_timeout_ms)
            except sqlite3.Error as exc:  # a file that is not a database fails here, on its first statement
                raise translated(exc) from exc
            self._tx = SqliteTx(conn)
        return self._tx

    def _read(self, works: Sequence[Work[Any]]) -> list[Outcome[Any]]:
        tx = self._opened()
        conn = tx.connection
        try:
            conn.execute("BEGIN")
            try:
                outcomes = run_each(works, tx, aborted=lambda _: not conn.in_transaction)
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise translated(exc) from exc
        return [Outcome(error=translated(o.error)) if isinstance(o.error, sqlite3.Error) else o for o in outcomes]

    def _write(self, works: Sequence[Work[Any]]) -> list[Outcome[Any]]:
        tx = self._opened()
        conn = tx.connection
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                # A unit alone needs no savepoint: if it raises, the whole transaction is undone.
                outcomes = [Outcome(works[0](tx))] if len(works) == 1 else [_unit(tx, work) for work in works]
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise translated(exc) from exc
        return outcomes

    def _close(self, _: None) -> None:
        if self._tx is not None:
            self._tx.connection.close()
            self._tx = None


@dataclass(frozen=True, slots=True)
class _Job:
    fn: Callable[[Any], Any]
    argument: Any
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def _settle(future: asyncio.Future[Any], outcome: Outcome[Any]) -> None:
    if future.cancelled():
        return
    if outcome.error is not None:
        future.set_exception(outcome.error)
    else:
        future.set_result(outcome.value)


def _unit(tx: SqliteTx, work: Work[Any]) -> Outcome[Any]:
    """One unit of a batch, in a savepoint: undone alone if it raises."""
    conn = tx.connection
    conn.execute("SAVEPOINT unit")
    try:
        value = work(tx)
    except Exception as exc:
        if not conn.in_transaction:
            raise  # SQLite ended the whole transaction (disk full, I/O error): nothing of the batch stands
        conn.execute("ROLLBACK TO unit")
        conn.execute("RELEASE unit")
        return Outcome(error=translated(exc) if isinstance(exc, sqlite3.Error) else exc)
    conn.execute("RELEASE unit")
    return Outcome(value)


def translated(exc: BaseException) -> BaseException:
    """sqlite3's error as the SQLAlchemy error the engines would have raised."""
    if isinstance(exc, sqlite3.Error):
        return DBAPIError.instance(None, None, exc, sqlite3.Error)
    return exc
