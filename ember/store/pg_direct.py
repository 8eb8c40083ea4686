"""Store units on PostgreSQL straight through asyncpg, as the SQLite engine runs them on sqlite3.

A turn on PostgreSQL runs about 26 statements in 5 transactions. Through
SQLAlchemy's asyncpg adapter each statement passes a Connection, a cursor
adapter, a Result and the adapter's own prepared-statement cache, and each
transaction a pool checkout with its events: about 0.15 ms of CPU a statement
and 0.27 ms a transaction on this project's 2-core machines, against 0.06 and
0.13 ms going to asyncpg directly. Here a unit (store/tx.py: a plain function
of one `Tx`) runs in a greenlet, as SQLAlchemy's `run_sync` would run it, and
each `tx.execute` awaits asyncpg itself:

- each `Statement` is compiled once with SQLAlchemy's asyncpg dialect (the
  same `$n` SQL and bind casts the adapter would send), its constants kept
  as arguments;
- each connection prepares a statement once and keeps it (a few hundred
  statements exist, all built at import);
- asyncpg's failures are raised as the SQLAlchemy errors the adapter raises
  (IntegrityError, InterfaceError, ...), so the stores handle both engines alike.

Migrations and the few places that need a SQLAlchemy connection keep the
engine's own pool (store/postgres.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
from asyncpg.prepared_stmt import PreparedStatement
from sqlalchemy import Float
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.exc import DatabaseError, DBAPIError, IntegrityError, InterfaceError
from sqlalchemy.util import await_only, greenlet_spawn

from ember.core.errors import StoreBusy, StoreUnavailable
from ember.store.tx import Params, Statement, Work

T = TypeVar("T")

_DIALECT = asyncpg_dialect()
_FLOAT8_OID, _TEXT_OID = 701, 25  # what a column of a type is read as, to ask SQLAlchemy whether it converts it
PREPARED_PER_CONNECTION = 512  # more than the store's statements: none is prepared twice
_MISSING = object()


@dataclass(frozen=True, slots=True)
class Compiled:
    """A statement's SQL for asyncpg, and how to make its positional arguments from named parameters."""

    sql: str
    names: tuple[str, ...]
    constants: tuple[Any, ...]  # the statement's own value for each position, or _MISSING: given at execution
    processors: tuple[Callable[[Any], Any] | None, ...]

    def parameters(self) -> set[str]:
        """The names a call gives values for."""
        return {name for name, constant in zip(self.names, self.constants, strict=True) if constant is _MISSING}

    def arguments(self, params: Params | None) -> list[Any]:
        given = params or {}
        values = []
        for name, constant, processor in zip(self.names, self.constants, self.processors, strict=True):
            if constant is _MISSING:
                try:
                    value = given[name]
                except KeyError:
                    raise KeyError(f"no value for the parameter {name!r} of: {self.sql[:120]}") from None
            else:
                value = constant
            values.append(value if processor is None else processor(value))
        return values


@functools.lru_cache(maxsize=1024)
def for_asyncpg(statement: Statement) -> Compiled:
    """`statement`'s PostgreSQL form compiled once. A column type whose values SQLAlchemy would
    convert on the way back is refused: no result processing happens here."""
    done = statement.postgresql.compile(dialect=_DIALECT)
    names = tuple(done.positiontup or ())
    binds = done.binds  # by the name each has in the SQL
    constants = tuple(_MISSING if binds[name].required else binds[name].effective_value for name in names)
    processors = done._bind_processors  # the adapter's own conversions (a bool for BOOLEAN, ...)
    for *_, column_type in done._result_columns:
        oid = _FLOAT8_OID if isinstance(column_type, Float) else _TEXT_OID
        if column_type._cached_result_processor(_DIALECT, oid) is not None:
            raise NotImplementedError(f"a {type(column_type).__name__} column needs converting: {str(done)[:120]}")
    return Compiled(str(done), names, constants, tuple(processors.get(name) for name in names))


class PgDirectTx:
    """A `Tx` on an asyncpg connection, for a unit running in a greenlet: each statement awaited in turn."""

    __slots__ = ("_connection",)
    dialect = "postgresql"

    def __init__(self, connection: PreparingConnection) -> None:
        self._connection = connection

    def execute(self, statement: Statement, params: Params | None = None) -> DirectRows:
        done = for_asyncpg(statement)
        arguments = done.arguments(params)
        try:
            prepared = self._prepared(done.sql)
            rows = await_only(prepared.fetch(*arguments))
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            raise self._failed(exc, done.sql, arguments) from exc
        return DirectRows(rows, prepared.get_statusmsg())

    def executemany(self, statement: Statement, rows: Sequence[Params]) -> None:
        if not rows:
            return
        done = for_asyncpg(statement)
        arguments = [done.arguments(row) for row in rows]
        try:
            await_only(self._prepared(done.sql).executemany(arguments))
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            raise self._failed(exc, done.sql, arguments) from exc

    def _prepared(self, sql: str) -> PreparedStatement:
        kept = self._connection.kept
        statement = kept.get(sql)
        if statement is None:
            statement = kept[sql] = await_only(self._connection.prepare(sql))
            if len(kept) > PREPARED_PER_CONNECTION:
                kept.popitem(last=False)
        return statement

    def _failed(self, exc: BaseException, sql: str, arguments: Any) -> DBAPIError:
        if isinstance(exc, asyncpg.InvalidCachedStatementError):
            # A migration changed a table under the kept plans: prepare them again from the next unit on.
            self._connection.kept.clear()
        return as_sqlalchemy(exc, sql, arguments)


