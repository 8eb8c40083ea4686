"""The one-hop way into the database, and the session windows kept between turns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from sqlalchemy import bindparam, select, text, update
from sqlalchemy.exc import IntegrityError

from ember.core.errors import StoreConflict
from ember.core.messages import Message
from ember.store import schema
from ember.store.sessions import SqlSessionStore
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tx import Statement, Tx, compiled

_TRACE = Statement("INSERT INTO traces VALUES (:turn_id, 's', 'ok', NULL, '{}', 0, 0)")
_TURN_IDS = Statement("SELECT turn_id FROM traces")


@pytest.fixture
async def other(tmp_path: Path, db: SqliteDatabase) -> AsyncIterator[SqlSessionStore]:
    """The same file opened by a second SqliteDatabase: another Ember process, as far as caches can tell."""
    second = SqliteDatabase(db.path)
    await second.open()
    yield SqlSessionStore(second)
    await second.close()


def contents(messages: list[Message]) -> list[str]:
    return [m.content for m in messages]


async def test_a_failed_write_rolls_back_and_raises_sqlalchemys_error(db: SqliteDatabase) -> None:
    def twice(tx: Tx) -> None:
        for _ in range(2):
            tx.execute(_TRACE, {"turn_id": "t"})

    with pytest.raises(IntegrityError):
        await db.run_write(twice)
    assert await db.run_read(lambda tx: tx.execute(Statement("SELECT count(*) FROM traces")).fetchone()[0]) == 0


async def test_writes_queued_together_commit_together_yet_fail_alone(db: SqliteDatabase) -> None:
    def trace(turn_id: str, *, then_fail: BaseException | None = None) -> Callable[[Tx], str]:
        def work(tx: Tx) -> str:
            tx.execute(_TRACE, {"turn_id": turn_id})
            if then_fail is not None:
                raise then_fail
            return turn_id
        return work

    first = await db.run_write(trace("taken"))
    outcomes = await asyncio.gather(
        db.run_write(trace("a")),
        db.run_write(trace("b", then_fail=StoreConflict("b lost a race"))),
        db.run_write(trace("taken")),  # the primary key is taken: sqlite3's error, as SQLAlchemy's
        db.run_write(trace("c")),
        return_exceptions=True,
    )
    assert first == "taken" and outcomes[0] == "a" and outcomes[3] == "c"
    assert isinstance(outcomes[1], StoreConflict) and isinstance(outcomes[2], IntegrityError)
    stored = await db.run_read(lambda tx: [row[0] for row in tx.execute(_TURN_IDS).fetchall()])
    assert sorted(stored) == ["a", "c", "taken"]


async def test_a_queued_write_is_committed_before_its_cancellation_is_raised(db: SqliteDatabase) -> None:
    def slow(tx: Tx) -> None:
        time.sleep(0.05)
        tx.execute(_TRACE, {"turn_id": "slow"})

    writing = asyncio.create_task(db.run_write(slow))
    queued = asyncio.create_task(db.run_write(lambda tx: tx.execute(_TRACE, {"turn_id": "queued"})))
    await asyncio.sleep(0.01)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await writing
    stored = await db.run_read(lambda tx: [row[0] for row in tx.execute(_TURN_IDS).fetchall()])
    assert sorted(stored) == ["queued", "slow"]


def test_constants_are_written_into_the_statement() -> None:
    o = schema.outbox
    sql = compiled(update(o).where(o.c.kind == "final", o.c.delivery_id == bindparam("id"))
                   .values(attempts=o.c.attempts + 1))
    assert "'final'" in sql and "attempts + 1" in sql and ":id" in sql
    assert ":kind" not in sql and ":attempts" not in sql
    assert "LIMIT 1 OFFSET 0" in compiled(select(o).limit(1))


async def test_a_kept_window_sees_appends_made_by_another_process(db: SqliteDatabase, other: SqlSessionStore) -> None:
    store = SqlSessionStore(db)
    session = await store.load("s")
    await store.append(session, [Message.user("one")])
    assert contents((await store.load("s")).messages) == ["one"]
    theirs = await other.load("s")
    await other.append(theirs, [Message.assistant("two")])
    mine = await store.load("s")
    assert contents(mine.messages) == ["one", "two"] and mine.next_seq == 2
    await store.append(mine, [Message.user("three")])
    assert contents((await store.load("s")).messages) == ["one", "two", "three"]


async def test_a_kept_window_follows_a_boundary_moved_by_another_process(db: SqliteDatabase,
                                                                         other: SqlSessionStore) -> None:
    store = SqlSessionStore(db)
    session = await store.load("s")
    await store.append(session, [Message.user(str(i)) for i in range(6)])
    assert await other.advance_boundary("s", expected=0, new=4, summary="older")
    loaded = await store.load("s")
    assert loaded.last_consolidated == 4 and contents(loaded.messages) == ["4", "5"]


async def test_a_failed_compare_and_set_drops_the_kept_window(db: SqliteDatabase, other: SqlSessionStore) -> None:
    store = SqlSessionStore(db)
    stale = await store.load("s")
    await store.append(stale, [Message.user("one")])
    theirs = await other.load("s")
    await other.append(theirs, [Message.assistant("theirs")])
    with pytest.raises(StoreConflict):
        await store.append(stale, [Message.assistant("mine")])
    assert contents((await store.load("s")).messages) == ["one", "theirs"]


async def test_rows_changed_through_write_are_read_again(db: SqliteDatabase) -> None:
    store = SqlSessionStore(db)
    session = await store.load("s")
    await store.append(session, [Message.user("before")])
    await store.load("s")
    async with db.write() as conn:  # the head does not move: only the epoch tells
        await conn.execute(text("UPDATE messages SET content = 'after' WHERE seq = 0"))
    assert contents((await store.load("s")).messages) == ["after"]


async def test_a_session_loaded_twice_gives_independent_objects(db: SqliteDatabase) -> None:
    store = SqlSessionStore(db)
    session = await store.load("s")
    await store.append(session, [Message.user("one")])
    first, second = await store.load("s"), await store.load("s")
    first.messages.append(Message.user("only in memory"))
    first.metadata["x"] = "y"
    assert contents(second.messages) == ["one"] and "x" not in second.metadata
    assert contents((await store.load("s")).messages) == ["one"]


async def test_appends_extend_the_kept_window_without_copying_it(db: SqliteDatabase) -> None:
    """A commit's cost must not grow with the window (bench/commit_cost.py measures it)."""
    store = SqlSessionStore(db)
    session = await store.load("s")
    await store.append(session, [Message.user(str(i)) for i in range(1000)])
    rows = store._windows.get("s", db.write_epoch).rows
    old_view = await store.load("s")
    for i in range(3):
        await store.append(session, [Message.assistant(f"answer {i}")])
    window = store._windows.get("s", db.write_epoch)
    assert window is not None and window.rows is rows  # extended in place, not copied
    assert len(old_view.messages) == 1000  # a session loaded before is not touched
    assert contents((await store.load("s")).messages)[-3:] == ["answer 0", "answer 1", "answer 2"]


async def test_a_write_epoch_counts_finished_write_transactions(db: SqliteDatabase) -> None:
    before = db.write_epoch
    async with db.write() as conn:
        await conn.execute(update(schema.sessions).values(updated_at=0))
        assert db.write_epoch == before  # not yet: what is read now may still change
    assert db.write_epoch == before + 1
