"""What chat platforms showed of each answer: the message id of every part, and the
delivery each answer shows in full (see channels/chat/editing.py)."""

from __future__ import annotations

import time

from ember.store.engine import Database
from ember.store.tx import Statement, Tx

_PARTS = Statement("SELECT part, message_id FROM channel_messages WHERE channel = :channel AND turn_id = :turn_id")
_DIGESTS = Statement("SELECT part, digest FROM channel_messages WHERE channel = :channel AND turn_id = :turn_id "
                     "AND digest IS NOT NULL")
_RECORD = Statement(
    "INSERT INTO channel_messages (channel, turn_id, part, chat_id, message_id, created_at) "
    "VALUES (:channel, :turn_id, :part, :chat_id, :message_id, :now) ON CONFLICT (channel, turn_id, part) "
    "DO UPDATE SET message_id = excluded.message_id, digest = NULL")
_DROP = Statement("DELETE FROM channel_messages WHERE channel = :channel AND turn_id = :turn_id AND part = :part")
_FINISHED = Statement("SELECT delivery_id FROM channel_finals WHERE channel = :channel AND turn_id = :turn_id")
_SHOWN = Statement("UPDATE channel_messages SET digest = :digest WHERE channel = :channel AND turn_id = :turn_id "
                   "AND part = :part")
_FINISH = Statement(
    "INSERT INTO channel_finals (channel, turn_id, delivery_id, finished_at) "
    "VALUES (:channel, :turn_id, :delivery_id, :now) ON CONFLICT (channel, turn_id) "
    "DO UPDATE SET delivery_id = excluded.delivery_id, finished_at = excluded.finished_at")
_NEXT_COUNTER = Statement(
    "INSERT INTO channel_counters (channel, name, value) VALUES (:channel, :name, 1) ON CONFLICT (channel, name) "
    "DO UPDATE SET value = channel_counters.value + 1 RETURNING value")


class SqlChannelMessages:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def parts(self, channel: str, turn_id: str) -> dict[int, str]:
        rows = await self._db.run_read(lambda tx: tx.execute(
            _PARTS, {"channel": channel, "turn_id": turn_id}).fetchall())
        return dict(rows)

    async def digests(self, channel: str, turn_id: str) -> dict[int, str]:
        """What each part was last shown with in full (a final's text), where that is known."""
        rows = await self._db.run_read(lambda tx: tx.execute(
            _DIGESTS, {"channel": channel, "turn_id": turn_id}).fetchall())
        return dict(rows)

    async def record(self, channel: str, chat_id: str, turn_id: str, part: int, message_id: str) -> None:
        await self._db.run_write(lambda tx: tx.execute(_RECORD, {
            "channel": channel, "turn_id": turn_id, "part": part, "chat_id": chat_id, "message_id": message_id,
            "now": time.time()}))

    async def drop(self, channel: str, turn_id: str, parts: list[int]) -> None:
        await self._db.run_write(lambda tx: tx.executemany(
            _DROP, [{"channel": channel, "turn_id": turn_id, "part": part} for part in parts]))

    async def finished(self, channel: str, turn_id: str) -> str | None:
        """The delivery id the answer's messages show in full, if one does."""
        row = await self._db.run_read(lambda tx: tx.execute(
            _FINISHED, {"channel": channel, "turn_id": turn_id}).fetchone())
        return row[0] if row else None

    async def finish(self, channel: str, turn_id: str, delivery_id: str | None, digests: dict[int, str]) -> None:
        def write(tx: Tx) -> None:
            tx.executemany(_SHOWN, [{"digest": text, "channel": channel, "turn_id": turn_id, "part": part}
                                    for part, text in digests.items()])
            tx.execute(_FINISH, {"channel": channel, "turn_id": turn_id, "delivery_id": delivery_id,
                                 "now": time.time()})

        await self._db.run_write(write)

    async def next_counter(self, channel: str, name: str) -> int:
        """1, 2, 3, … per (channel, name), never the same twice, across restarts."""
        def write(tx: Tx) -> int:
            row = tx.execute(_NEXT_COUNTER, {"channel": channel, "name": name}).fetchone()
            return int(row[0])

        return await self._db.run_write(write)
