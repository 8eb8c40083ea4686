"""What chat platforms showed of each answer: the message id of every part, and the
delivery each answer shows in full (see channels/chat/editing.py)."""

from __future__ import annotations

import sqlite3
import time

from ember.store.database import Database


class SqlChannelMessages:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def parts(self, channel: str, turn_id: str) -> dict[int, str]:
        rows = await self._db.run_read(lambda conn: conn.execute(
            "SELECT part, message_id FROM channel_messages WHERE channel = ? AND turn_id = ?",
            (channel, turn_id)).fetchall())
        return dict(rows)

    async def digests(self, channel: str, turn_id: str) -> dict[int, str]:
        """What each part was last shown with in full (a final's text), where that is known."""
        rows = await self._db.run_read(lambda conn: conn.execute(
            "SELECT part, digest FROM channel_messages WHERE channel = ? AND turn_id = ? AND digest IS NOT NULL",
            (channel, turn_id)).fetchall())
        return dict(rows)

    async def record(self, channel: str, chat_id: str, turn_id: str, part: int, message_id: str) -> None:
        await self._db.run_write(lambda conn: conn.execute(
            "INSERT INTO channel_messages (channel, turn_id, part, chat_id, message_id, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (channel, turn_id, part) DO UPDATE SET "
            "message_id = excluded.message_id, digest = NULL", (channel, turn_id, part, chat_id, message_id,
                                                                 time.time())))

    async def drop(self, channel: str, turn_id: str, parts: list[int]) -> None:
        await self._db.run_write(lambda conn: conn.executemany(
            "DELETE FROM channel_messages WHERE channel = ? AND turn_id = ? AND part = ?",
            [(channel, turn_id, part) for part in parts]))

    async def finished(self, channel: str, turn_id: str) -> str | None:
        """The delivery id the answer's messages show in full, if one does."""
        row = await self._db.run_read(lambda conn: conn.execute(
            "SELECT delivery_id FROM channel_finals WHERE channel = ? AND turn_id = ?", (channel, turn_id)).fetchone())
        return row[0] if row else None

    async def finish(self, channel: str, turn_id: str, delivery_id: str | None, digests: dict[int, str]) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.executemany("UPDATE channel_messages SET digest = ? WHERE channel = ? AND turn_id = ? AND part = ?",
                             [(text, channel, turn_id, part) for part, text in digests.items()])
            conn.execute("INSERT INTO channel_finals VALUES (?, ?, ?, ?) ON CONFLICT (channel, turn_id) DO UPDATE "
                         "SET delivery_id = excluded.delivery_id, finished_at = excluded.finished_at",
                         (channel, turn_id, delivery_id, time.time()))

        await self._db.run_write(write)

    async def next_counter(self, channel: str, name: str) -> int:
        """1, 2, 3, … per (channel, name), never the same twice, across restarts."""
        def write(conn: sqlite3.Connection) -> int:
            row = conn.execute("INSERT INTO channel_counters VALUES (?, ?, 1) ON CONFLICT (channel, name) DO UPDATE "
                               "SET value = value + 1 RETURNING value", (channel, name)).fetchone()
            return int(row[0])

        return await self._db.run_write(write)
