"""Session leases across processes sharing one EMBER_HOME (two runtimes here,
each with its own engine and locks, as two processes would have)."""

from __future__ import annotations

import asyncio

from ember.core.events import OutboundKind
from ember.core.messages import Message, Role
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.runtime.leases import HostLock
from tests.conftest import session_key


async def test_two_runtimes_on_one_session_take_turns_and_lose_nothing(start, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    first_in_model = asyncio.Event()
    release_first = asyncio.Event()
    refused = asyncio.Event()  # a runtime asked for the session's lock while the other held it
    try_acquire = HostLock.try_acquire

    def noting_refusals(lock: HostLock) -> bool:
        taken = try_acquire(lock)
        if not taken:
            refused.set()
        return taken

    monkeypatch.setattr(HostLock, "try_acquire", noting_refusals)

    async def slow(messages: list[Message], tools: object) -> ModelReply:
        first_in_model.set()
        await release_first.wait()
        return ModelReply(text="answer A")

    def quick(messages: list[Message], tools: object) -> ModelReply:
        return ModelReply(text="answer B")

    async with start(FunctionModel(slow)) as a, start(FunctionModel(quick)) as b:
        await a.publish("question A")
        await first_in_model.wait()
        await b.publish("question B")  # same session, while A holds it mid-turn
        await asyncio.wait_for(refused.wait(), 10)  # B waits for the lock A holds
        assert not b.chats["c1"].events, "B ran while A held the session"
        release_first.set()
        assert (await a.next_closing()).text == "answer A"
        assert (await b.next_closing()).text == "answer B"
        history = await a.runtime.sessions.history(session_key())
    assert [(m.role, m.content) for m in history] == [
        (Role.USER, "question A"), (Role.ASSISTANT, "answer A"),
        (Role.USER, "question B"), (Role.ASSISTANT, "answer B"),
    ]


async def test_a_cancelled_turn_says_so_once_and_keeps_the_question(start) -> None:  # type: ignore[no-untyped-def]
    in_model = asyncio.Event()

    async def hangs(messages: list[Message], tools: object) -> ModelReply:
        in_model.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async with start(FunctionModel(hangs)) as h:
        await h.publish("will be interrupted")
        await in_model.wait()
        await h.runtime.loop.stop(grace_s=0)
        events = h.chats["c1"].events
        await asyncio.sleep(0.05)
        history = await h.runtime.sessions.history(session_key())
        [trace] = await h.runtime.traces.for_session(session_key())
    assert [e.kind for e in events] == [OutboundKind.ERROR]
    assert "interrupted" in events[0].text
    assert [m.content for m in history] == ["will be interrupted"]
    assert trace.status == "cancelled"
