from __future__ import annotations

from typing import Protocol

from ember.core.events import InboundEvent, OutboundEvent


class Bus(Protocol):
    async def publish_inbound(self, event: InboundEvent) -> None: ...

    async def next_inbound(self) -> InboundEvent: ...

    async def publish_outbound(self, event: OutboundEvent) -> None: ...

    async def next_outbound(self, channel: str) -> OutboundEvent: ...
