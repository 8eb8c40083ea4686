"""The stores' statements (store/tx.py): each built once at import, with SQLite text of named
parameters, and a PostgreSQL form SQLAlchemy can run with the parameters its callers pass."""

from __future__ import annotations

import inspect
import re

from sqlalchemy.dialects.postgresql import asyncpg
from sqlalchemy.exc import CompileError
from sqlalchemy.sql.dml import UpdateBase

from ember.store import (
    approvals,
    channel_messages,
    deliveries,
    jobs,
    leases,
    memories,
    memory_rows,
    memory_upkeep,
    session_rows,
    sessions,
    skills,
    tasks,
    traces,
    usage,
)
from ember.store.tx import Statement

STORES = (approvals, channel_messages, deliveries, jobs, leases, memories, memory_rows, memory_upkeep, session_rows,
          sessions, skills, tasks, traces, usage)
_PG = asyncpg.dialect()


def every_statement() -> dict[str, Statement]:
    """Each statement once, named after the module that assigns it (not those that import it)."""
    found: dict[int, tuple[str, Statement]] = {}
    for module in STORES:
        source = inspect.getsource(module)
        for name, value in vars(module).items():
            if not re.search(rf"^{name} = ", source, re.MULTILINE):
                continue
            for key, item in value.items() if isinstance(value, dict) else [(None, value)]:
                if isinstance(item, Statement):
                    label = f"{module.__name__.rsplit('.', 1)[1]}.{name}" + ("" if key is None else f"[{key}]")
                    found.setdefault(id(item), (label, item))
    return dict(found.values())


def postgresql_form(statement: Statement) -> object | None:
    try:
        return statement.postgresql
    except NotImplementedError:
        return None


def test_the_sqlite_text_has_named_parameters_only() -> None:
    for name, statement in every_statement().items():
        assert "?" not in statement.sqlite_sql, name
        assert " OR IGNORE " not in statement.sqlite_sql and " OR REPLACE " not in statement.sqlite_sql, name


def test_an_insert_or_update_takes_no_parameter_that_sqlalchemy_would_read_as_a_column_value() -> None:
    # Run with parameters, as PostgreSQL's units are, an INSERT or UPDATE construct takes a parameter
    # named after a column of its table for a value to SET: a WHERE's parameter must be named otherwise.
    for name, statement in every_statement().items():
        construct = postgresql_form(statement)
        if isinstance(construct, UpdateBase):
            parameters = [bind.key for bind in construct.compile(dialect=_PG).binds.values() if bind.required]
            try:
                construct.compile(dialect=_PG, column_keys=parameters)
            except CompileError as exc:
                raise AssertionError(f"{name}: {exc}") from exc


def test_only_the_full_text_vocabulary_is_sqlite_only() -> None:
    sqlite_only = {name for name, statement in every_statement().items() if postgresql_form(statement) is None}
    assert sqlite_only == {"memory_rows.TERM_ROWS"}  # FTS5's vocabulary table; PostgreSQL has none
