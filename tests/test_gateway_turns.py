"""The gateway's TurnRouter on a bus several gateways share: a request that missed part of its
turn's stream gets only the final, and one whose answer went to another gateway finds it in
the store (tests/test_cluster.py runs both across real processes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ember.channels.gateway.turns import SharedTurnRouter, TurnRequest, TurnRouter, chat_id
from ember.core.delivery import Delivery, Receipt
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind

IDENTITY, KEY, CLIENT_ID = "alice", "work", "m1"
MESSAGE_ID = f"{IDENTITY}:{CLIENT_ID}"

HI = TurnRequest(IDENTITY, KEY, "hi", stream=True, can_approve=True, client_id=CLIENT_ID)


@dataclass
class Bus:
    published: list[InboundEvent] = field(default_factory=list)

    async def publish_inbound(self, event: InboundEvent) -> None:
        self.published.append(event)


@dataclass
class Answers:
    """The store's receipts and answers, as a test sets them."""

    answer: Delivery | None = None
    looks: int = 0

    async def receipt(self, channel: str, chat: str, message_id: str) -> Receipt | None:
        self.looks += 1
        if self.answer is None:
            return None
        return Receipt(channel=channel, message_id=message_id, chat_id=chat, sender_id=IDENTITY,
                       turn_id=self.answer.turn_id, received_at=1.0, answered_at=2.0)

    async def answer_of(self, turn_id: str) -> Delivery | None:
        return self.answer


def recorded(kind: str = "final", text: str = "the answer", delivery_id: str = "t1:2") -> Delivery:
    return Delivery(delivery_id=delivery_id, turn_id="t1", channel="http", chat_id=chat_id(IDENTITY, KEY),
                    reply_to=MESSAGE_ID, kind=kind, text=text)


def event(kind: OutboundKind, text: str, index: int | None = None, **extra: Any) -> OutboundEvent:
    return OutboundEvent(channel="http", chat_id=chat_id(IDENTITY, KEY), kind=kind, text=text, turn_id="t1",
                         reply_to=MESSAGE_ID, stream_index=index, **extra)


async def received(router: TurnRouter, events: list[OutboundEvent], *, timeout_s: float = 2.0) -> list[str]:
    """What a request of MESSAGE_ID is handed (kind:text), up to its final or error."""
    got = []
    async with router.turn(HI) as queue:
        for outbound in events:
            await router.deliver(outbound)
        async with asyncio.timeout(timeout_s):
            while True:
                item = await queue.get()
                got.append(f"{item.kind.value}:{item.text}")
                if item.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
                    return got


async def test_a_request_that_joins_a_stream_midway_gets_only_the_final() -> None:
    router = TurnRouter(Bus())  # type: ignore[arg-type]
    got = await received(router, [event(OutboundKind.DELTA, "the ans", 3), event(OutboundKind.DELTA, "wer", 4),
                                  event(OutboundKind.FINAL, "the answer", stream_full_text=True)])
    assert got == ["final:the answer"]


async def test_a_stream_with_a_hole_is_not_shown_past_the_hole() -> None:
    router = TurnRouter(Bus())  # type: ignore[arg-type]
    got = await received(router, [event(OutboundKind.DELTA, "the", 0), event(OutboundKind.DELTA, " an", 1),
                                  event(OutboundKind.DELTA, "er", 3), event(OutboundKind.FINAL, "the answer")])
    assert got == ["delta:the", "delta: an", "final:the answer"]


async def test_a_whole_stream_is_shown_as_it_comes() -> None:
    router = TurnRouter(Bus())  # type: ignore[arg-type]
    got = await received(router, [event(OutboundKind.DELTA, "the", 0), event(OutboundKind.DELTA, " answer", 1),
                                  event(OutboundKind.FINAL, "the answer")])
    assert got == ["delta:the", "delta: answer", "final:the answer"]


async def test_an_answer_whose_event_went_astray_is_found_in_the_store() -> None:
    answers = Answers(recorded())
    router = SharedTurnRouter(Bus(), answers, look_after_s=0.05)  # type: ignore[arg-type]
    got = []
    async with router.turn(HI) as queue:
        async with asyncio.timeout(2):
            found = await queue.get()
    got.append((found.kind, found.text, found.delivery_id, found.stream_full_text))
    assert got == [(OutboundKind.FINAL, "the answer", "t1:2", True)]


async def test_an_error_recorded_before_a_retry_is_not_the_retrys_answer() -> None:
    answers = Answers(recorded("error", "Sorry, it failed", "t1:error:aa"))
    router = SharedTurnRouter(Bus(), answers, look_after_s=0.05)  # type: ignore[arg-type]
    async with router.turn(HI) as queue:
        async with asyncio.timeout(5):
            while answers.looks < 3:  # the look before it was sent, and two while it heard nothing
                await asyncio.sleep(0.01)
        assert queue.empty()  # it looked, and left the old error alone
        answers.answer = recorded("error", "Sorry, it failed again", "t1:error:bb")
        async with asyncio.timeout(2):
            found = await queue.get()
    assert (found.kind, found.text) == (OutboundKind.ERROR, "Sorry, it failed again")


async def test_a_request_that_hears_its_turn_does_not_look_in_the_store() -> None:
    answers = Answers()
    router = SharedTurnRouter(Bus(), answers, look_after_s=0.2)  # type: ignore[arg-type]
    async with router.turn(HI):
        assert answers.looks == 1  # what was recorded before it: nothing
        for index in range(8):
            await router.deliver(event(OutboundKind.DELTA, "x", index))
            await asyncio.sleep(0.05)
    assert answers.looks == 1


async def test_a_request_cancelled_again_as_it_ends_leaves_its_message_no_longer_in_flight() -> None:
    """Starlette cancels the streaming request of a client that left, and anyio cancels it again at
    each await until it has ended: its message must not stay "in flight" for every resend."""
    router = SharedTurnRouter(Bus(), Answers(), look_after_s=0.05)  # type: ignore[arg-type]
    entered = asyncio.Event()

    async def request() -> None:
        async with router.turn(HI) as queue:
            entered.set()
            await queue.get()

    task = asyncio.create_task(request())
    await asyncio.wait_for(entered.wait(), 5)
    for _ in range(5):
        task.cancel()
        await asyncio.sleep(0)
    await asyncio.gather(task, return_exceptions=True)
    assert not router.in_flight(IDENTITY, CLIENT_ID)
