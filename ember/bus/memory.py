"""The embedded bus: asyncio queues in one process."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from ember.core.events import InboundEvent, OutboundEvent


class InProcessBus:
    def __init__(self) -> None:
        self._inbound: asyncio.Queue[InboundEvent] = asyncio.Queue()
        self._outbound: defaultdict[str, asyncio.Queue[OutboundEvent]] = defaultdict(asyncio.Queue)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish_inbound(self, event: InboundEvent) -> None:
        self._inbound.put_nowait(event)

    async def next_inbound(self) -> InboundEvent:
        return await self._inbound.get()

    async def ack_inbound(self, event: InboundEvent) -> None:
        """Nothing to do: a process that dies loses its queue, and start-up recovery
        republishes what the inbox holds unanswered."""

    async def earlier_in_session(self, event: InboundEvent) -> bool:
        """Never: this process takes each session's messages in order, and its session lease runs them so."""
        return False

    async def release_inbound(self, event: InboundEvent) -> None:
        """Nothing to do: the event was handed out once and is not kept."""

    async def publish_outbound(self, event: OutboundEvent) -> None:
        self._outbound[event.channel].put_nowait(event)

    async def next_outbound(self, channel: str) -> OutboundEvent:
        return await self._outbound[channel].get()

    async def publish_stop(self, session_key: str) -> bool:
        return False

    async def next_stop(self) -> str:
        """Never: in one process, the turn is stopped where it runs (AgentLoop.stop_turn)."""
        await asyncio.Future()
        raise AssertionError("unreachable")
