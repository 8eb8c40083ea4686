"""The session store: append-only rows, protocol-valid reloads (I3), quarantine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, insert, inspect, select, text, update

from ember.core.errors import StoreConflict, StoreError
from ember.core.messages import Message, Role, ToolCall
from ember.store import schema
from ember.store.migrations import SCHEMA_VERSION
from ember.store.sessions import INTERRUPTED_RESULT, SqlSessionStore
from ember.store.sqlite.database import SqliteDatabase
from tests.pgserver import ENGINES, engine_database


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SqliteDatabase]:
    """Every test of the session store runs on SQLite and on PostgreSQL."""
    database = await engine_database(request.param, request, tmp_path)
    yield database  # type: ignore[misc]
    await database.close()


@pytest.fixture
def store(db: SqliteDatabase) -> SqlSessionStore:
    return SqlSessionStore(db)


def call(call_id: str, name: str = "read_file") -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments='{"path": "a.txt"}')


def tool_turn() -> list[Message]:
    """seq 0 user, 1 assistant calling c1, 2 its result, 3 the final answer."""
    return [Message.user("go"), Message.assistant("", tool_calls=(call("c1"),)),
            Message.tool_result("c1", "ok"), Message.assistant("done")]


async def row_count(db: SqliteDatabase, key: str) -> int:
    async with db.read() as conn:
        m = schema.messages
        return (await conn.execute(select(func.count()).where(m.c.session_key == key))).scalar_one()


async def insert_raw(db: SqliteDatabase, key: str, seq: int, **columns: object) -> None:
    """Write a row the way a crash or another program could have left it."""
    row = {"session_key": key, "seq": seq, "role": "assistant", "content": "", "created_at": 0.0, **columns}
    async with db.write() as conn:
        await conn.execute(insert(schema.messages).values(**row))
        await conn.execute(update(schema.sessions).where(schema.sessions.c.key == key).values(next_seq=seq + 1))


def assert_protocol_valid(messages: list[Message]) -> None:
    """Every tool_calls message is followed by exactly its results; no stray results."""
    i = 0
    while i < len(messages):
        message = messages[i]
        assert message.role is not Role.TOOL, f"tool result without its call at seq {message.seq}"
        i += 1
        if message.has_tool_calls:
            expected = [c.id for c in message.tool_calls]
            got = [m.tool_call_id for m in messages[i : i + len(expected)]]
            assert sorted(got, key=str) == sorted(expected), f"results {got} do not answer calls {expected}"
            assert all(m.role is Role.TOOL for m in messages[i : i + len(expected)])
            i += len(expected)


async def test_append_numbers_messages_and_survives_reopen(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "ember.db")
    await db.open()
    store = SqlSessionStore(db)
    session = await store.load("s")
    await store.append(session, [Message.user("one")])
    await store.append(session, [Message.assistant("two"), Message.user("three")])
    assert [m.seq for m in session.messages] == [0, 1, 2]
    await db.close()

    reopened = SqliteDatabase(tmp_path / "ember.db")
    await reopened.open()
    loaded = await SqlSessionStore(reopened).load("s")
    assert [(m.role, m.content, m.seq) for m in loaded.messages] == [
        (Role.USER, "one", 0), (Role.ASSISTANT, "two", 1), (Role.USER, "three", 2)
    ]
    assert loaded.next_seq == 3
    await reopened.close()


async def test_assistant_content_is_stripped_of_thinking_at_the_storage_boundary(store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, [
        Message.user("<think>users may write this</think>kept"),
        Message.assistant("<think>plan</think>Calling a tool.", tool_calls=(call("c1"),)),
        Message.tool_result("c1", "file text"),
        Message.assistant("<thought>x</thought>Done"),
    ])
    stored = await store.history("s")
    assert [m.content for m in stored] == [
        "<think>users may write this</think>kept", "Calling a tool.", "file text", "Done"
    ]


async def test_interrupted_after_the_user_message_reloads_valid(store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, [Message.user("hello")])
    # The process dies here: no assistant message was ever written.
    reloaded = await store.load("s")
    assert [m.role for m in reloaded.messages] == [Role.USER]
    await store.append(reloaded, [Message.user("are you there?")])
    assert_protocol_valid((await store.load("s")).messages)


async def test_interrupted_between_a_tool_call_and_its_results_is_closed_and_written_back(
    db: SqliteDatabase, store: SqlSessionStore
) -> None:
    session = await store.load("s")
    await store.append(session, [Message.user("read a.txt and b.txt")])
    await insert_raw(db, "s", 1, tool_calls='[{"id": "c1", "name": "read_file", "arguments": "{}"},'
                                             ' {"id": "c2", "name": "read_file", "arguments": "{}"}]')
    reloaded = await store.load("s")
    assert_protocol_valid(reloaded.messages)
    assert [m.content for m in reloaded.messages[2:]] == [INTERRUPTED_RESULT, INTERRUPTED_RESULT]
    assert reloaded.next_seq == 4
    # The repair is in the store now: the rows exist and a second load writes nothing.
    assert await row_count(db, "s") == 4
    again = await store.load("s")
    assert await row_count(db, "s") == 4
    assert again.messages == reloaded.messages
    # The session goes on normally after the repair.
    await store.append(again, [Message.user("next")])
    assert [m.seq for m in (await store.load("s")).messages] == [0, 1, 2, 3, 4]


async def test_partial_results_get_only_the_missing_ones(db: SqliteDatabase, store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, [Message.user("go")])
    await insert_raw(db, "s", 1, tool_calls='[{"id": "c1", "name": "a", "arguments": "{}"},'
                                             ' {"id": "c2", "name": "b", "arguments": "{}"}]')
    await insert_raw(db, "s", 2, role="tool", content="result one", tool_call_id="c1")
    reloaded = await store.load("s")
    assert_protocol_valid(reloaded.messages)
    assert [(m.tool_call_id, m.content) for m in reloaded.messages[2:]] == [
        ("c1", "result one"), ("c2", INTERRUPTED_RESULT)
    ]


async def test_unparseable_row_is_quarantined_and_the_rest_kept(db: SqliteDatabase, store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, [Message.user("first"), Message.assistant("reply"), Message.user("second")])
    async with db.write() as conn:
        await conn.execute(text("UPDATE messages SET role = 'wizard' WHERE seq = 1"))
    reloaded = await store.load("s")
    assert [m.content for m in reloaded.messages] == ["first", "second"]
    [aside] = await store.quarantined()
    assert (aside.session_key, aside.seq) == ("s", 1)
    assert "wizard" in aside.raw and "reply" in aside.raw
    # Appending continues after the highest seq, never over the gap.
    await store.append(reloaded, [Message.assistant("third")])
    assert [m.seq for m in await store.history("s")] == [0, 2, 3]


async def test_quarantined_result_leaves_room_for_a_synthetic_one(db: SqliteDatabase, store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, tool_turn())
    async with db.write() as conn:
        await conn.execute(text("UPDATE messages SET tool_calls = 'not json' WHERE seq = 1"))
    reloaded = await store.load("s")
    # The call is unreadable, so its result has no call: both are set aside.
    assert [m.content for m in reloaded.messages] == ["go", "done"]
    assert {row.seq for row in await store.quarantined()} == {1, 2}

    other = await store.load("t")
    await store.append(other, tool_turn())
    async with db.write() as conn:
        await conn.execute(text("UPDATE messages SET role = 'bogus' WHERE session_key = 't' AND seq = 2"))
    fixed = await store.load("t")
    assert_protocol_valid(fixed.messages)
    assert [(m.seq, m.content) for m in fixed.messages] == [(0, "go"), (1, ""), (2, INTERRUPTED_RESULT), (3, "done")]


async def test_a_second_writer_is_detected_not_silently_merged(store: SqlSessionStore) -> None:
    first = await store.load("s")
    second = await store.load("s")
    await store.append(first, [Message.user("from A")])
    with pytest.raises(StoreConflict):
        await store.append(second, [Message.user("from B")])
    assert [m.content for m in await store.history("s")] == ["from A"]


async def test_boundary_moves_forward_only_by_compare_and_set(store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, [Message.user(str(i)) for i in range(10)])
    assert await store.advance_boundary("s", expected=0, new=6, summary="first six")
    assert not await store.advance_boundary("s", expected=0, new=8, summary="stale")
    assert not await store.advance_boundary("s", expected=6, new=4, summary="backwards")
    assert not await store.advance_boundary("s", expected=6, new=11, summary="past the end")
    loaded = await store.load("s")
    assert loaded.last_consolidated == 6
    assert [m.content for m in loaded.messages] == ["6", "7", "8", "9"]
    assert len(await store.history("s")) == 10


async def test_a_boundary_inside_a_tool_chain_is_refused(store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, tool_turn())
    with pytest.raises(ValueError, match="split a tool call"):
        await store.advance_boundary("s", expected=0, new=2, summary="x")
    assert (await store.load("s")).last_consolidated == 0
    assert [m.seq for m in await store.history("s")] == [0, 1, 2, 3]


async def test_migrations_are_idempotent_and_match_the_query_schema(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "ember.db")
    await db.open()
    await db.open()  # a second start applies nothing
    async with db.read() as conn:
        versions = (await conn.execute(text("SELECT version FROM schema_version"))).scalars().all()
        assert versions == list(range(1, SCHEMA_VERSION + 1))
        for table in schema.metadata.sorted_tables:
            columns = await conn.run_sync(
                lambda sync, name=table.name: [c["name"] for c in inspect(sync).get_columns(name)]
            )
            assert columns == [c.name for c in table.columns], table.name
        mode = (await conn.execute(text("PRAGMA journal_mode"))).scalar_one()
        assert mode == "wal"
    await db.close()


async def test_migrations_report_their_progress_only_when_some_are_pending(tmp_path: Path) -> None:
    """What `ember`'s bar over an upgrade follows: each migration of a new store, nothing on the next start."""
    fresh: list[tuple[int, int]] = []
    db = SqliteDatabase(tmp_path / "ember.db")
    await db.open(lambda done, pending: fresh.append((done, pending)))
    await db.close()
    assert fresh == [(done, SCHEMA_VERSION) for done in range(SCHEMA_VERSION + 1)]
    again: list[tuple[int, int]] = []
    db = SqliteDatabase(tmp_path / "ember.db")
    await db.open(lambda done, pending: again.append((done, pending)))
    await db.close()
    assert again == []


