"""The store on PostgreSQL (store/postgres.py), against a real throwaway server (tests/pgserver.py):
the migrations, the units of work, their errors and their behaviour under contention."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import bindparam, inspect, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from ember.core.errors import StoreBusy, StoreUnavailable
from ember.store import schema
from ember.store.migrations import SCHEMA_VERSION
from ember.store.postgres import PostgresDatabase
from ember.store.segment import index_text, owner_token
from ember.store.tx import Statement, Tx

if TYPE_CHECKING:
    from tests.pgserver import PgServer


# Columns PostgreSQL has beyond schema.py's: the vector as pgvector's, for a search by the database.
PG_ONLY_COLUMNS = {"memory_vectors": ["embedding", "window_embedding"]}

_BUMP = Statement("UPDATE counters SET n = n + 1 WHERE id = 1")
_HOLD = Statement("SELECT pg_sleep(:s)")
_READ_N = Statement("SELECT n FROM counters WHERE id = 1")
_READ_SESSION_KEYS = Statement("SELECT key FROM sessions WHERE next_seq > 0")


@pytest.fixture
async def db(pg_store_database: str) -> AsyncIterator[PostgresDatabase]:
    database = PostgresDatabase(pg_store_database)
    await database.open()
    async with database.write() as conn:
        await conn.execute(text("CREATE TABLE counters (id INTEGER PRIMARY KEY, n BIGINT NOT NULL)"))
        await conn.execute(text("INSERT INTO counters VALUES (1, 0)"))
    yield database
    await database.close()


async def _versions(db: PostgresDatabase) -> list[int]:
    async with db.read() as conn:
        return list((await conn.execute(text("SELECT version FROM schema_version ORDER BY version"))).scalars())


# -- migrations ------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Did not recognize type 'vector'")  # SQLAlchemy has no pgvector type
async def test_migrations_run_from_empty_to_the_latest_and_a_second_open_applies_nothing(pg_database: str) -> None:
    steps: list[tuple[int, int]] = []
    db = PostgresDatabase(pg_database)
    await db.open(lambda done, pending: steps.append((done, pending)))
    await db.close()
    assert steps == [(done, SCHEMA_VERSION) for done in range(SCHEMA_VERSION + 1)]
    again: list[tuple[int, int]] = []
    db = PostgresDatabase(pg_database)
    await db.open(lambda done, pending: again.append((done, pending)))
    try:
        assert again == []
        assert await _versions(db) == list(range(1, SCHEMA_VERSION + 1))
        async with db.read() as conn:
            for table in schema.metadata.sorted_tables:
                columns = await conn.run_sync(
                    lambda sync, name=table.name: [c["name"] for c in inspect(sync).get_columns(name)])
                assert columns == [c.name for c in table.columns] + PG_ONLY_COLUMNS.get(table.name, []), table.name
    finally:
        await db.close()


async def test_processes_opening_a_new_database_together_migrate_it_once(pg_database: str) -> None:
    first, second = PostgresDatabase(pg_database), PostgresDatabase(pg_database)
    await asyncio.gather(first.open(), second.open())
    try:
        assert await _versions(first) == list(range(1, SCHEMA_VERSION + 1))
    finally:
        await first.close()
        await second.close()


async def test_the_vector_heads_follow_inserts_updates_and_deletes_as_on_sqlite(db: PostgresDatabase) -> None:
    """Migration 5's triggers, as PostgreSQL's one function."""
    async with db.write() as conn:
        insert = text("INSERT INTO memory_vectors (num, identity, model, rev, vector) VALUES (:num, :who, 'm', :rev, "
                      "'\\x00'::bytea)")
        await conn.execute(insert, [{"num": 1, "who": "ann", "rev": 1}, {"num": 2, "who": "ann", "rev": 2},
                                    {"num": 3, "who": "bob", "rev": 3}])
        await conn.execute(text("UPDATE memory_vectors SET identity = 'bob', rev = 4 WHERE num = 2"))
        await conn.execute(text("DELETE FROM memory_vectors WHERE num = 1"))
    async with db.read() as conn:
        heads = (await conn.execute(text("SELECT identity, rows, rev FROM memory_vector_heads "
                                         "ORDER BY identity"))).all()
    assert [tuple(row) for row in heads] == [("ann", 0, 2), ("bob", 2, 4)]


async def test_the_text_index_finds_stemmed_words_and_chinese_within_one_person(db: PostgresDatabase) -> None:
    """memory_fts as a tsvector with a GIN index: `ember_text` stems English as FTS5's porter does,
    and CJK runs are matched by the pairs segment.py spaces out."""
    rows = [(1, "ann", "She was running to the station", "", "12 May 2025"),
            (2, "ann", "我爱吃花生", "", "12 May 2025"),
            (3, "bob", "He runs every morning", "", "12 May 2025"),
            (4, "ann", "A note", "about running shoes", "12 May 2025")]
    async with db.write() as conn:
        await conn.execute(text("INSERT INTO memory_fts (rowid, owner, body, before, after, far, day) "
                                "VALUES (:num, :owner, :body, '', :after, '', :day)"),
                           [{"num": num, "owner": owner_token(who), "body": index_text(body),
                             "after": index_text(after), "day": day} for num, who, body, after, day in rows])
    search = text("SELECT rowid FROM memory_fts WHERE owner = :owner AND document @@ to_tsquery('ember_text', :q) "
                  "ORDER BY ts_rank('{0.35, 0.5, 0.6, 1.0}', document, to_tsquery('ember_text', :q)) DESC, rowid")
    async with db.read() as conn:
        async def found(who: str, query: str) -> list[int]:
            return list((await conn.execute(search, {"owner": owner_token(who), "q": query})).scalars())

        assert await found("ann", "runs") == [1, 4]  # the body outranks a neighbour's words
        assert await found("bob", "running") == [3]
        assert await found("ann", "花生") == [2]
        assert await found("ann", "生花") == []


# -- units of work ---------------------------------------------------------------------------


async def test_a_unit_commits_its_statements_and_one_that_raises_is_undone(db: PostgresDatabase) -> None:
    await db.run_write(lambda tx: tx.execute(_BUMP))

    def fails(tx: Tx) -> None:
        tx.execute(_BUMP)
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await db.run_write(fails)
    assert await db.run_read(lambda tx: tx.execute(_READ_N).fetchone()) == (1,)


async def test_a_unit_runs_each_statement_in_its_postgresql_form_and_reads_plain_tuples(db: PostgresDatabase) -> None:
    both = Statement("SELECT 'sqlite', 1", postgresql="SELECT 'postgresql', 2")
    c = schema.sessions.c
    core = Statement(select(c.key, c.next_seq).where(c.key == bindparam("key")))
    sqlite_only = Statement("SELECT 1 FROM pragma_table_info('x')", portable=False)
    insert = Statement("INSERT INTO sessions (key, next_seq, created_at, updated_at) VALUES (:key, :n, 0, 0)")

    def work(tx: Tx) -> tuple[object, ...]:
        tx.executemany(insert, [{"key": "a", "n": 1}, {"key": "b", "n": 2}])
        tx.executemany(insert, [])
        rows = tx.execute(core, {"key": "b"}).fetchall()
        with pytest.raises(NotImplementedError):
            tx.execute(sqlite_only)
        return tx.dialect, tx.execute(both).fetchone(), rows, tx.execute(_BUMP).rowcount

    dialect, picked, rows, changed = await db.run_write(work)
    assert (dialect, picked, rows, changed) == ("postgresql", ("postgresql", 2), [("b", 2)], 1)
    assert type(picked) is tuple and type(rows[0]) is tuple


async def test_each_connection_prepares_a_statement_once_and_keeps_it(pg_store_database: str) -> None:
    db = PostgresDatabase(pg_store_database, pool_size=1)  # one connection for the units, so each sees the last
    await db.open()
    prepared = Statement("SELECT count(*) FROM pg_prepared_statements")
    try:
        first = await db.run_read(lambda tx: tx.execute(prepared).fetchone()[0])
        for _ in range(5):
            assert await db.run_write(lambda tx: tx.execute(_READ_SESSION_KEYS).fetchall()) == []
        after = await db.run_read(lambda tx: tx.execute(prepared).fetchone()[0])
        assert after == first + 1  # the session query, prepared by the first write only
    finally:
        await db.close()


async def test_a_plan_made_stale_by_a_migration_fails_one_unit_and_the_next_prepares_it_again(
        db: PostgresDatabase) -> None:
    assert await db.run_read(lambda tx: tx.execute(_READ_N).fetchone()) == (0,)
    async with db.write() as conn:  # another process's upgrade: the column's type changes
        await conn.execute(text("ALTER TABLE counters ALTER COLUMN n TYPE TEXT"))
    outcomes: list[object] = []
    for _ in range(3):  # the one connection that kept the old plan
        try:
            outcomes.append(await db.run_read(lambda tx: tx.execute(_READ_N).fetchone()))
        except DBAPIError as exc:
            outcomes.append(type(exc.orig).__name__)
    assert outcomes == ["InvalidCachedStatementError", ("0",), ("0",)]


async def test_a_read_sees_one_snapshot_while_others_commit(db: PostgresDatabase) -> None:
    async with db.read() as conn:
        before = (await conn.execute(_READ_N.postgresql)).scalar_one()
        await db.run_write(lambda tx: tx.execute(_BUMP))
        assert (await conn.execute(_READ_N.postgresql)).scalar_one() == before
    assert await db.run_read(lambda tx: tx.execute(_READ_N).fetchone()) == (before + 1,)


async def test_a_write_whose_caller_is_cancelled_midway_still_commits(db: PostgresDatabase) -> None:
    def slow(tx: Tx) -> None:
        tx.execute(_BUMP)
        tx.execute(_HOLD, {"s": 0.3})

    writing = asyncio.create_task(db.run_write(slow))
    await asyncio.sleep(0.1)  # the unit is inside its transaction, on the server
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    # The cancellation arrives only once the write has committed.
    assert await db.run_read(lambda tx: tx.execute(_READ_N).fetchone()) == (1,)


async def test_an_integrity_error_reaches_the_caller_as_one(db: PostgresDatabase) -> None:
    duplicate = Statement("INSERT INTO counters VALUES (1, 5)")
    with pytest.raises(IntegrityError):
        await db.run_write(lambda tx: tx.execute(duplicate))
    with pytest.raises(IntegrityError):
        async with db.write() as conn:
            await conn.execute(duplicate.postgresql)
    assert await db.run_read(lambda tx: tx.execute(_READ_N).fetchone()) == (0,)


async def test_a_stopped_or_unreachable_server_is_store_unavailable(own_pg_server: PgServer) -> None:
    db = PostgresDatabase(own_pg_server.fresh_database())
    await db.open()
    sleep = Statement("SELECT pg_sleep(5)")
    in_flight = [asyncio.create_task(db.run_write(lambda tx: tx.execute(sleep))),
                 asyncio.create_task(db.run_read(lambda tx: tx.execute(sleep).fetchone()))]
    await asyncio.sleep(0.2)  # both are waiting on the server
    await asyncio.to_thread(own_pg_server.stop)
    try:
        for unit in in_flight:
            with pytest.raises(StoreUnavailable):
                await unit
        with pytest.raises(StoreUnavailable):
            await db.run_write(lambda tx: tx.execute(Statement("SELECT 1")))
        with pytest.raises(StoreUnavailable):
            await db.run_read(lambda tx: tx.execute(Statement("SELECT 1")).fetchone())
        with pytest.raises(StoreUnavailable):
            async with db.write() as conn:
                await conn.execute(text("SELECT 1"))
    finally:
        await db.close()
    with pytest.raises(StoreUnavailable):
        await PostgresDatabase(own_pg_server.url).open()


async def test_after_a_server_restart_the_next_transactions_work_on_fresh_connections(
        own_pg_server: PgServer) -> None:
    db = PostgresDatabase(own_pg_server.fresh_database(), idle_ping_s=0.05)
    await db.open()
    try:
        await asyncio.gather(*(db.run_read(lambda tx: tx.execute(_HOLD, {"s": 0.1}).fetchone()) for _ in range(4)))
        await asyncio.to_thread(own_pg_server.stop)
        await asyncio.to_thread(own_pg_server.start)
        await asyncio.sleep(0.1)  # the pooled connections, dead now, have been idle
        for _ in range(6):
            await db.run_write(lambda tx: tx.execute(Statement("SELECT 1")))
            assert await db.run_read(lambda tx: tx.execute(Statement("SELECT 2")).fetchone()) == (2,)
    finally:
        await db.close()


async def test_a_connection_in_use_all_along_is_not_pinged_before_each_transaction(db: PostgresDatabase) -> None:
    """pool_pre_ping would add a BEGIN and a ROLLBACK to every transaction."""
    stats = Statement("SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()")

    async def rollbacks() -> int:
        async with db.write() as conn:
            await conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            return int((await conn.execute(stats.postgresql)).scalar_one())

    before = await rollbacks()
    for _ in range(20):
        await db.run_write(lambda tx: tx.execute(_BUMP))
    await asyncio.sleep(1.5)  # each backend flushes its statistics at most once a second
    assert await rollbacks() - before <= 2  # the reads of the statistics themselves, at the most
    assert await db.run_read(lambda tx: tx.execute(_READ_N).fetchone()) == (20,)


# -- contention ------------------------------------------------------------------------------


async def test_concurrent_writes_of_one_row_lose_no_update(db: PostgresDatabase) -> None:
    def bump(tx: Tx) -> None:
        tx.execute(_BUMP)
        tx.execute(_HOLD, {"s": 0.01})  # holding the row's lock while the others queue on it

    await asyncio.gather(*(db.run_write(bump) for _ in range(24)))
    assert await db.run_read(lambda tx: tx.execute(_READ_N).fetchone()) == (24,)


async def test_a_read_then_write_holds_its_row_with_for_update(db: PostgresDatabase) -> None:
    """What a unit that computes a row's next value in Python needs on PostgreSQL."""
    locked = Statement("SELECT n FROM counters WHERE id = 1 FOR UPDATE")
    set_n = Statement("UPDATE counters SET n = :n WHERE id = 1")

    def next_value(tx: Tx) -> int:
        (n,) = tx.execute(locked).fetchone() or (0,)
        tx.execute(_HOLD, {"s": 0.01})
        tx.execute(set_n, {"n": n + 1})
        return n + 1

    values = await asyncio.gather(*(db.run_write(next_value) for _ in range(12)))
    assert sorted(values) == list(range(1, 13))


