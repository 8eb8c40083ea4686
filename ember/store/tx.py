"""The store's transactions, whatever the engine: the seam between the stores and SQLite or PostgreSQL.

A store's unit of work is a plain function of one `Tx`, run as a whole
transaction by `Database.run_write` / `run_read`. Its statements are
`Statement`s, built once at import: a SQLAlchemy Core construct, or SQL text
both engines read alike (named `:parameters`, `ON CONFLICT DO NOTHING`, no
`INSERT OR IGNORE`). Where the engines need different SQL (an upsert, full-text
search), a statement names both.

SQLite runs each unit on its connection's thread (store/sqlite/direct.py) with
the statement compiled once to its text (`compiled`); PostgreSQL runs it in a
greenlet on an asyncpg connection (store/pg_direct.py), the statement compiled
once for asyncpg and prepared once per connection. Neither compiles it again
for the parameters a call passes: an INSERT construct without `values` sets
every column of its table, each from the parameter of its name
(tests/test_tx.py checks both forms take the same names).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any, Protocol, TypeVar

from sqlalchemy import JSON, Table, bindparam, cast, func, literal_column, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql import ClauseElement, ColumnElement

Params = Mapping[str, Any]
T = TypeVar("T")


class Rows(Protocol):
    """What an executed statement gives back: rows as plain tuples, in the selected columns' order."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Sequence[Any] | None: ...

    def fetchall(self) -> Sequence[Sequence[Any]]: ...


class Tx(Protocol):
    """One open transaction."""

    dialect: str  # "sqlite" or "postgresql"

    def execute(self, statement: Statement, params: Params | None = None) -> Rows: ...

    def executemany(self, statement: Statement, rows: Sequence[Params]) -> None: ...


Work = Callable[[Tx], T]  # a store's unit of work: one whole transaction


_SQLITE = sqlite.dialect(paramstyle="named")


def compiled(statement: ClauseElement) -> str:
    """The SQL of a Core statement, for `sqlite3` with named parameters (`:name`).

    Values given at execution are named `bindparam`s. Constants of the
    statement itself (a status name, `limit(1)`, `attempts + 1`) are written
    into the text as SQL literals, so no execution has to supply them.
    """
    done = statement.compile(dialect=_SQLITE)
    sql = str(done)
    for bind, name in done.bind_names.items():
        if bind.required:
            continue
        value = bind.effective_value
        if type(value) not in (int, str):
            raise ValueError(f"constant {value!r} in a statement: only integers and strings are inlined")
        literal = bind.type.literal_processor(_SQLITE)(value)
        # A plain parameter, or one SQLAlchemy renders only at execution (literal_execute).
        pattern = rf":{re.escape(name)}\b|__\[POSTCOMPILE_{re.escape(name)}\]"
        sql = re.sub(pattern, lambda _match, text=literal: text, sql)
    return sql


class Statement:
    """A statement for every engine. `sqlite` serves both unless `postgresql` is given; a
    statement only one engine has (`postgresql=None, portable=False`) raises on the other."""

    def __init__(self, sqlite: ClauseElement | str, postgresql: ClauseElement | str | None = None, *,
                 portable: bool = True) -> None:
        self._sqlite = sqlite
        self._postgresql = postgresql if postgresql is not None else (sqlite if portable else None)

    @cached_property
    def sqlite_sql(self) -> str:
        return self._sqlite if isinstance(self._sqlite, str) else compiled(self._sqlite)

    @cached_property
    def postgresql(self) -> ClauseElement:
        if self._postgresql is None:
            raise NotImplementedError(f"no PostgreSQL form of: {self.sqlite_sql[:80]}")
        return text(self._postgresql) if isinstance(self._postgresql, str) else self._postgresql


def per_dialect(build: Callable[[str], ClauseElement]) -> Statement:
    """A statement whose construct differs between the engines: `build("sqlite")`, `build("postgresql")`."""
    return Statement(build("sqlite"), build("postgresql"))


def upsert(build: Callable[[Callable[..., Any]], ClauseElement]) -> Statement:
    """An `INSERT ... ON CONFLICT` construct, which SQLAlchemy has once per dialect: `build(insert)`
    is called with SQLite's `insert`, then with PostgreSQL's (their `on_conflict_do_*` read alike)."""
    inserts = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}
    return per_dialect(lambda dialect: build(inserts[dialect]))


def upsert_row(table: Table, key: Sequence[str]) -> Statement:
    """Insert a whole row; a row already there with the same `key` is updated to it, in place (an
    update, unlike SQLite's REPLACE, which deletes the old row and fires its delete triggers)."""
    def build(insert: Callable[..., Any]) -> ClauseElement:
        statement = insert(table)
        return statement.on_conflict_do_update(index_elements=list(key), set_={
            column.name: statement.excluded[column.name] for column in table.c if column.name not in key})

    return upsert(build)


def in_json_array(column: ColumnElement[Any], name: str, dialect: str) -> ColumnElement[bool]:
    """`column IN` the values of the parameter `name`, a JSON array (`json.dumps` of a list): one
    statement for any number of values."""
    value = literal_column("value")
    if dialect == "sqlite":
        return column.in_(select(value).select_from(func.json_each(bindparam(name))))
    return column.in_(select(cast(value, column.type)).select_from(
        func.json_array_elements_text(cast(bindparam(name), JSON))))
