"""Routes the gateway channel's outbound events to the HTTP request waiting for them.

Every request sends its message with a fresh `message_id`; the agent loop
answers with `reply_to` set to it. Events whose request has gone (the client
disconnected) are dropped here: the turn itself runs on in the agent loop, and
its committed answer stays in the session's history.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ember.bus.base import Bus
from ember.core.channels import ChannelCapabilities
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind

CHANNEL = "http"


def chat_id(identity: str, key: str) -> str:
    """Sessions are namespaced by identity: two callers' "main" are two sessions."""
    return f"{identity}:{key}"


def session_key(identity: str, key: str) -> str:
    return f"{CHANNEL}:{chat_id(identity, key)}"


def namespace(identity: str) -> str:
    """The prefix of every session key of `identity`."""
    return session_key(identity, "")

log = logging.getLogger(__name__)


IN_FLIGHT_TEXT = "a message with this id is being answered right now; send it again when that is done"


class InFlight(Exception):
    """A message with this id is being answered right now."""


class TurnRouter:
    """The gateway's channel: each request waits for the events answering its message."""

    capabilities = ChannelCapabilities(streams=True)

    def __init__(self, bus: Bus, name: str = CHANNEL) -> None:
        """`name`: the channel (http; a2a routes its requests the same way)."""
        self.name = name
        self._bus = bus
        self._waiting: dict[str, asyncio.Queue[OutboundEvent]] = {}
        # Messages whose turn has streamed something and not ended yet, and the requests that joined
        # such a turn midway (a resend): they get only its final, which carries the whole text,
        # since the part of the draft they would see has lost its beginning.
        self._streaming: set[str] = set()
        self._joined: set[str] = set()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def in_flight(self, identity: str, client_id: str | None) -> bool:
        return client_id is not None and f"{identity}:{client_id}" in self._waiting

    @asynccontextmanager
    async def turn(self, identity: str, key: str, text: str, *, stream: bool, can_approve: bool,
                   client_id: str | None = None, sender_name: str | None = None,
                   evaluation: bool = False) -> AsyncIterator[asyncio.Queue[OutboundEvent]]:
        """Send the message to the agent; yield the queue its answer arrives on.

        `can_approve`: the client sees approval requests and can answer them.
        `client_id`: the client's own id for the message (an idempotency key): a
        resend with the same id gets the recorded answer, not a second turn.
        `sender_name`: who wrote it, when the client relays a chat of several people.
        `evaluation`: a new session it starts is an evaluation run, and leaves no memory.
        """
        message_id = f"{identity}:{client_id}" if client_id else uuid.uuid4().hex
        if message_id in self._waiting:
            raise InFlight(client_id or message_id)
        event = InboundEvent(channel=self.name, chat_id=chat_id(identity, key), sender_id=identity, text=text,
                             message_id=message_id, sender_name=sender_name, stream=stream,
                             can_approve=can_approve, metadata={"evaluation": "true"} if evaluation else {})
        queue: asyncio.Queue[OutboundEvent] = asyncio.Queue()
        self._waiting[message_id] = queue
        if message_id in self._streaming:
            self._joined.add(message_id)
        try:
            await self._bus.publish_inbound(event)
            yield queue
        finally:
            del self._waiting[message_id]
            self._joined.discard(message_id)

    async def deliver(self, event: OutboundEvent) -> None:
        key = event.reply_to or ""
        if event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
            self._streaming.discard(key)
        else:
            self._streaming.add(key)
            if key in self._joined and event.kind is not OutboundKind.APPROVAL_REQUEST:
                return  # a draft without its beginning: the final will say it all
        queue = self._waiting.get(key)
        if queue is not None:
            queue.put_nowait(event)
        else:
            log.debug("no request waits for %s of turn %s; dropped", event.kind, event.turn_id)
