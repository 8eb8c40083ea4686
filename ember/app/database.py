"""The store the settings name, opened alone: for commands that only read or check it (the runtime
opens its own in ember/app/runtime.py). Kept apart from the runtime's wiring so these commands load the
store and nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ember.config.settings import Settings
from ember.store.engine import Database
from ember.store.migrations import MigrationProgress


def store_database(settings: Settings) -> Database:
    """PostgreSQL when `database_url` is set, else the SQLite file in the home."""
    if settings.database_url is not None:
        from ember.store.postgres import PostgresDatabase  # asyncpg: only for a PostgreSQL store

        return PostgresDatabase(settings.database_url.get_secret_value())
    from ember.store.sqlite.database import SqliteDatabase

    return SqliteDatabase(settings.database_path, synchronous=settings.sqlite_synchronous)


@asynccontextmanager
async def open_database(settings: Settings, *,
                        progress: MigrationProgress | None = None) -> AsyncIterator[Database]:
    """The store alone, migrated, for commands that only read or check it;
    `progress` follows the migrations, if any are pending (Database.open)."""
    db = store_database(settings)
    await db.open(progress)
    try:
        yield db
    finally:
        await db.close()
