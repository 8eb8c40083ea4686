"""Append-only list of schema migrations, applied in order and recorded.

Never edit a migration that has shipped: add a new one. The SQL is written to
run unchanged on SQLite and PostgreSQL.
"""

from __future__ import annotations

import time

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ember.core.errors import StoreError

MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE sessions (
            key TEXT PRIMARY KEY,
            next_seq BIGINT NOT NULL,
            last_consolidated BIGINT NOT NULL DEFAULT 0,
            metadata_json TEXT NOT NULL DEFAULT '{}',
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE messages (
            session_key TEXT NOT NULL,
            seq BIGINT NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            tool_calls TEXT,
            tool_call_id TEXT,
            reasoning TEXT,
            turn_id TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session_key, seq))""",
        """CREATE TABLE quarantine (
            id TEXT PRIMARY KEY,
            session_key TEXT NOT NULL,
            seq BIGINT NOT NULL,
            raw TEXT NOT NULL,
            reason TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            kind TEXT NOT NULL,
            dedupe_key TEXT NOT NULL,
            session_key TEXT,
            status TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            next_run_at DOUBLE PRECISION NOT NULL,
            last_error TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
        "CREATE UNIQUE INDEX jobs_one_pending ON jobs (kind, dedupe_key) WHERE status = 'pending'",
        "CREATE INDEX jobs_due ON jobs (status, next_run_at)",
        """CREATE TABLE memories (
            id TEXT PRIMARY KEY,
            session_key TEXT,
            kind TEXT NOT NULL,
            content TEXT NOT NULL,
            source_start BIGINT,
            source_end BIGINT,
            embedding TEXT,
            created_at DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX memories_by_session ON memories (session_key, kind, created_at)",
        """CREATE TABLE traces (
            turn_id TEXT PRIMARY KEY,
            session_key TEXT NOT NULL,
            status TEXT NOT NULL,
            error TEXT,
            detail TEXT NOT NULL,
            started_at DOUBLE PRECISION NOT NULL,
            finished_at DOUBLE PRECISION NOT NULL)""",
    ),
    (
        # Every accepted message, once per (channel, chat_id, message_id): a redelivery finds it here.
        """CREATE TABLE inbox (
            channel TEXT NOT NULL,
            message_id TEXT NOT NULL,
            session_key TEXT NOT NULL,
            chat_id TEXT NOT NULL,
            sender_id TEXT NOT NULL,
            turn_id TEXT NOT NULL,
            received_at DOUBLE PRECISION NOT NULL,
            answered_at DOUBLE PRECISION,
            PRIMARY KEY (channel, chat_id, message_id))""",
        "CREATE INDEX inbox_unanswered ON inbox (received_at) WHERE answered_at IS NULL",
        # Every committed answer, written with it; delivered_at is set once a channel has it.
        """CREATE TABLE outbox (
            delivery_id TEXT PRIMARY KEY,
            turn_id TEXT NOT NULL,
            session_key TEXT NOT NULL,
            channel TEXT NOT NULL,
            chat_id TEXT NOT NULL,
            reply_to TEXT,
            kind TEXT NOT NULL,
            text TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            delivered_at DOUBLE PRECISION,
            attempts INTEGER NOT NULL DEFAULT 0)""",
        "CREATE INDEX outbox_by_turn ON outbox (turn_id)",
        "CREATE INDEX outbox_undelivered ON outbox (created_at) WHERE delivered_at IS NULL",
    ),
]

SCHEMA_VERSION = len(MIGRATIONS)


async def migrate(conn: AsyncConnection) -> int:
    """Bring the schema up to SCHEMA_VERSION; returns the version found before."""
    await conn.execute(text(
        "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
    ))
    found = (await conn.execute(text("SELECT COALESCE(MAX(version), 0) FROM schema_version"))).scalar_one()
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"the database has schema version {found}, newer than this Ember ({SCHEMA_VERSION}); upgrade Ember"
        )
    for version in range(found + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[version - 1]:
            await conn.execute(text(statement))
        await conn.execute(
            text("INSERT INTO schema_version (version, applied_at) VALUES (:v, :t)"), {"v": version, "t": time.time()}
        )
    return found
