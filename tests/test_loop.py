"""The agent loop: per-session order, cross-session concurrency, one error."""

from __future__ import annotations

import asyncio

import pytest

from ember.bus.base import Bus
from ember.bus.memory import InProcessBus
from ember.bus.redis import WORKERS, RedisBus
from ember.config.settings import Settings
from ember.core.errors import ModelError
from ember.core.events import InboundEvent, OutboundKind
from ember.core.messages import Message, Role
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel, ScriptedModel
from tests.conftest import CHANNEL, SENDER, session_key
from tests.pgserver import RUNTIMES, engine_settings


@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """The loop's sessions, leases and inbox on SQLite, on PostgreSQL, and on PostgreSQL with the
    Redis bus."""
    return engine_settings(settings, request.param, request)


async def waiting_on_the_bus(bus: Bus) -> int:
    """How many published messages no worker has been handed yet."""
    if isinstance(bus, InProcessBus):
        return bus._inbound.qsize()
    assert isinstance(bus, RedisBus) and not bus._ready, "nothing taken off Redis beyond the turns it runs"
    # Acknowledged entries are deleted: what a stream holds is pending (handed out) or never read.
    held = sum([await bus._client.xlen(stream) for stream in bus._shards])
    handed = sum([(await bus._client.xpending(stream, WORKERS))["pending"] for stream in bus._shards])
    return held - handed


async def test_turns_of_one_session_run_one_at_a_time_in_arrival_order(start) -> None:  # type: ignore[no-untyped-def]
    active = 0
    max_active = 0

    async def answer(messages: list[Message], tools: object) -> ModelReply:
        nonlocal active, max_active
        active += 1
        max_active = max(max_active, active)
        await asyncio.sleep(0.005)
        active -= 1
        # The model sees the previous turns complete: it answers the last user message.
        return ModelReply(text=f"re: {messages[-1].content}")

    async with start(FunctionModel(answer)) as h:
        for i in range(20):
            await h.publish(f"m{i}")
        finals = [await h.next_closing() for _ in range(20)]
        history = await h.runtime.sessions.history(session_key())
    assert max_active == 1
    assert [f.text for f in finals] == [f"re: m{i}" for i in range(20)]
    assert [m.content for m in history] == [x for i in range(20) for x in (f"m{i}", f"re: m{i}")]


async def test_different_sessions_run_concurrently(start) -> None:  # type: ignore[no-untyped-def]
    arrived = 0
    all_in = asyncio.Event()

    async def answer(messages: list[Message], tools: object) -> ModelReply:
        nonlocal arrived
        arrived += 1
        if arrived == 5:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), 10)  # only returns if all five are in flight together
        return ModelReply(text="ok")

    async with start(FunctionModel(answer)) as h:
        for chat in "abcde":
            await h.publish("hi", chat=chat)
        finals = [await h.next_closing(chat) for chat in "abcde"]
    assert all(f.kind is OutboundKind.FINAL for f in finals)


async def test_a_process_runs_at_most_max_concurrent_turns_and_leaves_the_rest_on_the_bus(  # type: ignore[no-untyped-def]
        start, settings) -> None:
    in_flight: list[str] = []
    release = asyncio.Event()

    async def answer(messages: list[Message], tools: object) -> ModelReply:
        in_flight.append(messages[-1].content)
        await asyncio.wait_for(release.wait(), 10)
        return ModelReply(text=f"re: {messages[-1].content}")

    config = settings.model_copy(update={"max_concurrent_turns": 2})
    async with start(FunctionModel(answer), config=config) as h:
        for chat in "abcd":
            await h.publish(f"to {chat}", chat=chat)
        slots = h.runtime.loop._slots
        while len(in_flight) < 2 or not slots.waiting:  # two turns run, and the loop waits for a slot
            await asyncio.sleep(0.01)
        assert len(in_flight) == 2, "two turns at once"
        assert await waiting_on_the_bus(h.runtime.bus) == 2, "the others wait on the bus, not in this process"
        release.set()
        finals = [await h.next_closing(chat) for chat in "abcd"]
    assert [f.text for f in finals] == [f"re: to {chat}" for chat in "abcd"]


