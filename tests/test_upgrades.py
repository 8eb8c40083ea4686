"""Upgrades from every earlier schema version keep every row, on SQLite and PostgreSQL.

Each case builds a store as Ember left it at version v, from the migrations' own history (applied
up to v), puts rows in every table it had, then upgrades it to the newest version, as the next
start of Ember does, and reads every row back: same values in the columns it had, in the same
tables, or where the migration that dropped a table moved them.
"""

from __future__ import annotations

import warnings
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, inspect, text
from sqlalchemy.exc import SAWarning
from sqlalchemy.ext.asyncio import AsyncConnection

from ember.core.memory import default_identity
from ember.store.migration_memory import VECTORS_IN_DATABASE
from ember.store.migration_steps import MIGRATIONS
from ember.store.migrations import SCHEMA_VERSION, migrate
from ember.store.postgres import PostgresDatabase
from ember.store.sqlite.database import SqliteDatabase
from tests.pgserver import ENGINES

ROWS = 3  # per table
# Kept by the migrations themselves, or derived from other tables (the full-text index).
NOT_POPULATED = {"schema_version", "memory_fts"}
# The one table a migration dropped, and where its rows went (version 3: memories became a person's).
MOVED = {"memories": "memory_items"}

Rows = dict[str, list[dict[str, Any]]]


@pytest.fixture(params=ENGINES)
async def empty_store(request: pytest.FixtureRequest,
                      tmp_path: Path) -> AsyncIterator[SqliteDatabase | PostgresDatabase]:
    """A store with no schema at all: nothing migrated yet."""
    db = (SqliteDatabase(tmp_path / "ember.db") if request.param == "sqlite"
          else PostgresDatabase(request.getfixturevalue("pg_database")))
    yield db
    await db.close()


