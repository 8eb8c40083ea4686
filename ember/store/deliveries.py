"""The inbox and the outbox: accepted messages, and answers owed to channels.

Both are written by SqlSessionStore.append, in the transaction of the messages
they belong to (record_receipt, record_delivery); this store reads them and
records deliveries.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Row, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from ember.core.delivery import Delivery, Receipt
from ember.core.errors import DuplicateMessage
from ember.store import schema
from ember.store.database import Database


def _receipt(row: Row[Any]) -> Receipt:
    return Receipt(channel=row.channel, message_id=row.message_id, chat_id=row.chat_id, sender_id=row.sender_id,
                   turn_id=row.turn_id, received_at=row.received_at, answered_at=row.answered_at)


def _delivery(row: Row[Any]) -> Delivery:
    return Delivery(delivery_id=row.delivery_id, turn_id=row.turn_id, channel=row.channel, chat_id=row.chat_id,
                    reply_to=row.reply_to, kind=row.kind, text=row.text)


async def record_receipt(conn: AsyncConnection, key: str, receipt: Receipt, now: float) -> None:
    try:
        async with conn.begin_nested():
            await conn.execute(insert(schema.inbox).values(
                channel=receipt.channel, message_id=receipt.message_id, session_key=key, chat_id=receipt.chat_id,
                sender_id=receipt.sender_id, turn_id=receipt.turn_id, received_at=now,
            ))
    except IntegrityError as exc:
        raise DuplicateMessage(f"message {receipt.message_id!r} of {receipt.channel} was already accepted") from exc


async def record_delivery(conn: AsyncConnection, key: str, delivery: Delivery, now: float) -> None:
    await conn.execute(insert(schema.outbox).values(
        delivery_id=delivery.delivery_id, turn_id=delivery.turn_id, session_key=key, channel=delivery.channel,
        chat_id=delivery.chat_id, reply_to=delivery.reply_to, kind=delivery.kind, text=delivery.text,
        created_at=now, attempts=0,
    ))
    if delivery.reply_to is not None:
        i = schema.inbox
        await conn.execute(update(i).where(i.c.channel == delivery.channel, i.c.chat_id == delivery.chat_id,
                                           i.c.message_id == delivery.reply_to)
                           .values(answered_at=now))


class SqlDeliveryStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def receipt(self, channel: str, chat_id: str, message_id: str) -> Receipt | None:
        """Message ids are the platform's, and platforms number messages per chat."""
        i = schema.inbox
        async with self._db.read() as conn:
            row = (await conn.execute(select(i).where(i.c.channel == channel, i.c.chat_id == chat_id,
                                                      i.c.message_id == message_id))).first()
        return None if row is None else _receipt(row)

    async def unanswered(self) -> list[Receipt]:
        """Accepted messages whose turn never committed an answer, oldest first."""
        i = schema.inbox
        async with self._db.read() as conn:
            rows = (await conn.execute(select(i).where(i.c.answered_at.is_(None)).order_by(i.c.received_at))).all()
        return [_receipt(row) for row in rows]

    async def answer_of(self, turn_id: str) -> Delivery | None:
        o = schema.outbox
        async with self._db.read() as conn:
            row = (await conn.execute(
                # A committed final answers the message even if an error (its failed send) came after it.
                select(o).where(o.c.turn_id == turn_id)
                .order_by((o.c.kind == "final").desc(), o.c.created_at.desc()).limit(1)
            )).first()
        return None if row is None else _delivery(row)

    async def undelivered(self, channels: Iterable[str], *, older_than_s: float = 0.0) -> list[Delivery]:
        o = schema.outbox
        query = (select(o).where(o.c.delivered_at.is_(None), o.c.channel.in_(list(channels)),
                                 o.c.created_at <= time.time() - older_than_s).order_by(o.c.created_at))
        async with self._db.read() as conn:
            return [_delivery(row) for row in (await conn.execute(query)).all()]

    async def record(self, session_key: str, delivery: Delivery) -> None:
        """An outbound record without a message: an error a turn ended with."""
        async with self._db.write() as conn:
            await record_delivery(conn, session_key, delivery, time.time())

    async def mark_delivered(self, delivery_ids: Iterable[str]) -> None:
        ids = list(delivery_ids)
        if not ids:
            return
        o = schema.outbox
        async with self._db.write() as conn:
            await conn.execute(update(o).where(o.c.delivery_id.in_(ids), o.c.delivered_at.is_(None))
                               .values(delivered_at=time.time(), attempts=o.c.attempts + 1))
