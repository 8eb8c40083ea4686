"""The Redis Streams bus against a real Redis (tests/redisserver.py), and its JSON codec.

Each test has a namespace of its own in the session's one Redis. Waits are
bounded; no assertion is about how long something took.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.bus.codec import decode_inbound, decode_outbound, encode_inbound, encode_outbound
from ember.bus.redis import RedisBus
from ember.bus.redis_support import RedisBusConfig, redacted_url, shard_of
from ember.core.attachments import Attachment
from ember.core.errors import BusUnavailable, ConfigError
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind, ReplyRoute, TurnUsage
from ember.core.messages import Message, Role, ToolCall
from ember.core.sampling import Sampling
from ember.core.tools import ApprovalRequest, Explanation, Risk, ToolAction
from tests.redisserver import RedisServer, _free_port

TIMEOUT = 10.0  # the bound of every wait for something that should happen
CHANNEL = "http"


def inbound(text: str, *, chat: str = "c1", message_id: str | None = None, **extra: Any) -> InboundEvent:
    return InboundEvent(channel=CHANNEL, chat_id=chat, sender_id="tester", text=text,
                        message_id=message_id or uuid.uuid4().hex, **extra)


def outbound(text: str, *, reply_to: str | None, kind: OutboundKind = OutboundKind.FINAL,
             channel: str = CHANNEL, **extra: Any) -> OutboundEvent:
    return OutboundEvent(channel=channel, chat_id="c1", kind=kind, text=text, turn_id="turn-1",
                         reply_to=reply_to, **extra)


class Reader:
    """Reads one channel of a bus into a queue, as a channel pump does."""

    def __init__(self, bus: RedisBus, channel: str) -> None:
        self.queue: asyncio.Queue[OutboundEvent] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(bus, channel))

    async def _run(self, bus: RedisBus, channel: str) -> None:
        while True:
            self.queue.put_nowait(await bus.next_outbound(channel))

    async def get(self) -> OutboundEvent:
        return await asyncio.wait_for(self.queue.get(), TIMEOUT)


@dataclass
class Buses:
    """Buses of one test, in its own namespace, closed (their readers first) at its end."""

    url: str
    namespace: str
    raw: aioredis.Redis
    stack: AsyncExitStack
    readers: list[Reader] = field(default_factory=list)

    def config(self, **tuning: Any) -> RedisBusConfig:
        values: dict[str, Any] = {"namespace": self.namespace, "shards": 2, "block_ms": 100,
                                  "claim_idle_ms": 60_000, "publish_timeout_s": 1.0, "reader_ttl_ms": 3_000}
        return RedisBusConfig(**(values | tuning))

    async def open(self, process: str, **tuning: Any) -> RedisBus:
        bus = RedisBus(self.url, process=process, config=self.config(**tuning))
        await bus.start()
        self.stack.push_async_callback(bus.close)
        return bus

    async def read(self, bus: RedisBus, process: str, channel: str = CHANNEL) -> Reader:
        """A reader of `channel`, once the bus reads it (its address exists)."""
        reader = Reader(bus, channel)
        self.readers.append(reader)
        await self.until(lambda: self.raw.exists(f"{self.namespace}:outbound:to:{process}:{channel}"))
        return reader

    async def until(self, check: Any) -> None:
        async def poll() -> None:
            while not await check():
                await asyncio.sleep(0.02)
        await asyncio.wait_for(poll(), TIMEOUT)


@pytest.fixture
async def buses(redis_server: RedisServer) -> AsyncIterator[Buses]:
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    async with AsyncExitStack() as stack:
        env = Buses(redis_server.url, f"t{uuid.uuid4().hex[:10]}", raw, stack)
        try:
            yield env
        finally:
            for reader in env.readers:
                reader.task.cancel()
            await asyncio.gather(*(r.task for r in env.readers), return_exceptions=True)
    await raw.aclose()


async def take(bus: RedisBus) -> InboundEvent:
    return await asyncio.wait_for(bus.next_inbound(), TIMEOUT)


async def nothing_for(bus: RedisBus, seconds: float) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(bus.next_inbound(), seconds)


# -- the codec

texts = st.text(max_size=40)
optional_texts = st.none() | texts
samplings = st.builds(Sampling, max_tokens=st.none() | st.integers(1, 10**6),
                      temperature=st.none() | st.floats(0, 2), top_p=st.none() | st.floats(0, 1))
messages = st.builds(Message, role=st.sampled_from(Role), content=texts, name=optional_texts,
                     tool_calls=st.lists(st.builds(ToolCall, texts, texts, texts), max_size=2).map(tuple))
attachments = st.lists(st.builds(Attachment, digest=texts, media_type=texts, size=st.integers(0, 2**40),
                                  name=optional_texts), max_size=2).map(tuple)
inbound_events = st.builds(
    InboundEvent, channel=texts, chat_id=texts, sender_id=texts, text=texts, message_id=optional_texts,
    sender_name=optional_texts, stream=st.booleans(), can_approve=st.booleans(), recovery=st.booleans(),
    metadata=st.dictionaries(texts, texts, max_size=4).map(MappingProxyType),
    reply=st.none() | st.builds(ReplyRoute, texts, texts), sampling=st.none() | samplings,
    history=st.lists(messages, max_size=3).map(tuple), attachments=attachments)
approvals = st.builds(
    ApprovalRequest, id=texts, session_key=texts, turn_id=texts,
    action=st.builds(ToolAction, tool=texts, risk=st.sampled_from(Risk), subject=texts, summary=texts,
                     arguments=texts),
    timeout_s=st.floats(allow_nan=False),
    explanation=st.none() | st.builds(Explanation, text=texts, risk=texts, reason=texts))
outbound_events = st.builds(
    OutboundEvent, channel=texts, chat_id=texts, kind=st.sampled_from(OutboundKind), text=texts, turn_id=texts,
    reply_to=optional_texts, stream_full_text=st.booleans(),
    tool_call=st.none() | st.builds(ToolCall, texts, texts, texts), approval=st.none() | approvals,
    delivery_id=optional_texts, usage=st.none() | st.builds(TurnUsage, st.integers(), st.integers(), st.integers()))


@settings(max_examples=300, deadline=None)
@given(inbound_events)
def test_inbound_events_round_trip_exactly(event: InboundEvent) -> None:
    decoded = decode_inbound(encode_inbound(event))
    assert decoded == event
    assert isinstance(decoded.metadata, MappingProxyType)
    assert type(decoded.history) is tuple and all(type(m.role) is Role for m in decoded.history)
    assert all(type(a) is Attachment for a in decoded.attachments)


@settings(max_examples=300, deadline=None)
@given(outbound_events)
def test_outbound_events_round_trip_exactly(event: OutboundEvent) -> None:
    decoded = decode_outbound(encode_outbound(event))
    assert decoded == event
    assert type(decoded.kind) is OutboundKind
    if decoded.approval is not None:
        assert type(decoded.approval.action.risk) is Risk
        assert type(decoded.approval.timeout_s) is float


def test_any_string_survives_the_codec() -> None:
    event = inbound("lone \ud800 surrogate, 花生, \x00 and an emoji 🙂", chat="聊天")
    assert decode_inbound(encode_inbound(event).encode()) == event


GOOD = encode_inbound(inbound("private words", message_id="m1"))


@pytest.mark.parametrize(("payload", "says"), [
    ("{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    ("[1, 2]", "not an object"),
    (GOOD.replace('"v":1', '"v":2'), "unknown version"),
    (GOOD.replace('"v":1', '"v":true'), "unknown version"),
    (GOOD.replace('"type":"inbound"', '"type":"outbound"'), "not an inbound event"),
    (GOOD.replace('"stream":false', '"stream":"no"'), "inbound.stream must be bool"),
    (GOOD.replace('"stream":false', '"stream":false,"colour":"red"'), "unknown fields: colour"),
    (GOOD.replace('"text":"private words",', ""), "lacks the required field text"),
    (GOOD.replace('"reply":null', '"reply":{"channel":"x"}'), "inbound.reply lacks the required field chat_id"),
    (GOOD.replace('"metadata":{}', '"metadata":{"k":1}'), "inbound.metadata['k'] must be str"),
    (GOOD.replace('"metadata":{}', '"metadata":[]'), "inbound.metadata must be an object"),
    ("[" * 100_000, "not JSON"),
])
def test_malformed_payloads_raise_a_clear_value_error(payload: str | bytes, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        decode_inbound(payload)
    assert says in str(caught.value)
    assert "private words" not in str(caught.value)


def test_unknown_enum_values_are_rejected() -> None:
    good = encode_outbound(outbound("x", reply_to=None))
    with pytest.raises(ValueError, match=r"outbound\.kind is not a known OutboundKind"):
        decode_outbound(good.replace('"kind":"final"', '"kind":"shout"'))
    with pytest.raises(ValueError, match=r"usage\.input_tokens must be an integer, not a boolean"):
        decode_outbound(good.replace('"usage":null', '"usage":{"input_tokens":true,"cached_tokens":0,'
                                                     '"output_tokens":0}'))


# -- inbound


async def test_one_sessions_messages_keep_their_order_across_shards(buses: Buses) -> None:
    worker = await buses.open("w1", shards=4)
    publisher = await buses.open("g1", shards=4)
    chats = [f"chat-{i}" for i in range(8)]
    assert len({shard_of(f"{CHANNEL}:{chat}", 4) for chat in chats}) > 1
    for n in range(10):
        for chat in chats:
            await publisher.publish_inbound(inbound(f"{chat} #{n}", chat=chat))
    seen: dict[str, list[str]] = {chat: [] for chat in chats}
    for _ in range(80):
        event = await take(worker)
        seen[event.chat_id].append(event.text)
        await worker.ack_inbound(event)
    assert seen == {chat: [f"{chat} #{n}" for n in range(10)] for chat in chats}


async def test_two_consumers_of_the_group_share_the_messages(buses: Buses) -> None:
    first, second = await buses.open("w1"), await buses.open("w2")
    sent = {f"message {i}" for i in range(10)}
    for i, text in enumerate(sorted(sent)):
        await first.publish_inbound(inbound(text, chat=f"c{i}"))
    got: dict[str, list[str]] = {"w1": [], "w2": []}
    while sum(map(len, got.values())) < len(sent):
        for name, bus in (("w1", first), ("w2", second)):
            if sum(map(len, got.values())) < len(sent):
                got[name].append((await take(bus)).text)
    assert got["w1"] and got["w2"]
    assert not set(got["w1"]) & set(got["w2"])
    assert set(got["w1"]) | set(got["w2"]) == sent


async def test_a_worker_takes_one_message_at_a_time_and_leaves_the_rest_to_the_others(buses: Buses) -> None:
    busy, idle = await buses.open("w-busy", shards=4), await buses.open("w-idle", shards=4)
    chats = [f"chat-{i}" for i in range(12)]
    assert len({shard_of(f"{CHANNEL}:{chat}", 4) for chat in chats}) == 4
    for chat in chats:
        await busy.publish_inbound(inbound(f"to {chat}", chat=chat))
    first = await take(busy)  # and it asks for no more: its turns are all running
    rest = [(await take(idle)).chat_id for _ in range(len(chats) - 1)]
    assert sorted([first.chat_id, *rest]) == sorted(chats)


async def test_a_dead_consumers_message_is_taken_over(buses: Buses) -> None:
    dead = RedisBus(buses.url, process="w-dead", config=buses.config(claim_idle_ms=200))
    await dead.start()
    await dead.publish_inbound(inbound("left behind", message_id="m1"))
    assert (await take(dead)).message_id == "m1"
    await dead.close()  # dies holding it: no ack

    heir = await buses.open("w-heir", claim_idle_ms=200)
    event = await take(heir)
    assert (event.message_id, event.text) == ("m1", "left behind")
    await heir.ack_inbound(event)
    assert (await buses.raw.xpending(f"{buses.namespace}:inbound:{shard_of(event.session_key, 2)}",
                                     "workers"))["pending"] == 0


async def test_a_live_consumers_message_is_not_taken_over(buses: Buses) -> None:
    holder = await buses.open("w1", claim_idle_ms=200)
    other = await buses.open("w2", claim_idle_ms=200)
    await holder.publish_inbound(inbound("slow turn", message_id="m1"))
    event = await take(holder)
    waiting = asyncio.create_task(holder.next_inbound())  # the loop asks for more while the turn runs
    try:
        await nothing_for(other, 1.5)  # several times claim_idle_ms
        await holder.ack_inbound(event)
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)


async def test_a_saturated_consumers_message_is_not_taken_over_while_it_reads_nothing(buses: Buses) -> None:
    """Every slot of the holder is busy: its loop asks for no message, yet its turns run on."""
    holder = await buses.open("w1", claim_idle_ms=200)
    other = await buses.open("w2", claim_idle_ms=200)
    await holder.publish_inbound(inbound("slow turn", message_id="m1"))
    event = await take(holder)
    await nothing_for(other, 1.5)  # several times claim_idle_ms
    await holder.ack_inbound(event)


async def test_a_released_message_is_taken_over_again_even_by_the_process_that_let_it_go(buses: Buses) -> None:
    """A worker fenced off a session (LeaseLost) lets its message go unacknowledged: it stops keeping
    it fresh, so that when the worker that took the session over dies too, the entry idles and is
    taken over again, here by the worker that let it go."""
    fenced = await buses.open("w-fenced", claim_idle_ms=200)
    await fenced.publish_inbound(inbound("taken over twice", message_id="m1"))
    event = await take(fenced)
    waiting = asyncio.create_task(fenced.next_inbound())  # its loop asks for more meanwhile
    try:
        await asyncio.sleep(0.5)  # held: kept fresh, not handed out again
        assert not waiting.done()
        await fenced.release_inbound(event)
        async with asyncio.timeout(5):
            again = await waiting
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    assert (again.message_id, again.text) == ("m1", "taken over twice") and again is not event
    await fenced.ack_inbound(again)


async def test_a_message_waits_while_an_earlier_one_of_its_session_is_held_by_another_worker(
        buses: Buses) -> None:
    first, second = await buses.open("w1"), await buses.open("w2")
    await first.publish_inbound(inbound("one", message_id="m1"))
    await first.publish_inbound(inbound("other session", chat="c2", message_id="o1"))
    await first.publish_inbound(inbound("two", message_id="m2"))
    one = await take(first)
    others = [await take(second), await take(second)]
    two = next(e for e in others if e.message_id == "m2")
    other = next(e for e in others if e.message_id == "o1")
    assert one.message_id == "m1"
    assert not await first.earlier_in_session(one)
    assert not await second.earlier_in_session(other)  # another session's message is no earlier one
    assert await second.earlier_in_session(two)
    await first.ack_inbound(one)
    assert not await second.earlier_in_session(two)
    await second.ack_inbound(two)
    await second.ack_inbound(other)
    assert not await buses.raw.keys(f"{buses.namespace}:order:*")  # acknowledged: nothing left to order


async def test_a_dead_workers_earlier_message_is_taken_over_and_answered_first(buses: Buses) -> None:
    dead = RedisBus(buses.url, process="w-dead", config=buses.config(claim_idle_ms=200))
    await dead.start()
    heir = await buses.open("w-heir", claim_idle_ms=200)
    await dead.publish_inbound(inbound("one", message_id="m1"))
    await dead.publish_inbound(inbound("two", message_id="m2"))
    assert (await take(dead)).message_id == "m1"
    await dead.close()  # dies holding m1
    two = await take(heir)
    assert two.message_id == "m2" and await heir.earlier_in_session(two)
    one = await take(heir)  # taken over once idle
    assert one.message_id == "m1" and not await heir.earlier_in_session(one)
    assert await heir.earlier_in_session(two)
    await heir.ack_inbound(one)
    assert not await heir.earlier_in_session(two)


async def test_a_copy_of_a_message_waits_for_no_earlier_copy_and_handled_releases_every_copy(
        buses: Buses) -> None:
    """A message published again (a client's retry, recovery after a crash) while its first entry is
    still held by a dead worker takes that entry's place: it waits for nothing, and the message
    after it waits for it alone, not for the first copy's takeover."""
    dead = await buses.open("w-dead")
    live = await buses.open("w-live")
    await dead.publish_inbound(inbound("one", message_id="m1"))
    assert (await take(dead)).message_id == "m1"  # held by a worker that will never finish it
    await live.publish_inbound(inbound("two", message_id="m2"))
    await live.publish_inbound(inbound("one", message_id="m1"))  # the copy, after m2 in the stream
    two, again = await take(live), await take(live)
    assert (two.message_id, again.message_id) == ("m2", "m1")
    assert await live.earlier_in_session(two)  # m1 came first
    assert not await live.earlier_in_session(again)  # its first copy is itself: no wait
    await live.ack_inbound(again)
    assert not await live.earlier_in_session(two)  # m1 handled: its dead copy holds nothing up
    order = f"{buses.namespace}:order:{two.session_key}"
    stream = f"{buses.namespace}:inbound:{shard_of(two.session_key, 2)}"
    assert [item.split(" ")[0] for item in await buses.raw.lrange(order, 0, -1)] == [
        entry_id for entry_id, fields in await buses.raw.xrange(stream)
        if decode_inbound(fields["event"]).message_id == "m2"]


async def test_an_earlier_entry_that_is_gone_holds_nothing_up(buses: Buses) -> None:
    """Deleted by a process that did not keep the order (or by hand): dropped from it when found."""
    worker = await buses.open("w1")
    await worker.publish_inbound(inbound("one", message_id="m1"))
    await worker.publish_inbound(inbound("two", message_id="m2"))
    one, two = await take(worker), await take(worker)
    stream = f"{buses.namespace}:inbound:{shard_of(one.session_key, 2)}"
    [(first_id, _)] = await buses.raw.xrange(stream, count=1)
    await buses.raw.xdel(stream, first_id)
    assert not await worker.earlier_in_session(two)
    order = await buses.raw.lrange(f"{buses.namespace}:order:{two.session_key}", 0, -1)
    assert [item.split(" ")[0] for item in order] != [first_id]


async def test_a_message_written_without_its_place_in_the_order_waits_for_nothing(buses: Buses) -> None:
    worker = await buses.open("w1")
    await worker.publish_inbound(inbound("one", message_id="m1"))
    event = inbound("from an older version", message_id="m0")
    stream = f"{buses.namespace}:inbound:{shard_of(event.session_key, 2)}"
    await buses.raw.xadd(stream, {"event": encode_inbound(event)})
    one, old = await take(worker), await take(worker)
    assert old.message_id == "m0" and not await worker.earlier_in_session(old)
    assert not await worker.earlier_in_session(one)
    await worker.ack_inbound(old)  # no session named: acknowledged all the same
    assert (await buses.raw.xpending(stream, "workers"))["pending"] == 1


async def test_acked_messages_are_not_delivered_again(buses: Buses) -> None:
    first = await buses.open("w1", claim_idle_ms=200)
    await first.publish_inbound(inbound("done once", message_id="m1"))
    event = await take(first)
    await first.ack_inbound(event)
    await first.ack_inbound(event)  # twice is harmless
    await first.close()
    stream = f"{buses.namespace}:inbound:{shard_of(event.session_key, 2)}"
    assert (await buses.raw.xpending(stream, "workers"))["pending"] == 0
    assert await buses.raw.xlen(stream) == 0  # acked entries leave the stream
    second = await buses.open("w2", claim_idle_ms=200)
    await nothing_for(second, 1.0)


async def test_a_malformed_entry_is_logged_and_skipped(buses: Buses, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ember.bus")
    worker = await buses.open("w1", shards=1)
    stream = f"{buses.namespace}:inbound:0"
    await buses.raw.xadd(stream, {"event": "{not json"})
    await buses.raw.xadd(stream, {"something": "else"})
    await worker.publish_inbound(inbound("private words", message_id="m-good"))
    event = await take(worker)
    assert event.message_id == "m-good"
    await worker.ack_inbound(event)
    assert caplog.text.count("skipped the malformed inbound entry") == 2
    assert await buses.raw.xlen(stream) == 0
    assert (await buses.raw.xpending(stream, "workers"))["pending"] == 0
    assert "private words" not in caplog.text

    shared = f"{buses.namespace}:outbound:any:{CHANNEL}"
    reader = await buses.read(worker, "w1")
    await buses.raw.xadd(shared, {"event": '{"v":1,"type":"outbound","event":{"kind":"yell"}}'})
    await worker.publish_outbound(outbound("after the bad one", reply_to=None))
    assert (await reader.get()).text == "after the bad one"
    assert "skipped the malformed outbound entry" in caplog.text


async def test_processes_must_agree_on_the_shard_count(buses: Buses) -> None:
    await buses.open("w1", shards=2)
    with pytest.raises(ConfigError, match="has 2 inbound shards; this process is configured with 3"):
        await buses.open("w2", shards=3)


# -- outbound


async def test_answers_reach_the_gateway_that_accepted_the_message(buses: Buses) -> None:
    gateway, other = await buses.open("g1"), await buses.open("g2")
    worker = await buses.open("w1")
    mine, theirs = await buses.read(gateway, "g1"), await buses.read(other, "g2")
    await gateway.publish_inbound(inbound("hello", message_id="m1"))
    event = await take(worker)
    await worker.publish_outbound(outbound("he", reply_to=event.message_id, kind=OutboundKind.DELTA))
    await worker.publish_outbound(outbound("hello back", reply_to=event.message_id, delivery_id="turn-1:3"))
    assert [(e.kind, e.text) for e in (await mine.get(), await mine.get())] == [
        (OutboundKind.DELTA, "he"), (OutboundKind.FINAL, "hello back")]
    await worker.ack_inbound(event)
    ns = buses.namespace
    assert await buses.raw.xlen(f"{ns}:outbound:to:g1:{CHANNEL}") == 2
    assert await buses.raw.xlen(f"{ns}:outbound:to:g2:{CHANNEL}") == 0
    assert await buses.raw.xlen(f"{ns}:outbound:any:{CHANNEL}") == 0
    assert theirs.queue.empty()


async def test_unrouted_events_reach_one_reader_of_the_channel(buses: Buses) -> None:
    first, second = await buses.open("g1"), await buses.open("g2")
    readers = [await buses.read(first, "g1", "telegram"), await buses.read(second, "g2", "telegram")]
    sent = {f"reminder {i}" for i in range(6)}
    for text in sorted(sent):
        await first.publish_outbound(outbound(text, reply_to=None, channel="telegram"))

    async def all_arrived() -> bool:
        return sum(r.queue.qsize() for r in readers) >= len(sent)

    await buses.until(all_arrived)
    got = [r.queue.get_nowait().text for r in readers for _ in range(r.queue.qsize())]
    assert sorted(got) == sorted(sent)  # each once


async def test_a_gone_gateways_events_go_to_another_reader(buses: Buses) -> None:
    gone = RedisBus(buses.url, process="g-gone", config=buses.config(reader_ttl_ms=300))
    await gone.start()
    reader = Reader(gone, CHANNEL)
    await buses.until(lambda: buses.raw.exists(f"{buses.namespace}:outbound:to:g-gone:{CHANNEL}"))
    await gone.publish_inbound(inbound("hello", message_id="m1"))
    reader.task.cancel()
    await asyncio.gather(reader.task, return_exceptions=True)
    await gone.close()
    survivor = await buses.open("g2", reader_ttl_ms=300)
    reading = await buses.read(survivor, "g2")
    await buses.until(lambda: _gone(buses.raw, f"{buses.namespace}:outbound:to:g-gone:{CHANNEL}"))
    await survivor.publish_outbound(outbound("the answer, sent again", reply_to="m1", delivery_id="turn-1:3"))
    assert (await reading.get()).text == "the answer, sent again"


async def _gone(raw: aioredis.Redis, key: str) -> bool:
    return not await raw.exists(key)


async def test_rich_events_cross_the_bus_unchanged(buses: Buses, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ember.bus")
    gateway, worker = await buses.open("g1"), await buses.open("w1")
    reader = await buses.read(gateway, "g1")
    sent_in = inbound("private words", message_id="m1", sender_name="Ann", stream=True, can_approve=True,
                      metadata={"evaluation": "true"}, reply=None)
    await gateway.publish_inbound(sent_in)
    got_in = await take(worker)
    assert got_in == sent_in
    action = ToolAction("shell", Risk.EXECUTE, "rm -rf build", "Delete the build folder", '{"cmd": "rm"}')
    events = [
        outbound("private words", reply_to="m1", kind=OutboundKind.TOOL_CALL,
                 tool_call=ToolCall("call-1", "shell", '{"cmd": "rm"}')),
        outbound("Allow?", reply_to="m1", kind=OutboundKind.APPROVAL_REQUEST,
                 approval=ApprovalRequest("ap-1", "http:c1", "turn-1", action, 300.0,
                                          Explanation("Deletes files.", "high", "removes a folder"))),
        outbound("done", reply_to="m1", stream_full_text=True, delivery_id="turn-1:4",
                 usage=TurnUsage(input_tokens=120, cached_tokens=64, output_tokens=7)),
    ]
    for event in events:
        await worker.publish_outbound(event)
    assert [await reader.get() for _ in events] == events
    await worker.ack_inbound(got_in)
    assert "private words" not in caplog.text


# -- Redis away


async def test_redis_restarted_mid_run(buses: Buses, redis_server: RedisServer) -> None:
    gateway = await buses.open("g1", publish_timeout_s=0.5)
    worker = await buses.open("w1", publish_timeout_s=0.5)
    reader = await buses.read(gateway, "g1")
    await gateway.publish_inbound(inbound("before", message_id="m1"))
    event = await take(worker)
    await worker.publish_outbound(outbound("answer before", reply_to="m1"))
    assert (await reader.get()).text == "answer before"

    waiting = asyncio.create_task(worker.next_inbound())  # a consumer blocked when Redis goes
    redis_server.stop()
    try:
        with pytest.raises(BusUnavailable, match=r"message bus \(Redis at redis://127\.0\.0\.1:\d+/0\) is unreach"):
            await gateway.publish_inbound(inbound("while down", message_id="m2"))
        with pytest.raises(BusUnavailable):
            await worker.publish_outbound(outbound("answer while down", reply_to="m1"))
        await worker.ack_inbound(event)  # lost with Redis: logged, not raised
    finally:
        redis_server.start()
        await buses.raw.connection_pool.disconnect()  # the test's own client: its connections are stale

    await gateway.publish_inbound(inbound("after", message_id="m3"))
    after = await asyncio.wait_for(waiting, TIMEOUT)
    assert (after.message_id, after.text) == ("m3", "after")
    await worker.publish_outbound(outbound("answer after", reply_to="m3"))
    assert (await reader.get()).text == "answer after"
    await worker.ack_inbound(after)
    shard = f"{buses.namespace}:inbound:{shard_of(after.session_key, 2)}"
    assert (await buses.raw.xpending(shard, "workers"))["pending"] == 0


async def test_an_unreachable_redis_is_a_clear_error_without_the_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://ember:hunter2@127.0.0.1:{_free_port()}/0"
    bus = RedisBus(url, process="p1", config=RedisBusConfig(publish_timeout_s=0.3))
    with pytest.raises(BusUnavailable) as caught:
        await bus.start()
    assert "hunter2" not in str(caught.value)
    assert "redis://ember:***@127.0.0.1:" in str(caught.value)
    with pytest.raises(BusUnavailable):
        await bus.publish_inbound(inbound("hi"))
    await bus.close()
    assert "hunter2" not in caplog.text


def test_redacted_urls() -> None:
    assert redacted_url("redis://:s3cret@cache.internal:6380/2") == "redis://:***@cache.internal:6380/2"
    assert redacted_url("rediss://user@cache/0?password=s3cret") == "rediss://user@cache/0"
    assert redacted_url("redis://localhost") == "redis://localhost"


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        RedisBusConfig(shards=0)
    with pytest.raises(ConfigError):
        RedisBus("redis://localhost", process="host:1")
    with pytest.raises(ConfigError, match="not valid"):
        RedisBus("http://:s3cret@localhost", process="p1")


def test_the_shard_of_a_session_is_the_same_in_every_process() -> None:
    # CRC-32, not hash(): Python salts str hashes per process.
    assert [shard_of(key, 4) for key in ("http:alice:main", "telegram:42", "cli:local")] == [3, 1, 3]
    assert {shard_of(f"http:{i}", 4) for i in range(50)} == {0, 1, 2, 3}


async def test_a_stop_request_reaches_every_process_and_one_in_another_namespace_does_not(buses: Buses) -> None:
    gateway, first, second = [await buses.open(name) for name in ("gw", "w1", "w2")]
    elsewhere = RedisBus(buses.url, process="w3", config=buses.config(namespace=buses.namespace + "x"))
    await elsewhere.start()
    buses.stack.push_async_callback(elsewhere.close)
    listening = [asyncio.create_task(bus.next_stop()) for bus in (first, second, elsewhere)]

    async def subscribed() -> bool:
        counts = await buses.raw.pubsub_numsub(f"{buses.namespace}:stops", f"{buses.namespace}x:stops")
        return [n for _, n in counts] == [2, 1]

    await buses.until(subscribed)
    assert await gateway.publish_stop("http:alice:s1") is True
    assert await asyncio.wait_for(asyncio.gather(*listening[:2]), TIMEOUT) == ["http:alice:s1"] * 2
    # A stop of its own deployment, sent after: it hears that one first, so it never heard the other.
    assert await elsewhere.publish_stop("http:zoe:s1") is True
    assert await asyncio.wait_for(listening[2], TIMEOUT) == "http:zoe:s1", "another deployment's stop was heard"