def _tables(conn: Connection) -> dict[str, list[dict[str, Any]]]:
    """Each ordinary table's columns (SQLAlchemy's inspector), FTS5's virtual and shadow tables left out."""
    names = set(inspect(conn).get_table_names())
    if conn.dialect.name == "sqlite":
        virtual = {row[0] for row in conn.execute(text(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE 'CREATE VIRTUAL TABLE%'"))}
        names = {n for n in names if n not in virtual and not any(n.startswith(f"{v}_") for v in virtual)}
    with warnings.catch_warnings():  # pgvector's type, which SQLAlchemy does not know: filled by its default
        warnings.filterwarnings("ignore", "Did not recognize type 'vector'", SAWarning)
        return {name: inspect(conn).get_columns(name) for name in sorted(names - NOT_POPULATED)}


def _value(table: str, column: dict[str, Any], row: int) -> Any:
    """A value of the column's type, different in each row and each column."""
    kind = str(column["type"]).upper()
    if "INT" in kind:
        return row + 1
    if any(word in kind for word in ("DOUBLE", "REAL", "FLOAT", "NUMERIC")):
        return 1_700_000_000.0 + row
    if "BLOB" in kind or "BYTEA" in kind:
        return bytes([row + 1]) * 8
    if "BOOL" in kind:
        return row % 2 == 0
    if "TEXT" in kind or "CHAR" in kind:
        # JSON columns are read as JSON by later migrations and by Ember: give them an object.
        return "{}" if column["name"].endswith("json") else f"r{row}-{table}.{column['name']}"
    return None  # a type of one engine alone (pgvector's): left to its default


def _populate(conn: Connection) -> Rows:
    written: Rows = {}
    for table, columns in _tables(conn).items():
        rows = []
        for row in range(ROWS):
            values = {c["name"]: v for c in columns if (v := _value(table, c, row)) is not None}
            names = ", ".join(f'"{n}"' for n in values)  # quoted: a column may be named as a keyword (window)
            # The numbers PostgreSQL gives out are identity columns: set here as a restore would.
            overriding = " OVERRIDING SYSTEM VALUE" if conn.dialect.name == "postgresql" else ""
            conn.execute(text(f"INSERT INTO {table} ({names}){overriding} "
                              f"VALUES ({', '.join(':' + n for n in values)})"), values)
            rows.append(values)
        written[table] = rows
    return written


def _read(conn: Connection, table: str, columns: list[str]) -> list[dict[str, Any]]:
    quoted = ", ".join(f'"{c}"' for c in columns)
    found = conn.execute(text(f"SELECT {quoted} FROM {table}")).mappings().all()
    return [dict(row) for row in found]


def floats(blob: bytes | None) -> list[float] | None:
    return None if blob is None else array("f", blob).tolist()


def _comparable(rows: list[dict[str, Any]]) -> list[tuple[tuple[str, Any], ...]]:
    def plain(value: Any) -> Any:
        return bytes(value) if isinstance(value, memoryview) else value
    return [tuple(sorted((k, plain(v)) for k, v in row.items())) for row in rows]


async def _in_write(db: SqliteDatabase | PostgresDatabase, work: Callable[[AsyncConnection], Any]) -> Any:
    async with db.write() as conn:
        return await work(conn)


VECTORS_IN_DATABASE_VERSION = MIGRATIONS.index(VECTORS_IN_DATABASE) + 1


@pytest.mark.parametrize("version", range(1, SCHEMA_VERSION))
async def test_an_upgrade_from_an_earlier_version_keeps_every_row(
        empty_store: SqliteDatabase | PostgresDatabase, version: int) -> None:
    db = empty_store
    assert await _in_write(db, lambda conn: migrate(conn, to=version)) == 0
    written: Rows = await _in_write(db, lambda conn: conn.run_sync(_populate))
    assert {"sessions", "messages", "jobs", "traces"} <= set(written), sorted(written)

    steps: list[tuple[int, int]] = []
    assert await _in_write(db, lambda conn: migrate(conn, lambda done, pending: steps.append((done, pending)))) \
        == version
    assert steps[-1] == (SCHEMA_VERSION - version, SCHEMA_VERSION - version)

    now = await _in_write(db, lambda conn: conn.run_sync(_tables))
    for table, rows in written.items():
        if table in MOVED:
            assert table not in now
            continue
        assert table in now, f"{table}, a table of version {version}, is gone"
        kept = await _in_write(db, lambda conn, t=table, cols=list(rows[0]): conn.run_sync(_read, t, cols))
        lost = Counter(_comparable(rows)) - Counter(_comparable(kept))  # rows the migrations wrote may join them
        assert not lost, f"{table} lost or changed rows in the upgrade from {version}: {sorted(lost)}"
    if "memory_vectors" in written and db.dialect == "postgresql" and version < VECTORS_IN_DATABASE_VERSION:
        # the blobs written before that migration made pgvector's, to be scored
        both = ('SELECT vector, CAST(embedding AS real[]), "window", CAST(window_embedding AS real[]) '
                "FROM memory_vectors")
        filled = (await _in_write(db, lambda conn: conn.execute(text(both)))).fetchall()
        assert [(floats(own), floats(window)) for own, _, window, _ in filled] == [
            (own, around) for _, own, _, around in filled]
    if "memories" in written:
        moved = await _in_write(db, lambda conn: conn.run_sync(_read, "memory_items", ["identity", "content"]))
        assert sorted((m["identity"], m["content"]) for m in moved) == sorted(
            (default_identity(m["session_key"]), m["content"]) for m in written["memories"])


async def test_a_store_newer_than_this_ember_is_refused_and_left_as_it_is(
        empty_store: SqliteDatabase | PostgresDatabase) -> None:
    await _in_write(empty_store, lambda conn: migrate(conn))
    await _in_write(empty_store, lambda conn: conn.execute(text(
        "INSERT INTO schema_version (version, applied_at) VALUES (:v, 0)"), {"v": SCHEMA_VERSION + 1}))
    with pytest.raises(Exception, match=f"schema version {SCHEMA_VERSION + 1}, newer than this Ember"):
        await _in_write(empty_store, lambda conn: migrate(conn))
    found = await _in_write(empty_store, lambda conn: conn.execute(text("SELECT MAX(version) FROM schema_version")))
    assert found.scalar_one() == SCHEMA_VERSION + 1
