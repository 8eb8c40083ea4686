"""A SQLite home's store copied into an empty PostgreSQL database (`ember store copy`), and verified.

The tables copied are those the two migrated stores hold, read from the databases themselves:
schema.py names only the tables queries are built from, and some are only ever written as SQL
(channel_messages, memory_vector_rev). Left out are schema_version, which each side's migrator
keeps; and SQLite's own machinery of its full-text index (FTS5's shadow tables, the vocabulary
table memory_fts_terms), which PostgreSQL's GIN index replaces. memory_fts itself is copied by its
key and text columns, from which PostgreSQL computes its tsvector. A table the target's triggers
fill from another (DERIVED) is copied after that one, its rows replacing what the triggers made.
Memory vectors, blobs on SQLite, are also given pgvector's form, which PostgreSQL scores.

A copy is one transaction on each side: a snapshot of the source, and on the target all or
nothing, checked before it commits. A check reads a table in key order on both sides and compares
the row counts and a SHA-256 over the rows, each value in one canonical text form, so a copy that
differs from its source is never kept.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import make_url, text
from sqlalchemy.exc import ArgumentError, DBAPIError

from ember.core.errors import StoreError
from ember.store.engine import AdminDatabase
from ember.store.pgvector import fill_embeddings
from ember.store.postgres import PostgresDatabase, pg_store_error

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

BATCH = 1000
MIGRATOR_TABLE = "schema_version"
# Tables the target's triggers fill as the rows of another are copied (memory_vector_heads, from
# memory_vectors). They are copied last all the same, replacing what the triggers made: a head's
# revision only grows, so after a purge it is higher than any of its rows', which triggers cannot know.
DERIVED = frozenset({"memory_vector_heads"})
# Held by the transaction that copies: a second copy to the same database at once is refused.
_COPY_LOCK = int.from_bytes(b"ember-cp")
_FLOAT_TYPES = frozenset({"double precision", "real", "numeric"})
_TEXT_TYPES = frozenset({"text", "character varying", "character"})

_SOURCE_TABLES = text("SELECT name, sql FROM sqlite_master WHERE type = 'table' "
                      "AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'")
_TARGET_COLUMNS = text(
    "SELECT c.table_name, c.column_name, c.data_type, c.is_identity, c.is_generated "
    "FROM information_schema.columns c JOIN information_schema.tables t "
    "ON t.table_schema = c.table_schema AND t.table_name = c.table_name "
    "WHERE c.table_schema = current_schema() AND t.table_type = 'BASE TABLE' "
    "ORDER BY c.table_name, c.ordinal_position")
_TARGET_KEYS = text(
    "SELECT k.table_name, k.column_name FROM information_schema.table_constraints c "
    "JOIN information_schema.key_column_usage k ON k.constraint_schema = c.constraint_schema "
    "AND k.constraint_name = c.constraint_name AND k.table_name = c.table_name "
    "WHERE c.table_schema = current_schema() AND c.constraint_type = 'PRIMARY KEY' "
    "ORDER BY k.table_name, k.ordinal_position")
_VERSION = text(f"SELECT COALESCE(MAX(version), 0) FROM {MIGRATOR_TABLE}")

Progress = Callable[[int, int], None]  # (rows done, rows in all)


class CopyError(StoreError):
    """A copy refused, or stopped before anything of it was kept; the message says why."""


class CopyMismatch(CopyError):
    """The copy read back differs from its source: it was not kept."""

    def __init__(self, checks: Sequence[TableCheck]) -> None:
        self.checks = list(checks)
        differ = ", ".join(check.table for check in self.checks if not check.ok)
        super().__init__(f"the copy differs from the source in {differ}; nothing was kept (was another "
                         "Ember writing to the target meanwhile?)")


@dataclass(frozen=True, slots=True)
class TablePlan:
    """How one table is copied and checked."""

    name: str
    columns: tuple[str, ...]  # the source's, each one on the target too
    key: tuple[str, ...]  # the order both sides are read in: the target's primary key, else every column
    text_key: frozenset[str]  # key columns of text, compared byte by byte on both sides
    floats: frozenset[int]  # positions of the target's floating-point columns
    identity: str | None  # the target's identity column, whose sequence must pass the copied numbers
    keyed: bool  # False: a row of counters the migrations seed
    replaces: bool  # the source's rows replace the target's: the migrations' seed, or what triggers derived


@dataclass(frozen=True, slots=True)
class TableCheck:
    """One table's rows and checksum, on the source and on the target."""

    table: str
    rows: int
    target_rows: int
    checksum: str
    target_checksum: str

    @property
    def ok(self) -> bool:
        return self.rows == self.target_rows and self.checksum == self.target_checksum

    def to_json_dict(self) -> dict[str, object]:
        return {"table": self.table, "rows": self.rows, "target_rows": self.target_rows, "checksum": self.checksum,
                "target_checksum": self.target_checksum, "ok": self.ok}


