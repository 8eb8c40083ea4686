"""The records that make delivery exactly-once: what came in, and what is owed out."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.core.attachments import Attachment
from ember.core.events import OutboundKind, ReplyRoute
from ember.core.messages import Message

if TYPE_CHECKING:
    from ember.core.events import InboundEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class Receipt:
    """An accepted inbound message, committed with the user message it became.
    A redelivery of (channel, message_id) finds it instead of running again."""

    channel: str
    message_id: str
    chat_id: str
    sender_id: str
    turn_id: str
    received_at: float = 0.0
    answered_at: float | None = None


class DeliveryKind(enum.StrEnum):
    FINAL = "final"  # the turn's answer
    ERROR = "error"  # the error the turn ended with, in its answer's place

    @property
    def outbound(self) -> OutboundKind:
        return OutboundKind.FINAL if self is DeliveryKind.FINAL else OutboundKind.ERROR


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """A committed answer owed to a channel, written in the same transaction as
    the answer. `delivery_id` (turn id and the answer's seq) is the idempotency
    key a channel dedupes by; `reply_to` is the message it answers, asked in
    `asked_in` when that is not where the answer goes (channel, chat_id)."""

    delivery_id: str
    turn_id: str
    channel: str
    chat_id: str
    reply_to: str | None
    kind: DeliveryKind
    text: str
    asked_in: ReplyRoute | None = None
    # The answer's files, stored in the session (read back for a re-send).
    attachments: tuple[Attachment, ...] = ()
    session_key: str | None = field(default=None, compare=False)  # where they are stored

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", DeliveryKind(self.kind))  # as read back from the store: its text

    @property
    def question_route(self) -> ReplyRoute:
        return self.asked_in or ReplyRoute(self.channel, self.chat_id)

    @classmethod
    def replying(cls, event: InboundEvent, *, delivery_id: str, turn_id: str, text: str,
                 kind: DeliveryKind = DeliveryKind.FINAL, attachments: tuple[Attachment, ...] = ()) -> Delivery:
        """The record of `text` (and `attachments`) answering `event`, owed to the event's reply route."""
        route = event.route
        return cls(delivery_id=delivery_id, turn_id=turn_id, channel=route.channel, chat_id=route.chat_id,
                   reply_to=event.message_id, kind=kind, text=text,
                   asked_in=None if route == event.origin else event.origin, attachments=attachments,
                   session_key=event.session_key)

    @classmethod
    def failing(cls, event: InboundEvent, *, turn_id: str, text: str) -> Delivery:
        """The record of the error that answers `event` in its turn's place: never a message, so its
        id is the turn's and a suffix of its own."""
        return cls.replying(event, delivery_id=f"{turn_id}:error:{uuid.uuid4().hex[:8]}", turn_id=turn_id,
                            text=text, kind=DeliveryKind.ERROR)


def delivery_id(turn_id: str, seq: int) -> str:
    return f"{turn_id}:{seq}"


def interleaved(messages: Sequence[Message], failures: Sequence[Delivery]) -> list[Message | Delivery]:
    """A history as a person reads it: each unanswered turn's error (a failure, a stop) right after
    that turn's last message. The errors are not messages: the model never reads them."""
    last_of_turn = {m.turn_id: i for i, m in enumerate(messages) if m.turn_id is not None}
    after: dict[int, list[Delivery]] = {}
    for failure in failures:
        if (index := last_of_turn.get(failure.turn_id)) is not None:
            after.setdefault(index, []).append(failure)
    entries: list[Message | Delivery] = []
    for index, message in enumerate(messages):
        entries.append(message)
        entries.extend(after.get(index, ()))
    return entries
