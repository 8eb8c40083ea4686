"""The inbox and the outbox: accepted messages, and answers owed to channels.

Both are written by SqlSessionStore.append, in the transaction of the messages
they belong to (record_receipt, record_delivery); this store reads them and
records deliveries. It also keeps the messages a channel accepted before their
turn could start (`accept`), until their turn has a receipt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any

from sqlalchemy import bindparam, insert, select, update

from ember.core.delivery import Delivery, DeliveryKind, Receipt
from ember.core.errors import DuplicateMessage
from ember.core.events import InboundEvent, ReplyRoute
from ember.core.messages import decode_attachments, encode_attachments
from ember.store import schema
from ember.store.engine import Database
from ember.store.tx import Statement, Tx, upsert

_i, _o, _a = schema.inbox, schema.outbox, schema.accepted_inbound
_FINAL, _ERROR = DeliveryKind.FINAL.value, DeliveryKind.ERROR.value  # plain strings: inlined as SQL literals
# A duplicate is not an error inside the transaction: the caller sees rowcount 0 and rolls back.
_ACCEPT = upsert(lambda ins: ins(_i).on_conflict_do_nothing(index_elements=["channel", "chat_id", "message_id"]))
_OWE = Statement(insert(_o))
_ANSWERED = Statement(update(_i).where(
    _i.c.channel == bindparam("asked_channel"), _i.c.chat_id == bindparam("asked_chat"),
    _i.c.message_id == bindparam("reply_to")).values(answered_at=bindparam("now")))
# Message ids are the platform's, and platforms number messages per chat.
_RECEIPT = Statement(select(_i).where(_i.c.channel == bindparam("channel"), _i.c.chat_id == bindparam("chat_id"),
                                      _i.c.message_id == bindparam("message_id")))
# A committed final answers the message even if an error (its failed send) came after it.
_ANSWER_OF = Statement(select(_o).where(_o.c.turn_id == bindparam("turn_id"))
                       .order_by((_o.c.kind == _FINAL).desc(), _o.c.created_at.desc()).limit(1))
_UNANSWERED_IN = Statement(select(_i).where(_i.c.session_key == bindparam("key"), _i.c.answered_at.is_(None))
                           .order_by(_i.c.received_at.desc()).limit(1))
_GIVE_UP = Statement(update(_o).where(_o.c.delivery_id == bindparam("delivery"), _o.c.delivered_at.is_(None))
                     .values(failure=bindparam("failure"), attempts=_o.c.attempts + 1))
_ACCEPT_EARLY = upsert(lambda ins: ins(_a).on_conflict_do_nothing(
    index_elements=["channel", "chat_id", "message_id"]))
_UNANSWERED = Statement(select(_i).where(_i.c.answered_at.is_(None)).order_by(_i.c.received_at))
# The error each turn of a session ended with, for the turns that never committed a final answer.
_FAILURES = Statement(select(_o).where(
    _o.c.session_key == bindparam("key"), _o.c.kind == _ERROR,
    _o.c.turn_id.not_in(select(_o.c.turn_id).where(_o.c.session_key == bindparam("key"), _o.c.kind == _FINAL)),
).order_by(_o.c.created_at))
# One channel's each: a process reads those of the channels it serves.
_UNDELIVERED = Statement(select(_o).where(_o.c.channel == bindparam("channel"), _o.c.delivered_at.is_(None),
                                          _o.c.failure.is_(None), _o.c.created_at <= bindparam("before")))
_CREATED_AT = list(_o.c.keys()).index("created_at")
_UNSTARTED = Statement(select(_a).where(_a.c.channel == bindparam("channel"), ~select(_i.c.message_id).where(
    _i.c.channel == _a.c.channel, _i.c.chat_id == _a.c.chat_id, _i.c.message_id == _a.c.message_id).exists(),
))
_ACCEPTED_AT = list(_a.c.keys()).index("accepted_at")
_MARK = Statement(update(_o).where(_o.c.delivery_id == bindparam("delivery"), _o.c.delivered_at.is_(None))
                  .values(delivered_at=bindparam("now"), attempts=_o.c.attempts + 1))


def _receipt(row: Sequence[Any]) -> Receipt:
    channel, message_id, _key, chat_id, sender_id, turn_id, received_at, answered_at = row
    return Receipt(channel=channel, message_id=message_id, chat_id=chat_id, sender_id=sender_id, turn_id=turn_id,
                   received_at=received_at, answered_at=answered_at)


def _delivery(row: Sequence[Any]) -> Delivery:
    delivery_id, turn_id, key, channel, chat_id, reply_to, kind, text, *_, files = row
    return Delivery(delivery_id=delivery_id, turn_id=turn_id, channel=channel, chat_id=chat_id, reply_to=reply_to,
                    kind=kind, text=text, attachments=decode_attachments(files), session_key=key)


def record_receipt(tx: Tx, key: str, receipt: Receipt, now: float) -> None:
    """Inside a write transaction; DuplicateMessage when the message was accepted before."""
    accepted = tx.execute(_ACCEPT, {
        "channel": receipt.channel, "message_id": receipt.message_id, "session_key": key, "chat_id": receipt.chat_id,
        "sender_id": receipt.sender_id, "turn_id": receipt.turn_id, "received_at": now, "answered_at": None,
    })
    if accepted.rowcount != 1:
        raise DuplicateMessage(f"message {receipt.message_id!r} of {receipt.channel} was already accepted")


def record_delivery(tx: Tx, key: str, delivery: Delivery, now: float) -> None:
    """Inside a write transaction: the outbox record, and its message marked answered."""
    tx.execute(_OWE, {
        "delivery_id": delivery.delivery_id, "turn_id": delivery.turn_id, "session_key": key,
        "channel": delivery.channel, "chat_id": delivery.chat_id, "reply_to": delivery.reply_to,
        "kind": str(delivery.kind), "text": delivery.text, "created_at": now, "delivered_at": None, "attempts": 0,
        "failure": None, "attachments": encode_attachments(delivery.attachments),
    })
    if delivery.reply_to is not None:
        asked = delivery.question_route
        tx.execute(_ANSWERED, {"asked_channel": asked.channel, "asked_chat": asked.chat_id,
                               "reply_to": delivery.reply_to, "now": now})


def accept_inbound(tx: Tx, event: InboundEvent, now: float) -> bool:
    """Inside a write transaction: keep `event` until its turn starts; False: its id is known."""
    assert event.message_id is not None
    reply = event.reply
    return tx.execute(_ACCEPT_EARLY, {
        "channel": event.channel, "chat_id": event.chat_id, "message_id": event.message_id,
        "sender_id": event.sender_id, "text": event.text, "metadata_json": json.dumps(dict(event.metadata)),
        "accepted_at": now, "reply_channel": reply.channel if reply else None,
        "reply_chat_id": reply.chat_id if reply else None}).rowcount == 1


class SqlDeliveryStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def receipt(self, channel: str, chat_id: str, message_id: str) -> Receipt | None:
        def find(tx: Tx) -> Receipt | None:
            row = tx.execute(_RECEIPT, {"channel": channel, "chat_id": chat_id, "message_id": message_id}).fetchone()
            return None if row is None else _receipt(row)

        return await self._db.run_read(find)

    async def unanswered_in(self, session_key: str) -> Receipt | None:
        """The newest accepted message of the session whose turn has not answered yet."""
        def find(tx: Tx) -> Receipt | None:
            row = tx.execute(_UNANSWERED_IN, {"key": session_key}).fetchone()
            return None if row is None else _receipt(row)

        return await self._db.run_read(find)

    async def unanswered(self) -> list[Receipt]:
        """Accepted messages whose turn never committed an answer, oldest first."""
        return [_receipt(row) for row in await self._db.run_read(lambda tx: tx.execute(_UNANSWERED).fetchall())]

    async def answer_of(self, turn_id: str) -> Delivery | None:
        def find(tx: Tx) -> Delivery | None:
            row = tx.execute(_ANSWER_OF, {"turn_id": turn_id}).fetchone()
            return None if row is None else _delivery(row)

        return await self._db.run_read(find)

    async def failures(self, session_key: str) -> list[Delivery]:
        """The error each turn of the session ended with, for the turns that never committed an
        answer (a failure, a stop): the latest per turn, oldest turn first."""
        rows = await self._db.run_read(lambda tx: tx.execute(_FAILURES, {"key": session_key}).fetchall())
        return list({delivery.turn_id: delivery for delivery in map(_delivery, rows)}.values())

    async def undelivered(self, channels: Iterable[str], *, older_than_s: float = 0.0) -> list[Delivery]:
        before = time.time() - older_than_s
        rows = await self._db.run_read(lambda tx: [
            row for channel in set(channels)
            for row in tx.execute(_UNDELIVERED, {"channel": channel, "before": before}).fetchall()])
        return [_delivery(row) for row in sorted(rows, key=itemgetter(_CREATED_AT))]

    async def record(self, session_key: str, delivery: Delivery) -> None:
        """An outbound record without a message: an error a turn ended with."""
        now = time.time()
        await self._db.run_write(lambda tx: record_delivery(tx, session_key, delivery, now))

    async def mark_delivered(self, delivery_ids: Iterable[str]) -> None:
        ids = list(delivery_ids)
        if not ids:
            return
        now = time.time()

        def mark(tx: Tx) -> None:
            tx.executemany(_MARK, [{"delivery": delivery_id, "now": now} for delivery_id in ids])

        await self._db.run_write(mark)

    async def mark_given_up(self, refused: Iterable[tuple[str, str]]) -> None:
        """(delivery id, why): answers a channel refused for good."""
        rows = [{"delivery": delivery_id, "failure": failure} for delivery_id, failure in refused]
        if not rows:
            return

        def give_up(tx: Tx) -> None:
            tx.executemany(_GIVE_UP, rows)

        await self._db.run_write(give_up)

    async def accept(self, event: InboundEvent) -> bool:
        """Keep `event` until its turn starts; False: a message with its id was accepted before."""
        return bool(await self._db.run_write(lambda tx: accept_inbound(tx, event, time.time())))

    async def unstarted(self, channels: Iterable[str]) -> list[InboundEvent]:
        """Accepted messages of `channels` whose turn never got as far as a receipt, oldest first."""
        rows = await self._db.run_read(lambda tx: [
            row for channel in set(channels) for row in tx.execute(_UNSTARTED, {"channel": channel}).fetchall()])
        return [_accepted(row) for row in sorted(rows, key=itemgetter(_ACCEPTED_AT))]


def _accepted(row: Sequence[Any]) -> InboundEvent:
    channel, chat_id, message_id, sender_id, text, reply_channel, reply_chat_id, metadata_json, _at = row
    return InboundEvent(channel=channel, chat_id=chat_id, sender_id=sender_id, text=text, message_id=message_id,
                        metadata=json.loads(metadata_json),
                        reply=ReplyRoute(reply_channel, reply_chat_id) if reply_channel else None)
