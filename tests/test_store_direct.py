"""The one-hop way into the database."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import IntegrityError

from ember.store import schema
from ember.store.database import Database
from ember.store.direct import compiled


async def test_a_failed_write_rolls_back_and_raises_sqlalchemys_error(db: Database) -> None:
    def twice(conn: sqlite3.Connection) -> None:
        for _ in range(2):
            conn.execute("INSERT INTO traces VALUES ('t', 's', 'ok', NULL, '{}', 0, 0)")

    with pytest.raises(IntegrityError):
        await db.run_write(twice)
    assert await db.run_read(lambda conn: conn.execute("SELECT count(*) FROM traces").fetchone()[0]) == 0


def test_constants_are_written_into_the_statement() -> None:
    o = schema.outbox
    sql = compiled(update(o).where(o.c.kind == "final", o.c.delivery_id == bindparam("id"))
                   .values(attempts=o.c.attempts + 1))
    assert "'final'" in sql and "attempts + 1" in sql and ":id" in sql
    assert ":kind" not in sql and ":attempts" not in sql
    assert "LIMIT 1 OFFSET 0" in compiled(select(o).limit(1))
