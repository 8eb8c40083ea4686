"""Routes the gateway channel's outbound events to the HTTP request waiting for them.

Every request sends its message with a fresh `message_id`; the agent loop
answers with `reply_to` set to it. Events whose request has gone (the client
disconnected) are dropped here: the turn itself runs on in the agent loop, and
its committed answer stays in the session's history.

A request that missed part of its turn's stream (a numbered event did not come:
it joined the turn midway, resent through this gateway while another one's
request was being answered, or the bus lost some) gets only the final, which
carries the whole text. Where several gateways share the bus (SharedTurnRouter), the
event bringing a request its answer can also go astray (Redis restarted and
lost the route to this gateway): a request that has heard nothing for a while
looks for its message's answer in the store, and takes it from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ember.bus.base import InboundPublisher
from ember.core.attachments import Attachment
from ember.core.channels import ChannelCapabilities
from ember.core.delivery import Delivery, DeliveryKind
from ember.core.errors import StoreError
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.messages import Message
from ember.core.sampling import Sampling
from ember.runtime.tasks import cancel_task
from ember.store.protocols import Inbox

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
# A request that heard nothing this long looks for its answer in the store, then twice as long, ...
ANSWER_LOOK_S = 2.0
ANSWER_LOOK_MAX_S = 16.0


class InFlight(Exception):
    """A message with this id is being answered right now."""


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """A message a client sends through the gateway, and how it takes the answer."""

    identity: str
    key: str  # the session, as the caller names it
    text: str
    stream: bool
    can_approve: bool  # the client sees approval requests and can answer them
    # The client's own id for the message (an idempotency key): a resend with the same id gets the
    # recorded answer, not a second turn.
    client_id: str | None = None
    sender_name: str | None = None  # who wrote it, when the client relays a chat of several people
    evaluation: bool = False  # a new session it starts is an evaluation run, and leaves no memory
    sampling: Sampling | None = None  # the client's options for the model calls answering it
    # The conversation before it, as the client has it, which a new session begins with.
    history: tuple[Message, ...] = ()
    agent: str | None = None  # the named agent asked for (None: the session's, else the default)
    attachments: tuple[Attachment, ...] = ()  # stored in the session already


class UnknownAgent(ValueError):
    def __init__(self, agent: str, known: frozenset[str]) -> None:
        super().__init__(f"there is no agent named {agent!r} (agents: {', '.join(sorted(known)) or 'none'})")


class TurnRouter:
    """The gateway's channel: each request waits for the events answering its message."""

    capabilities = ChannelCapabilities(streams=True)

    def __init__(self, bus: InboundPublisher, name: str = CHANNEL, *, agents: frozenset[str] = frozenset()) -> None:
        """`name`: the channel (http; a2a routes its requests the same way); `agents`: the named
        agents a request may ask for."""
        self.name = name
        self.agents = agents
        self._bus = bus
        self._waiting: dict[str, asyncio.Queue[OutboundEvent]] = {}
        # Messages whose turn has streamed something and not ended yet, and the requests that joined
        # such a turn midway (a resend): they get only its final, which carries the whole text,
        # since the part of the draft they would see has lost its beginning.
        self._streaming: set[str] = set()
        self._joined: set[str] = set()
        self._next_index: dict[str, int] = {}  # per request: the stream_index it expects next
        self._heard_at: dict[str, float] = {}  # per request: when it was last sent an event

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def in_flight(self, identity: str, client_id: str | None) -> bool:
        return client_id is not None and f"{identity}:{client_id}" in self._waiting

    @asynccontextmanager
    async def turn(self, request: TurnRequest) -> AsyncIterator[asyncio.Queue[OutboundEvent]]:
        """Send the message to the agent; yield the queue its answer arrives on."""
        if request.agent is not None and request.agent not in self.agents:
            raise UnknownAgent(request.agent, self.agents)
        client_id = request.client_id
        message_id = f"{request.identity}:{client_id}" if client_id else uuid.uuid4().hex
        if message_id in self._waiting:
            raise InFlight(client_id or message_id)
        event = InboundEvent(channel=self.name, chat_id=chat_id(request.identity, request.key),
                             sender_id=request.identity, text=request.text, message_id=message_id,
                             sender_name=request.sender_name, stream=request.stream, can_approve=request.can_approve,
                             metadata={"evaluation": "true"} if request.evaluation else {},
                             sampling=request.sampling, history=request.history, agent=request.agent,
                             attachments=request.attachments)
        queue: asyncio.Queue[OutboundEvent] = asyncio.Queue()
        self._waiting[message_id] = queue
        self._next_index[message_id] = 0
        self._heard_at[message_id] = time.monotonic()
        if message_id in self._streaming:
            self._joined.add(message_id)
        looking: asyncio.Task[None] | None = None
        try:
            looking = await self._send(event, queue, resent=client_id is not None)
            yield queue
        finally:
            # Before any await: a request whose client left is cancelled again at each await
            # until it ends (anyio), and whatever came after one would never run.
            del self._waiting[message_id]
            self._joined.discard(message_id)
            self._next_index.pop(message_id, None)
            self._heard_at.pop(message_id, None)
            if looking is not None:
                looking.cancel()
            await cancel_task(looking)

    async def _send(self, event: InboundEvent, queue: asyncio.Queue[OutboundEvent], *,
                    resent: bool) -> asyncio.Task[None] | None:
        """Publish the request's message; a task that watches for its answer meanwhile, if any."""
        await self._bus.publish_inbound(event)
        return None

    async def deliver(self, event: OutboundEvent) -> None:
        key = event.reply_to or ""
        if key in self._heard_at:
            self._heard_at[key] = time.monotonic()
        if event.stream_index is not None and key in self._next_index:
            if event.stream_index != self._next_index[key]:
                self._joined.add(key)  # some of the stream went elsewhere: the draft has a hole
            self._next_index[key] = event.stream_index + 1
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