async def test_newer_schema_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "ember.db")
    await db.open()
    async with db.write() as conn:
        await conn.execute(text("INSERT INTO schema_version VALUES (:v, 0)"), {"v": SCHEMA_VERSION + 1})
    await db.close()
    with pytest.raises(StoreError, match="newer than this Ember"):
        await SqliteDatabase(tmp_path / "ember.db").open()


async def test_a_cancelled_append_still_commits_before_the_cancellation_arrives(store: SqlSessionStore) -> None:
    """The turn's lease is released only after its write: cancelling mid-commit
    neither loses the message nor lets the next turn write beside it."""
    session = await store.load("s")
    writing = asyncio.create_task(store.append(session, [Message.user("in flight")]))
    await asyncio.sleep(0)  # the write has started on the database thread
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert [m.content for m in await store.history("s")] == ["in flight"]
    assert session.next_seq == 1 and session.messages[-1].content == "in flight"
    await store.append(session, [Message.assistant("next")])  # the session object is still current
    assert [m.seq for m in await store.history("s")] == [0, 1]


async def test_concurrent_loads_that_both_repair_do_not_fail(db: SqliteDatabase, store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, [Message.user("go")])
    await insert_raw(db, "s", 1, tool_calls='[{"id": "c1", "name": "a", "arguments": "{}"}]')
    loads = await asyncio.gather(*(store.load("s") for _ in range(5)))
    assert all([m.seq for m in loaded.messages] == [0, 1, 2] for loaded in loads)
    assert await row_count(db, "s") == 3


async def test_history_skips_unreadable_rows_and_reports_them(db: SqliteDatabase, store: SqlSessionStore) -> None:
    session = await store.load("s")
    await store.append(session, [Message.user(str(i)) for i in range(6)])
    assert await store.advance_boundary("s", expected=0, new=4, summary="older")
    async with db.write() as conn:  # a row before the boundary: no load will ever look at it
        await conn.execute(text("UPDATE messages SET role = 'alien' WHERE seq = 1"))
    assert [m.content for m in await store.history("s")] == ["0", "2", "3", "4", "5"]
    [bad] = await store.unreadable()
    assert (bad.session_key, bad.seq) == ("s", 1) and "alien" in bad.reason
