"""Publishes one turn's live output to its reply route."""

from __future__ import annotations

from ember.bus.base import Bus
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind, TurnUsage
from ember.core.leases import current_lease_clock
from ember.core.messages import ToolCall
from ember.runtime.delivery import DeliveryWorker


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
    """

    def __init__(self, bus: Bus, deliveries: DeliveryWorker, event: InboundEvent, turn_id: str, *,
                 prefix: str = "") -> None:
        self._bus = bus
        self._deliveries = deliveries
        self._event = event
        self._route = event.route  # once: deltas are the hot path
        self._turn_id = turn_id
        self._prefix = prefix
        self._streamed = 0  # events sent before the final

    async def delta(self, text: str) -> None:
        if not text:
            return
        if self._prefix:
            text, self._prefix = self._prefix + text, ""
        await self._send(OutboundKind.DELTA, text)

    async def tool_call(self, call: ToolCall) -> None:
        await self._send(OutboundKind.TOOL_CALL, f"{call.name}({call.arguments})", tool_call=call)

    async def tool_result(self, call: ToolCall, result: str) -> None:
        await self._send(OutboundKind.TOOL_RESULT, result, tool_call=call)

    async def finalize(self, text: str, delivery_id: str, usage: TurnUsage | None = None) -> bool:
        await self._send(OutboundKind.FINAL, text, stream_full_text=True, delivery_id=delivery_id, usage=usage)
        self._deliveries.handed_over(self._route.channel, delivery_id)
        return True

    async def _send(self, kind: OutboundKind, text: str, *, stream_full_text: bool = False,
                    tool_call: ToolCall | None = None, delivery_id: str | None = None,
                    usage: TurnUsage | None = None) -> None:
        index = None
        if kind is not OutboundKind.FINAL:
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
                stream_full_text=stream_full_text,
                tool_call=tool_call,
                delivery_id=delivery_id,
                usage=usage,
                stream_index=index,
            )
        )
