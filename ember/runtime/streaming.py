"""Publishes one turn's live output to its reply route."""

from __future__ import annotations

import asyncio

from ember.bus.base import OutboundPublisher
from ember.core.delivery import Delivery
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind, TurnUsage
from ember.core.leases import current_lease_clock
from ember.core.messages import ToolCall
from ember.runtime.delivery import DeliveryWorker, answer_event


class StreamPublisher:
    """Deltas, tool events and the final answer of one turn.

    `prefix` (the system's introduction) goes out before the first delta, so the
    concatenated deltas of the last model step equal the final answer. The
    final carries `stream_full_text`: channels replace their draft with it, and
    its delivery id, which is confirmed once the final is handed over. The
    events before it are numbered (`stream_index`), so a reader can tell it
    missed some. While the session's lease may have gone to another process
    (this one was silent past its time), they are not sent: the draft of an
    answer that another process's turn will replace.

    Deltas are sent by a task of their own, so the model's stream is read on
    while one is on its way; those read meanwhile go out together as the next
    one. A model that streams slower than the bus carries (any real one)
    has each of its chunks sent as it comes; a fast one costs the bus and the
    channel an event per batch of chunks, not per chunk. The other events wait
    until every delta before them is sent.
    """

    def __init__(self, bus: OutboundPublisher, deliveries: DeliveryWorker, event: InboundEvent, turn_id: str, *,
                 prefix: str = "") -> None:
        self._bus = bus
        self._deliveries = deliveries
        self._event = event
        self._route = event.route  # once: deltas are the hot path
        self._turn_id = turn_id
        self._prefix = prefix
        self._streamed = 0  # events sent before the final
        self._unsent = ""  # deltas read from the model, not yet handed to the sender
        self._sender: asyncio.Task[None] | None = None

    async def delta(self, text: str) -> None:
        if not text:
            return
        if self._prefix:
            text, self._prefix = self._prefix + text, ""
        self._unsent += text
        if self._sender is None or self._sender.done():
            if self._sender is not None:
                self._sender.result()  # an earlier delta that could not be sent fails the turn here
            self._sender = asyncio.ensure_future(self._send_unsent())

    async def tool_call(self, call: ToolCall) -> None:
        await self._deltas_sent()
        await self._send(OutboundKind.TOOL_CALL, f"{call.name}({call.arguments})", tool_call=call)

    async def tool_result(self, call: ToolCall, result: str) -> None:
        await self._deltas_sent()
        await self._send(OutboundKind.TOOL_RESULT, result, tool_call=call)

    async def finalize(self, answer: Delivery, usage: TurnUsage | None = None) -> bool:
        await self._deltas_sent()
        await self._bus.publish_outbound(answer_event(answer, usage))
        self._deliveries.handed_over(self._route.channel, answer.delivery_id)
        return True

    def close(self) -> None:
        """The turn ends without its final (stopped, failed): the deltas not yet sent are dropped,
        so none follows the error the turn sends instead."""
        self._unsent = ""
        if self._sender is None:
            return
        if not self._sender.done():
            self._sender.cancel()
        elif not self._sender.cancelled():
            self._sender.exception()  # its failure is the turn's, already raised or moot now

    async def _send_unsent(self) -> None:
        while self._unsent:
            text, self._unsent = self._unsent, ""
            await self._send(OutboundKind.DELTA, text)

    async def _deltas_sent(self) -> None:
        if self._sender is not None:
            await self._sender

    async def _send(self, kind: OutboundKind, text: str, *, tool_call: ToolCall | None = None) -> None:
        index, self._streamed = self._streamed, self._streamed + 1
        lease = current_lease_clock.get()
        if lease is not None and not lease.surely_held:
            return  # another process may run this turn now: its stream is the one to show
        await self._bus.publish_outbound(
            OutboundEvent(
                channel=self._route.channel,
                chat_id=self._route.chat_id,
                kind=kind,
                text=text,
                turn_id=self._turn_id,
                reply_to=self._event.message_id,
                tool_call=tool_call,
                stream_index=index,
            )
        )
