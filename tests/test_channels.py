"""The Channel seam: a channel registered through the one hook is started, handed what is
addressed to it, acknowledged only as far as it confirms, and stopped."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from ember.app.database import open_database
from ember.app.runtime import build_runtime, running
from ember.config.settings import Settings
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.models.base import ModelReply
from ember.models.scripted import ScriptedModel
from ember.store import schema
from ember.tools.base import ToolRegistry
from tests.test_delivery import undelivered


class PluginChannel:
    """A channel as a plugin would write one; `refuse` / `fail` make its deliveries go wrong."""

    capabilities = ChannelCapabilities(confirms_delivery=True)

    def __init__(self, name: str = "plugin", *, fail: bool = False, refuse: bool = False) -> None:
        self.name = name
        self.fail, self.refuse = fail, refuse
        self.events: list[OutboundEvent] = []
        self.closing: asyncio.Queue[OutboundEvent] = asyncio.Queue()
        self.life: list[str] = []

    async def start(self) -> None:
        self.life.append("start")

    async def stop(self) -> None:
        self.life.append("stop")

    async def deliver(self, event: OutboundEvent) -> None:
        self.events.append(event)
        if event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
            self.closing.put_nowait(event)
            if self.refuse:
                raise DeliveryRefused("the platform said 403")
            if self.fail:
                raise ConnectionError("the platform is down")


async def one_turn(settings: Settings, channel: PluginChannel) -> OutboundEvent:
    runtime = await build_runtime(settings, ScriptedModel([ModelReply(text="to the plugin")]), tools=ToolRegistry())
    runtime.channels.register(channel)
    with pytest.raises(ValueError, match="registered already"):
        runtime.channels.register(PluginChannel(channel.name))
    async with running(runtime):
        assert channel.life == ["start"]
        await runtime.bus.publish_inbound(InboundEvent(channel=channel.name, chat_id="c", sender_id="u",
                                                       text="hi", message_id="m1"))
        closing = await asyncio.wait_for(channel.closing.get(), 10)
    assert channel.life == ["start", "stop"]
    return closing


async def test_a_registered_channel_gets_its_answer_and_confirms_it(settings: Settings) -> None:
    channel = PluginChannel()
    closing = await one_turn(settings, channel)
    assert (closing.kind, closing.text, closing.reply_to) == (OutboundKind.FINAL, "to the plugin", "m1")
    assert await undelivered(settings, ["plugin"]) == []


async def test_a_failed_delivery_stays_owed_and_a_refused_one_is_not_sent_again(settings: Settings) -> None:
    await one_turn(settings, PluginChannel(fail=True))
    [owed] = await undelivered(settings, ["plugin"])
    assert owed.text == "to the plugin"
    refused = Settings(**{**settings.model_dump(), "home": settings.home / "other"})
    await one_turn(refused, PluginChannel(refuse=True))
    assert await undelivered(refused, ["plugin"]) == []
    async with open_database(refused) as db, db.read() as conn:
        rows = (await conn.execute(select(schema.outbox.c.delivered_at, schema.outbox.c.failure))).all()
    assert [tuple(row) for row in rows] == [(None, "the platform said 403")]


class SlowChatChannel(PluginChannel):
    """Holds every delivery to the chat "slow" until `release` is set."""

    def __init__(self) -> None:
        super().__init__("lanes")
        self.release = asyncio.Event()

    async def deliver(self, event: OutboundEvent) -> None:
        if event.chat_id == "slow":
            await self.release.wait()
        self.events.append(event)


async def test_one_chats_slow_delivery_holds_up_no_other_chat_and_keeps_its_own_order(settings: Settings) -> None:
    runtime = await build_runtime(settings, ScriptedModel([]), tools=ToolRegistry())
    channel = SlowChatChannel()
    runtime.channels.register(channel)

    def event(chat: str, text: str) -> OutboundEvent:
        return OutboundEvent(channel="lanes", chat_id=chat, kind=OutboundKind.DELTA, text=text, turn_id="t")

    async with running(runtime):
        for text in ("s1", "s2", "s3"):
            await runtime.bus.publish_outbound(event("slow", text))
        for text in ("f1", "f2"):
            await runtime.bus.publish_outbound(event("fast", text))
        async with asyncio.timeout(10):
            while len(channel.events) < 2:
                await asyncio.sleep(0.01)
        assert [e.text for e in channel.events] == ["f1", "f2"]  # the slow chat still waits
        channel.release.set()
        async with asyncio.timeout(10):
            while len(channel.events) < 5:
                await asyncio.sleep(0.01)
    assert [e.text for e in channel.events if e.chat_id == "slow"] == ["s1", "s2", "s3"]