async def test_of_two_compare_and_sets_from_the_same_value_one_wins(db: PostgresDatabase) -> None:
    """The sessions' claim of their next seqs (store/sessions.py): the second writer waits for the
    first's lock, then finds the row changed and claims nothing."""
    s = schema.sessions.c
    await db.run_write(lambda tx: tx.execute(Statement(
        "INSERT INTO sessions (key, next_seq, created_at, updated_at) VALUES ('s', 0, 0, 0)")))
    claim = Statement(update(schema.sessions).where(s.key == "s", s.next_seq == bindparam("expected"))
                      .values(next_seq=bindparam("claimed")))

    def claim_two(tx: Tx) -> int:
        claimed = tx.execute(claim, {"expected": 0, "claimed": 2}).rowcount
        tx.execute(_HOLD, {"s": 0.1})
        return claimed

    assert sorted(await asyncio.gather(db.run_write(claim_two), db.run_write(claim_two))) == [0, 1]


async def test_a_lock_held_too_long_or_a_deadlock_is_store_busy(pg_store_database: str) -> None:
    db = PostgresDatabase(pg_store_database, lock_timeout_ms=200)
    await db.open()
    try:
        async with db.write() as conn:
            await conn.execute(text("CREATE TABLE pair (id INTEGER PRIMARY KEY, n INTEGER)"))
            await conn.execute(text("INSERT INTO pair VALUES (1, 0), (2, 0)"))
        async with db.write() as conn:
            await conn.execute(text("UPDATE pair SET n = 1 WHERE id = 1"))
            with pytest.raises(StoreBusy):
                await db.run_write(lambda tx: tx.execute(Statement("UPDATE pair SET n = 2 WHERE id = 1")))

        def in_order(first: int, second: int) -> Callable[[Tx], None]:
            def work(tx: Tx) -> None:
                tx.execute(Statement("UPDATE pair SET n = n + 1 WHERE id = :id"), {"id": first})
                tx.execute(_HOLD, {"s": 0.05})
                tx.execute(Statement("UPDATE pair SET n = n + 1 WHERE id = :id"), {"id": second})
            return work

        # The server's deadlock_timeout (100 ms) is shorter than the lock timeout: one of the two is chosen.
        outcomes = await asyncio.gather(db.run_write(in_order(1, 2)), db.run_write(in_order(2, 1)),
                                        return_exceptions=True)
        assert sorted(type(outcome).__name__ for outcome in outcomes) == ["NoneType", "StoreBusy"]
    finally:
        await db.close()