async def test_model_failure_gives_exactly_one_clear_error_and_keeps_the_user_message(start) -> None:  # type: ignore[no-untyped-def]
    model = ScriptedModel([ModelError("model m at http://x failed after 4 attempts: HTTP 503")])
    async with start(model) as h:
        closing = await h.turn("hello", stream=True)
        await h.settled()  # anything sent after the error has arrived by now
        events = h.chats["c1"].events
        history = await h.runtime.sessions.history(session_key())
        traces = await h.runtime.traces.for_session(session_key())
    assert closing.kind is OutboundKind.ERROR
    assert "HTTP 503" in closing.text
    assert [e.kind for e in events if e.kind in (OutboundKind.FINAL, OutboundKind.ERROR)] == [OutboundKind.ERROR]
    assert [(m.role, m.content) for m in history] == [(Role.USER, "hello")]
    assert traces[0].status == "failed" and "HTTP 503" in (traces[0].error or "")


async def test_an_internal_bug_is_reported_without_leaking_details(start) -> None:  # type: ignore[no-untyped-def]
    def broken(messages: list[Message], tools: object) -> ModelReply:
        raise KeyError("internal detail")

    async with start(FunctionModel(broken)) as h:
        closing = await h.turn("hello")
    assert closing.kind is OutboundKind.ERROR
    assert "KeyError" in closing.text and "internal detail" not in closing.text


async def test_the_session_goes_on_after_a_failed_turn(start) -> None:  # type: ignore[no-untyped-def]
    model = ScriptedModel([ModelError("down"), ModelReply(text="back")])
    async with start(model) as h:
        assert (await h.turn("first")).kind is OutboundKind.ERROR
        assert (await h.turn("second")).text == "back"
    # The second request saw both user messages: nothing was lost, nothing duplicated.
    assert [m.content for m in model.requests[1] if m.role is Role.USER] == ["first", "second"]
    model.assert_complete()


async def test_stop_lets_a_turn_in_flight_finish(start) -> None:  # type: ignore[no-untyped-def]
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(messages: list[Message], tools: object) -> ModelReply:
        entered.set()
        await release.wait()
        return ModelReply(text="finished")

    async with start(FunctionModel(slow)) as h:
        await h.publish("work")
        await asyncio.wait_for(entered.wait(), 10)
        stopping = asyncio.create_task(h.runtime.loop.stop(grace_s=5))
        await asyncio.sleep(0.05)  # stop's chance to return too early: nothing it awaits says it waits
        assert not stopping.done()
        release.set()
        await stopping
        assert h.runtime.loop.idle.is_set()  # it returned once the turn had ended
        history = await h.runtime.sessions.history(session_key())
    assert history[-1].content == "finished"


async def test_the_history_an_event_brings_begins_a_new_session_once(start) -> None:  # type: ignore[no-untyped-def]
    model = FunctionModel(lambda messages, tools: ModelReply(text=f"answer {len(messages)}"))
    brought = (Message.user("I am Ada.", name="Ada"), Message.assistant("Hello, Ada."))

    def event(text: str) -> InboundEvent:
        return InboundEvent(channel=CHANNEL, chat_id="seeded", sender_id=SENDER, text=text, message_id=text,
                            history=brought)

    async with start(model) as h:
        await h.runtime.bus.publish_inbound(event("Who am I?"))
        first = await h.next_closing("seeded")
        # The brought turns come before the question, each once.
        shown = [(m.role, m.content) for m in model.requests[-1] if m.role is not Role.SYSTEM]
        assert shown == [(Role.USER, "I am Ada."), (Role.ASSISTANT, "Hello, Ada."), (Role.USER, "Who am I?")]
        await h.runtime.bus.publish_inbound(event("Again?"))  # the session has messages: the history is not added
        await h.next_closing("seeded")
        stored = await h.runtime.sessions.history(session_key("seeded"))
    assert [(m.role, m.content, m.name) for m in stored] == [
        (Role.USER, "I am Ada.", "Ada"), (Role.ASSISTANT, "Hello, Ada.", None), (Role.USER, "Who am I?", None),
        (Role.ASSISTANT, first.text, None), (Role.USER, "Again?", None), (Role.ASSISTANT, "answer 6", None)]
    assert [m.turn_id is None for m in stored] == [True, True, False, False, False, False]