class SharedTurnRouter(TurnRouter):
    """The router of a gateway that shares its bus with others: the event bringing a request its
    answer can go astray (Redis restarted and lost the route to this gateway), so a request that
    has heard nothing for `look_after_s` looks for its message's answer in `answers`."""

    def __init__(self, bus: InboundPublisher, answers: Inbox, name: str = CHANNEL, *,
                 agents: frozenset[str] = frozenset(), look_after_s: float = ANSWER_LOOK_S) -> None:
        super().__init__(bus, name, agents=agents)
        self._answers = answers
        self._look_after_s = look_after_s

    async def _send(self, event: InboundEvent, queue: asyncio.Queue[OutboundEvent], *,
                    resent: bool) -> asyncio.Task[None] | None:
        # An answer recorded before this request (an error a resend retries) is not its answer.
        before = await self._recorded(event) if resent else None
        await self._bus.publish_inbound(event)
        return asyncio.create_task(self._look_for_answer(event, queue, before),
                                   name=f"ember-answer-of-{event.message_id}")

    async def _recorded(self, event: InboundEvent) -> Delivery | None:
        """The answer recorded for `event`'s message, if its turn has answered."""
        assert event.message_id is not None
        try:
            receipt = await self._answers.receipt(event.channel, event.chat_id, event.message_id)
            if receipt is None or receipt.answered_at is None:
                return None
            return await self._answers.answer_of(receipt.turn_id)
        except StoreError:
            log.warning("could not look up the answer of a message; looking again later", exc_info=True)
            return None

    async def _look_for_answer(self, event: InboundEvent, queue: asyncio.Queue[OutboundEvent],
                               before: Delivery | None) -> None:
        """While the request hears nothing, look for its answer in the store now and then (less
        and less often); once there, hand it to the request as the event that went astray."""
        key = event.message_id or ""
        wait = self._look_after_s
        while True:
            await asyncio.sleep(wait)
            silent = time.monotonic() - self._heard_at.get(key, 0.0)
            if silent < self._look_after_s:
                wait = self._look_after_s
                continue
            answer = await self._recorded(event)
            if answer is not None and (answer.kind is DeliveryKind.FINAL or before is None
                                       or answer.delivery_id != before.delivery_id):
                log.info("the answer to a message of %s came from the store: its event went to another "
                         "process", event.session_key)
                queue.put_nowait(OutboundEvent(
                    channel=self.name, chat_id=event.chat_id,
                    kind=answer.kind.outbound,
                    text=answer.text, turn_id=answer.turn_id, reply_to=key, stream_full_text=True,
                    delivery_id=answer.delivery_id))
                return
            wait = min(wait * 2, ANSWER_LOOK_MAX_S)