# -- pgvector --------------------------------------------------------------------------------


async def test_pgvector_takes_an_hnsw_index_and_finds_the_nearest(db: PostgresDatabase) -> None:
    async with db.write() as conn:
        await conn.execute(text("CREATE EXTENSION IF NOT EXISTS vector"))
        await conn.execute(text("CREATE TABLE points (id INTEGER PRIMARY KEY, v vector(3))"))
        await conn.execute(text("CREATE INDEX points_near ON points USING hnsw (v vector_cosine_ops)"))
        await conn.execute(text("INSERT INTO points VALUES (1, '[1,0,0]'), (2, '[0,1,0]'), (3, '[0,0,1]')"))
        # memory_vectors.embedding has no dimension: an index per model names it.
        await conn.execute(text("CREATE INDEX memory_vectors_near_m ON memory_vectors USING hnsw "
                                "((embedding::vector(3)) vector_cosine_ops) WHERE model = 'm'"))
        await conn.execute(text("INSERT INTO memory_vectors (num, identity, model, rev, vector, embedding) "
                                "VALUES (1, 'ann', 'm', 1, '\\x00'::bytea, '[0.1,0.9,0]')"))
    async with db.read() as conn:
        nearest = await conn.execute(text("SELECT id FROM points ORDER BY v <=> '[0.1,0.9,0.1]' LIMIT 1"))
        assert nearest.scalar_one() == 2
        mine = await conn.execute(text("SELECT num FROM memory_vectors WHERE model = 'm' "
                                       "ORDER BY embedding::vector(3) <=> '[0,1,0]' LIMIT 1"))
        assert mine.scalar_one() == 1
