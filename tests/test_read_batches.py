"""Reads asked together share one transaction (store/batches.py), on both engines: each still gets
its own result, fails alone, and sees every write committed before it was asked."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ember.store.postgres import READ_BATCHES_IN_FLIGHT, PostgresDatabase
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tx import Statement, Tx
from tests.pgserver import ENGINES, engine_database

_ADD = Statement("INSERT INTO traces VALUES (:turn_id, 's', 'ok', NULL, '{}', 0, 0)")
_COUNT = Statement("SELECT count(*) FROM traces")
_ECHO = Statement("SELECT CAST(:value AS INTEGER)")
_NO_SUCH_TABLE = Statement("SELECT * FROM no_such_table")
# The transaction a unit runs in, on PostgreSQL: its server process and the instant it began.
_TRANSACTION = Statement("SELECT pg_backend_pid(), now()")


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SqliteDatabase | PostgresDatabase]:
    database = await engine_database(request.param, request, tmp_path)
    yield database
    await database.close()


def echo(value: int):  # type: ignore[no-untyped-def]
    return lambda tx: tx.execute(_ECHO, {"value": value}).fetchone()[0]


def count(tx: Tx) -> int:
    return int(tx.execute(_COUNT).fetchone()[0])


def failing(tx: Tx) -> None:
    tx.execute(_NO_SUCH_TABLE)


async def test_reads_asked_together_each_get_their_own_result(db: SqliteDatabase | PostgresDatabase) -> None:
    assert await asyncio.gather(*(db.run_read(echo(n)) for n in range(50))) == list(range(50))


async def test_reads_asked_together_share_one_transaction_on_postgresql(
        db: SqliteDatabase | PostgresDatabase) -> None:
    if not isinstance(db, PostgresDatabase):
        pytest.skip("SQLite's reader thread tells no transaction apart")
    seen = await asyncio.gather(*(db.run_read(lambda tx: tuple(tx.execute(_TRANSACTION).fetchone()))
                                  for _ in range(20)))
    assert len(set(seen)) == 1, seen


async def test_a_failing_read_fails_alone_and_the_reads_after_it_still_run(
        db: SqliteDatabase | PostgresDatabase) -> None:
    outcomes = await asyncio.gather(db.run_read(echo(1)), db.run_read(failing), db.run_read(echo(3)),
                                    db.run_read(lambda tx: 1 / 0), db.run_read(echo(5)), return_exceptions=True)
    assert outcomes[0::2] == [1, 3, 5], outcomes
    assert isinstance(outcomes[1], Exception) and "no_such_table" in str(outcomes[1])
    assert isinstance(outcomes[3], ZeroDivisionError)
    assert await db.run_read(echo(6)) == 6  # the connection the failure aborted is usable again


async def test_a_read_sees_every_write_committed_before_it_was_asked(
        db: SqliteDatabase | PostgresDatabase) -> None:
    """Writers and readers interleaved: a read asked after a commit, whatever batch it joins, counts it."""
    async def write_then_read(n: int) -> None:
        await db.run_write(lambda tx: tx.execute(_ADD, {"turn_id": f"t{n}"}))
        committed = await db.run_read(lambda tx: {row[0] for row in tx.execute(
            Statement("SELECT turn_id FROM traces")).fetchall()})
        assert f"t{n}" in committed

    async def reader() -> None:
        for _ in range(20):
            await db.run_read(count)

    await asyncio.gather(*(write_then_read(n) for n in range(30)), *(reader() for _ in range(3)))
    assert await db.run_read(count) == 30


async def test_a_cancelled_reader_leaves_the_others_of_its_batch_their_results(
        db: SqliteDatabase | PostgresDatabase) -> None:
    """Slow reads hold up every batch the engine runs at once; of the reads queued behind them, one
    is cancelled; the rest are answered, in one batch."""
    go_on = threading.Event()

    def slow(tx: Tx) -> int:
        if tx.dialect == "postgresql":  # its units run on the event loop's thread: the server waits
            return int(tx.execute(Statement("SELECT 0 FROM pg_sleep(0.5)")).fetchone()[0])
        go_on.wait(10)  # the reader thread waits
        return 0

    slots = 1 if isinstance(db, SqliteDatabase) else READ_BATCHES_IN_FLIGHT
    blocking = []
    for _ in range(slots):  # one at a time, so each starts a batch of its own
        blocking.append(asyncio.ensure_future(db.run_read(slow)))
        await asyncio.sleep(0.05)
    queued = [asyncio.ensure_future(db.run_read(echo(n))) for n in range(1, 6)]
    await asyncio.sleep(0.01)
    queued[2].cancel()
    go_on.set()
    assert await asyncio.gather(*blocking) == [0] * slots
    results = await asyncio.gather(*queued, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    assert [r for i, r in enumerate(results) if i != 2] == [1, 2, 4, 5]
    assert await db.run_read(echo(7)) == 7