class DirectRows:
    """What a statement gave back, as `Rows` (store/tx.py): plain tuples, and the count of rows it changed."""

    __slots__ = ("_rows", "_status")

    def __init__(self, rows: list[asyncpg.Record], status: str | None) -> None:
        self._rows = rows
        self._status = status or ""

    @property
    def rowcount(self) -> int:
        # "UPDATE 3", "DELETE 0", "INSERT 0 1", "SELECT 5": the count is the last word
        last = self._status.rpartition(" ")[2]
        return int(last) if last.isdigit() else -1

    def fetchone(self) -> tuple[Any, ...] | None:
        return tuple(self._rows[0]) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self._rows]


class PreparingConnection(asyncpg.Connection):  # type: ignore[misc]
    """An asyncpg connection that keeps each statement it prepared, for its life (PgDirectTx)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept: OrderedDict[str, PreparedStatement] = OrderedDict()


class PgUnits:
    """Units run in transactions on connections of their own, at most `max_size` at once.

    The connections are pooled here rather than by asyncpg's pool, whose release would
    forget every prepared statement (and reset the session, a round trip). `connect` holds
    asyncpg.connect's arguments; a connection is opened when none is idle, and one idle for
    longer than `idle_ping_s` is pinged before it is used, so a server restart fails no unit."""

    def __init__(self, connect: dict[str, Any], *, max_size: int, acquire_timeout_s: float,
                 idle_ping_s: float) -> None:
        self._connect = connect
        self._acquire_timeout_s = acquire_timeout_s
        self._idle_ping_s = idle_ping_s
        self._slots = asyncio.Semaphore(max_size)
        self._idle: list[tuple[PreparingConnection, float]] = []  # the most recently used last
        self._closed = False

    async def run(self, unit: Work[T], *, readonly: bool = False) -> T:
        """`unit(tx)` in one transaction: read-only at REPEATABLE READ (one snapshot) or a write
        at READ COMMITTED; committed when it returns, rolled back when it raises."""
        connection = await self._acquire()
        try:
            transaction = connection.transaction(isolation="repeatable_read", readonly=True) if readonly \
                else connection.transaction()
            try:
                async with transaction:
                    return await greenlet_spawn(unit, PgDirectTx(connection))
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
                raise as_sqlalchemy(exc, "BEGIN/COMMIT", None) from exc
        finally:
            self._release(connection)

    async def close(self) -> None:
        """Close the idle connections; one in use is closed when its unit ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection, _ in idle:
            await connection.close()

    async def _acquire(self) -> PreparingConnection:
        if self._closed:
            raise RuntimeError("the PostgreSQL store was closed")
        try:
            await asyncio.wait_for(self._slots.acquire(), self._acquire_timeout_s)
        except TimeoutError as exc:
            raise StoreBusy() from exc  # this process's other units held every connection
        try:
            while self._idle:
                connection, since = self._idle.pop()
                if not connection.is_closed() and await self._alive(connection, since):
                    return connection
            return await asyncpg.connect(**self._connect, connection_class=PreparingConnection)  # type: ignore[no-any-return]
        except BaseException as exc:
            self._slots.release()
            if isinstance(exc, (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)):
                raise StoreUnavailable(f"cannot connect to the PostgreSQL store: {exc}") from exc
            raise

    async def _alive(self, connection: PreparingConnection, idle_since: float) -> bool:
        if time.monotonic() - idle_since <= self._idle_ping_s:
            return True
        try:
            await connection.execute("SELECT 1")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            connection.terminate()
            return False
        return True

    def _release(self, connection: PreparingConnection) -> None:
        self._slots.release()
        if connection.is_closed():
            return
        if self._closed or connection.is_in_transaction():  # a rollback that failed: start afresh
            connection.terminate()
            return
        self._idle.append((connection, time.monotonic()))


def as_sqlalchemy(exc: BaseException, sql: str, arguments: Any) -> DBAPIError:
    """asyncpg's error as the SQLAlchemy error its adapter would have raised."""
    if isinstance(exc, (asyncpg.InterfaceError, OSError, asyncpg.PostgresConnectionError)):
        return InterfaceError(sql, arguments, exc, connection_invalidated=True)
    if (getattr(exc, "sqlstate", None) or "").startswith("23"):  # integrity constraint violation
        return IntegrityError(sql, arguments, exc)
    return DatabaseError(sql, arguments, exc)