@dataclass(frozen=True, slots=True)
class CopyReport:
    schema_version: int
    tables: list[TableCheck]

    @property
    def rows(self) -> int:
        return sum(check.rows for check in self.tables)


def target_name(url: str) -> str:
    """A PostgreSQL URL as it may be shown, user@host:port/database, never its password;
    CopyError unless it is a postgresql:// URL."""
    if not url.startswith(("postgresql://", "postgres://")):
        raise CopyError("the target must be a postgresql:// URL: postgresql://user@host:5432/database")
    try:
        parts = make_url(url)
        port = parts.port or 5432
    except (ArgumentError, ValueError):  # their messages quote the URL, password and all
        raise CopyError("the target URL is malformed: postgresql://user@host:5432/database") from None
    if not parts.database:
        raise CopyError("the target URL names no database: postgresql://user@host:5432/database")
    host = parts.host or "localhost"
    host = f"[{host}]" if ":" in host else host
    user = f"{parts.username}@" if parts.username else ""
    return f"{user}{host}:{port}/{parts.database}"


async def copy_store(source: AdminDatabase, target: PostgresDatabase, *, batch: int = BATCH,
                     progress: Progress | None = None) -> CopyReport:
    """Copy every table of `source` into `target`, both open (migrated), and check the copy before
    it commits. CopyError, with nothing kept, when the target already holds Ember's rows, when the
    two differ in schema, or when a row cannot be stored; CopyMismatch when the check fails."""
    async with source.read() as src, target.write() as dst:
        if not (await dst.execute(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": _COPY_LOCK})).scalar():
            raise CopyError("another copy is writing to the target database")
        version = await _same_schema(src, dst)
        plans = await plan(src, dst)
        await _refuse_used(dst, plans)
        counts = [await _count(src, p.name) for p in plans]
        # Each row is written once, then read on both sides.
        tick = _ticker(progress, 3 * sum(counts))
        for table in sorted(plans, key=lambda p: p.name in DERIVED):
            await _copy_table(src, dst, table, batch, tick)
        for table in plans:
            if table.identity is not None:
                await _advance_identity(src, dst, table)
        await fill_embeddings(dst)  # SQLite keeps vectors only as blobs; PostgreSQL also scores them
        checks = [await _check(src, dst, table, batch, tick) for table in plans]
        if not all(check.ok for check in checks):
            raise CopyMismatch(checks)  # rolls the target back
        return CopyReport(version, checks)


async def verify(source: AdminDatabase, target: PostgresDatabase, *, batch: int = BATCH,
                 progress: Progress | None = None) -> list[TableCheck]:
    """Each table's rows and checksum on both sides, as they are now (a copy made earlier)."""
    async with source.read() as src, target.read() as dst:
        plans = await plan(src, dst)
        counts = [await _count(src, p.name) for p in plans]
        tick = _ticker(progress, 2 * sum(counts))
        return [await _check(src, dst, table, batch, tick) for table in plans]


async def plan(src: AsyncConnection, dst: AsyncConnection) -> list[TablePlan]:
    """The tables to copy and check, by name; CopyError if the target lacks a table or a column of
    the source's (which the same schema version rules out)."""
    sources = await _source_tables(src)
    virtual = {name for name, (is_virtual, _) in sources.items() if is_virtual}
    columns, keys = await _target_tables(dst)
    plans = []
    for name, (is_virtual, own) in sorted(sources.items()):
        if name == MIGRATOR_TABLE:
            continue
        if name not in columns:
            if is_virtual or any(name.startswith(f"{owner}_") for owner in virtual):
                continue  # a full-text index's own tables, which only SQLite has
            raise CopyError(f"the target has no table {name}, which the source has")
        on_target = columns[name]
        # A virtual table's rows are keyed by their rowid, which the target holds as a column.
        chosen = (("rowid",) if is_virtual and "rowid" in on_target else ()) + own
        key = keys.get(name, ())
        missing = [column for column in chosen if column not in on_target] + [
            column for column in key if column not in chosen]
        if missing:
            raise CopyError(f"the source's and the target's table {name} differ in their columns "
                            f"({', '.join(sorted(set(missing)))})")
        types = {column: kind for column, (kind, _) in on_target.items()}
        identity = next((column for column, (_, is_identity) in on_target.items() if is_identity), None)
        plans.append(TablePlan(
            name=name, columns=chosen, key=key or chosen,
            text_key=frozenset(column for column in key or chosen if types[column] in _TEXT_TYPES),
            floats=frozenset(i for i, column in enumerate(chosen) if types[column] in _FLOAT_TYPES),
            identity=identity if identity in chosen else None, keyed=bool(key),
            replaces=not key or name in DERIVED))
    return plans


async def _source_tables(src: AsyncConnection) -> dict[str, tuple[bool, tuple[str, ...]]]:
    """Each of the SQLite store's tables: whether it is virtual, and its columns."""
    quote = src.dialect.identifier_preparer.quote
    tables = {}
    for name, sql in (await src.execute(_SOURCE_TABLES)).all():
        info = (await src.execute(text(f"PRAGMA table_info({quote(name)})"))).all()
        tables[name] = ((sql or "").upper().startswith("CREATE VIRTUAL TABLE"), tuple(row[1] for row in info))
    return tables


async def _target_tables(dst: AsyncConnection) -> tuple[dict[str, dict[str, tuple[str, bool]]],
                                                         dict[str, tuple[str, ...]]]:
    """The target's tables, each column with its type and whether it is an identity column (a
    generated one is left out: PostgreSQL computes it); and their primary keys."""
    columns: dict[str, dict[str, tuple[str, bool]]] = {}
    for table, column, kind, identity, generated in (await dst.execute(_TARGET_COLUMNS)).all():
        if generated == "NEVER":
            columns.setdefault(table, {})[column] = (kind, identity == "YES")
    keys: dict[str, tuple[str, ...]] = {}
    for table, column in (await dst.execute(_TARGET_KEYS)).all():
        keys[table] = (*keys.get(table, ()), column)
    return columns, keys


async def _same_schema(src: AsyncConnection, dst: AsyncConnection) -> int:
    source, target = (await src.execute(_VERSION)).scalar_one(), (await dst.execute(_VERSION)).scalar_one()
    if source != target:
        raise CopyError(f"the source is at schema version {source} and the target at {target}: "
                        "both must be at the same version")
    encoding = (await dst.execute(text("SHOW server_encoding"))).scalar_one()
    if encoding != "UTF8":
        raise CopyError(f"the target database's encoding is {encoding}; Ember's text needs UTF8 "
                        "(CREATE DATABASE ... ENCODING 'UTF8')")
    return int(source)


async def _refuse_used(dst: AsyncConnection, plans: Sequence[TablePlan]) -> None:
    """A copy goes only into a database no Ember has written to, so that it never mixes two homes."""
    quote = dst.dialect.identifier_preparer.quote
    used = [table.name for table in plans if table.keyed and (await dst.execute(
        text(f"SELECT EXISTS (SELECT 1 FROM {quote(table.name)})"))).scalar()]
    if used:
        raise CopyError(f"the target already holds Ember's rows (in {', '.join(used)}): copy into a new, "
                        "empty database, so that two homes are never mixed")


async def _count(conn: AsyncConnection, table: str) -> int:
    quote = conn.dialect.identifier_preparer.quote
    return int((await conn.execute(text(f"SELECT COUNT(*) FROM {quote(table)}"))).scalar_one())


def _select(conn: AsyncConnection, table: TablePlan) -> Any:
    """The table's rows in key order. Text keys are ordered by their bytes on both sides (SQLite's
    BINARY collation; PostgreSQL's "C"), and NULLs first, as SQLite puts them."""
    quote = conn.dialect.identifier_preparer.quote
    on_pg = conn.dialect.name == "postgresql"
    order = ", ".join(quote(column) + (' COLLATE "C"' if on_pg and column in table.text_key else "")
                      + (" NULLS FIRST" if on_pg else "") for column in table.key)
    return text(f"SELECT {', '.join(map(quote, table.columns))} FROM {quote(table.name)} ORDER BY {order}")


async def _copy_table(src: AsyncConnection, dst: AsyncConnection, table: TablePlan, batch: int,
                      tick: Callable[[int], None]) -> None:
    quote = dst.dialect.identifier_preparer.quote
    # Numbers SQLite gave out are kept: an identity column takes them only when told to.
    overriding = " OVERRIDING SYSTEM VALUE" if table.identity is not None else ""
    insert = text(f"INSERT INTO {quote(table.name)} ({', '.join(map(quote, table.columns))}){overriding} "
                  f"VALUES ({', '.join(f':c{i}' for i in range(len(table.columns)))})")
    if table.replaces:
        await dst.execute(text(f"DELETE FROM {quote(table.name)}"))
    result = await src.stream(_select(src, table))
    async for rows in result.partitions(batch):
        for row in rows:
            if any(isinstance(value, str) and "\x00" in value for value in row):
                raise CopyError(f"a row of {table.name} ({_key_of(table, row)}) holds a NUL character, which "
                                "PostgreSQL's text cannot; nothing was copied")
        try:
            await dst.execute(insert, [{f"c{i}": value for i, value in enumerate(row)} for row in rows])
        except DBAPIError as exc:
            if pg_store_error(exc) is not None:
                raise
            raise CopyError(f"PostgreSQL refused a row of {table.name}: {exc.orig}; nothing was copied") from exc
        tick(len(rows))


def _key_of(table: TablePlan, row: Sequence[Any]) -> str:
    values = dict(zip(table.columns, row))
    return ", ".join(f"{column} {str(values[column])[:40]!r}" for column in table.key[:3])


async def _advance_identity(src: AsyncConnection, dst: AsyncConnection, table: TablePlan) -> None:
    """Move the identity's sequence past every number copied, and past the highest SQLite's
    AUTOINCREMENT ever gave out: a purged memory's number is never given to another."""
    assert table.identity is not None
    quote = dst.dialect.identifier_preparer.quote
    copied = (await dst.execute(text(f"SELECT MAX({quote(table.identity)}) FROM {quote(table.name)}"))).scalar()
    has_sequence = (await src.execute(text("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'"))).first()
    given = (await src.execute(text("SELECT seq FROM sqlite_sequence WHERE name = :name"),
                               {"name": table.name})).scalar() if has_sequence else None
    high = max((n for n in (copied, given) if n is not None), default=0)
    if high > 0:
        await dst.execute(text("SELECT setval(pg_get_serial_sequence(:table, :column), :high)"),
                          {"table": quote(table.name), "column": table.identity, "high": high})


async def _check(src: AsyncConnection, dst: AsyncConnection, table: TablePlan, batch: int,
                 tick: Callable[[int], None]) -> TableCheck:
    rows, checksum = await _checksum(src, table, batch, tick)
    target_rows, target_checksum = await _checksum(dst, table, batch, tick)
    return TableCheck(table.name, rows, target_rows, checksum, target_checksum)


async def _checksum(conn: AsyncConnection, table: TablePlan, batch: int,
                    tick: Callable[[int], None]) -> tuple[int, str]:
    """The number of rows and a SHA-256 over them, in key order, computed alike on either side."""
    digest = hashlib.sha256()
    count = 0
    result = await conn.stream(_select(conn, table))
    async for rows in result.partitions(batch):
        for row in rows:
            digest.update(canonical_row(row, table.floats))
        count += len(rows)
        tick(len(rows))
    return count, digest.hexdigest()


def canonical_row(row: Sequence[Any], floats: frozenset[int] = frozenset()) -> bytes:
    """A row as one line of JSON, each value tagged with its kind: bytes as hex, floats in their
    shortest exact form (and an integer a floating-point column holds as a float, as PostgreSQL
    stores it), so that a value differs only where the stored value does."""
    values: list[str | None] = []
    for i, value in enumerate(row):
        if value is None:
            values.append(None)
        elif isinstance(value, bytes | bytearray | memoryview):
            values.append("b" + bytes(value).hex())
        elif isinstance(value, float) or (i in floats and isinstance(value, int)):
            values.append("f" + repr(float(value)))
        elif isinstance(value, int):
            values.append("i" + str(value))
        elif isinstance(value, str):
            values.append("s" + value)
        else:
            values.append(f"{type(value).__name__}:{value}")
    return json.dumps(values).encode("ascii") + b"\n"


def _ticker(progress: Progress | None, total: int) -> Callable[[int], None]:
    done = 0

    def tick(rows: int) -> None:
        nonlocal done
        done = min(done + rows, total)
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    return tick
