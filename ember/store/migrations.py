"""Brings a store's schema up to date: the append-only migrations of migration_steps.py, applied
in order and recorded, on SQLite and PostgreSQL. A version number means the same tables on both."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy import text

from ember.core.errors import StoreError
from ember.store.migration_step import ByDialect
from ember.store.migration_steps import MIGRATIONS

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

MigrationProgress = Callable[[int, int], None]  # (migrations applied, migrations pending)
DIALECTS = ("sqlite", "postgresql")
# Held by the transaction that migrates a PostgreSQL database: processes starting together take turns.
_PG_MIGRATION_LOCK = int.from_bytes(b"ember-mg")
SCHEMA_VERSION = len(MIGRATIONS)


async def migrate(conn: AsyncConnection, progress: MigrationProgress | None = None, *,
                  to: int = SCHEMA_VERSION) -> int:
    """Bring the schema up to version `to` (SCHEMA_VERSION: the newest), in the caller's
    transaction; returns the version found before.

    `progress(done, pending)` is called only when some migrations are pending:
    once before the first (done 0), then after each one.
    """
    if not 0 <= to <= SCHEMA_VERSION:
        raise ValueError(f"schema versions run from 0 to {SCHEMA_VERSION}, not {to}")
    dialect = conn.dialect.name
    if dialect not in DIALECTS:
        raise StoreError(f"Ember's store runs on SQLite or PostgreSQL, not {dialect}")
    if dialect == "postgresql":
        # SQLite's writers already take turns (BEGIN IMMEDIATE); PostgreSQL's would both find version 0.
        await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
    await conn.execute(text(
        "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
    ))
    found = (await conn.execute(text("SELECT COALESCE(MAX(version), 0) FROM schema_version"))).scalar_one()
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"the database has schema version {found}, newer than this Ember ({SCHEMA_VERSION}); upgrade Ember"
        )
    pending = max(to - found, 0)
    if progress is not None and pending:
        progress(0, pending)
    for version in range(found + 1, to + 1):
        for step in MIGRATIONS[version - 1]:
            if isinstance(step, str):
                await conn.execute(text(step))
            elif isinstance(step, ByDialect):
                for sql in step.statements(dialect):
                    await conn.execute(text(sql))
            else:
                await step(conn)
        await conn.execute(
            text("INSERT INTO schema_version (version, applied_at) VALUES (:v, :t)"), {"v": version, "t": time.time()}
        )
        if progress is not None:
            progress(version - found, pending)
    return found
