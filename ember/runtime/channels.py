"""The channels one process serves: started and stopped with the runtime, each handed what
the bus addresses to it: in order within a chat, and chats side by side, so one chat's slow
delivery (a rate-limited edit, a target that retries) never holds up another's."""

from __future__ import annotations

import asyncio
import logging

from ember.bus.base import OutboundRouter
from ember.core.channels import Channel, ChannelCapabilities, DeliveryRefused
from ember.core.events import OutboundEvent
from ember.runtime.delivery import DeliveryWorker
from ember.runtime.tasks import stop_tasks

log = logging.getLogger(__name__)


class ChannelHub:
    def __init__(self, bus: OutboundRouter, deliveries: DeliveryWorker) -> None:
        self._bus = bus
        self._deliveries = deliveries
        self._channels: dict[str, Channel] = {}
        self._pumps: list[asyncio.Task[None]] = []
        self._lanes: dict[tuple[str, str], asyncio.Queue[OutboundEvent]] = {}
        self._lane_tasks: set[asyncio.Task[None]] = set()
        self._started: list[Channel] = []

    def register(self, channel: Channel) -> None:
        """The one hook for adding an entrance (built-in or a plugin's), before the runtime starts."""
        if channel.name in self._channels:
            raise ValueError(f"a channel named {channel.name!r} is registered already")
        self._channels[channel.name] = channel

    @property
    def names(self) -> list[str]:
        return list(self._channels)

    @property
    def confirming(self) -> list[str]:
        return [name for name, channel in self._channels.items() if channel.capabilities.confirms_delivery]

    def get(self, name: str) -> Channel | None:
        return self._channels.get(name)

    @property
    def capabilities(self) -> dict[str, ChannelCapabilities]:
        return {name: channel.capabilities for name, channel in self._channels.items()}

    async def start(self) -> None:
        """Start every channel, in the order registered; if one fails, those started are stopped."""
        try:
            for channel in self._channels.values():
                await channel.start()
                self._started.append(channel)
        except BaseException:
            await self.stop()
            raise
        self._pumps = [asyncio.create_task(self._pump(channel), name=f"ember-channel-{channel.name}")
                       for channel in self._started]

    async def stop(self) -> None:
        await stop_tasks(self._pumps, grace_s=0)
        await stop_tasks(list(self._lane_tasks), grace_s=0)
        self._pumps, self._lanes = [], {}
        for channel in reversed(self._started):
            try:
                await channel.stop()
            except Exception:
                log.warning("channel %s did not stop cleanly", channel.name, exc_info=True)
        self._started = []

    async def _pump(self, channel: Channel) -> None:
        while True:
            event = await self._bus.next_outbound(channel.name)
            key = (channel.name, event.chat_id)
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = asyncio.Queue()
                task = asyncio.create_task(self._drain(channel, key, lane),
                                           name=f"ember-channel-{channel.name}-{event.chat_id}")
                self._lane_tasks.add(task)
                task.add_done_callback(self._lane_tasks.discard)
            lane.put_nowait(event)

    async def _drain(self, channel: Channel, key: tuple[str, str], lane: asyncio.Queue[OutboundEvent]) -> None:
        """One chat's events, in order; the lane goes when it is empty (no await between the look and that)."""
        while not lane.empty():
            await self._hand(channel, lane.get_nowait())
        del self._lanes[key]

    async def _hand(self, channel: Channel, event: OutboundEvent) -> None:
        try:
            await channel.deliver(event)
        except DeliveryRefused as refused:
            log.warning("%s refused %s of turn %s: %s", channel.name, event.kind, event.turn_id, refused)
            if event.delivery_id is not None:
                self._deliveries.gave_up(event.delivery_id, str(refused))
            return
        except Exception:  # the channel's edge: a committed answer stays owed and is sent again
            log.warning("%s could not take %s of turn %s", channel.name, event.kind, event.turn_id, exc_info=True)
            return
        if channel.capabilities.confirms_delivery and event.delivery_id is not None:
            self._deliveries.delivered(event.delivery_id)
