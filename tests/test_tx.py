"""The stores' statements (store/tx.py): each built once at import, with SQLite text of named
parameters, and a PostgreSQL form asyncpg runs with the same parameters."""

from __future__ import annotations

import inspect
import re

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
from ember.store.pg_direct import for_asyncpg
from ember.store.tx import Statement

STORES = (approvals, channel_messages, deliveries, jobs, leases, memories, memory_rows, memory_upkeep, session_rows,
          sessions, skills, tasks, traces, usage)


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


def test_each_statement_runs_on_asyncpg_with_the_parameters_its_sqlite_text_takes() -> None:
    # Both engines compile a statement once, whatever parameters a call passes: the same names fill it.
    for name, statement in every_statement().items():
        if postgresql_form(statement) is None:
            continue
        done = for_asyncpg(statement)
        assert {int(n) for n in re.findall(r"\$(\d+)", done.sql)} == set(range(1, len(done.names) + 1)), name
        if statement._postgresql is statement._sqlite:  # one form for both engines
            assert done.parameters() == set(re.findall(r"(?<!:):(\w+)", statement.sqlite_sql)), name


def test_only_the_full_text_vocabulary_is_sqlite_only() -> None:
    sqlite_only = {name for name, statement in every_statement().items() if postgresql_form(statement) is None}
    assert sqlite_only == {"memory_rows.TERM_ROWS"}  # FTS5's vocabulary table; PostgreSQL has none
