"""The store the settings name, opened alone: for commands that only read or check it (the runtime
opens its own in ember/app/runtime.py). Kept apart from the runtime's wiring so these commands load the
store and nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from ember.config.settings import Settings
from ember.store.engine import AdminDatabase, Database
from ember.store.migrations import MigrationProgress

if TYPE_CHECKING:
    from ember.store.deliveries import SqlDeliveryStore
    from ember.store.jobs import SqlJobStore
    from ember.store.memories import SqlMemoryStore
    from ember.store.sessions import SqlSessionStore
    from ember.store.tasks import SqlTaskStore
    from ember.store.traces import SqlTraceStore
    from ember.store.usage import SqlUsageStore


def store_database(settings: Settings) -> AdminDatabase:
    """PostgreSQL when `database_url` is set, else the SQLite file in the home."""
    if settings.database_url is not None:
        from ember.store.postgres import PostgresDatabase  # asyncpg: only for a PostgreSQL store

        return PostgresDatabase(settings.database_url.get_secret_value())
    return sqlite_database(settings.database_path, synchronous=settings.sqlite_synchronous)


def sqlite_database(path: Path, *, synchronous: str) -> AdminDatabase:
    from ember.store.sqlite.database import SqliteDatabase

    return SqliteDatabase(path, synchronous=synchronous)


@asynccontextmanager
async def open_database(settings: Settings, *,
                        progress: MigrationProgress | None = None) -> AsyncIterator[AdminDatabase]:
    """The store alone, migrated, for commands that only read or check it;
    `progress` follows the migrations, if any are pending (Database.open)."""
    db = store_database(settings)
    await db.open(progress)
    try:
        yield db
    finally:
        await db.close()


class Stores:
    """The stores over one opened database, for the commands that read or change them: each is
    made (and its module imported) when a command first asks for it, so a command loads only its own."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @cached_property
    def sessions(self) -> SqlSessionStore:
        from ember.store.sessions import SqlSessionStore

        return SqlSessionStore(self.db)

    @cached_property
    def deliveries(self) -> SqlDeliveryStore:
        from ember.store.deliveries import SqlDeliveryStore

        return SqlDeliveryStore(self.db)

    @cached_property
    def traces(self) -> SqlTraceStore:
        from ember.store.traces import SqlTraceStore

        return SqlTraceStore(self.db)

    @cached_property
    def tasks(self) -> SqlTaskStore:
        from ember.store.tasks import SqlTaskStore

        return SqlTaskStore(self.db)

    @cached_property
    def usage(self) -> SqlUsageStore:
        from ember.store.usage import SqlUsageStore

        return SqlUsageStore(self.db)

    @cached_property
    def memory(self) -> SqlMemoryStore:
        from ember.store.memories import SqlMemoryStore

        return SqlMemoryStore(self.db)

    @cached_property
    def jobs(self) -> SqlJobStore:
        from ember.store.jobs import SqlJobStore

        return SqlJobStore(self.db)
