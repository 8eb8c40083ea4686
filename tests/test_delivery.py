"""Exactly-once delivery (I1, I2): the inbox of accepted messages, the outbox of
answers owed, redeliveries, start-up recovery and re-sends.

In process: the real runtime (its store on SQLite and on PostgreSQL, bus, loop,
delivery worker) on scripted models; a "crash" is a runtime stopped while its
turn waits on the model. Then the same guarantees through `ember serve`, over
real HTTP.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import pytest

from ember.app.database import open_database
from ember.config.settings import Settings
from ember.core.attachments import Attachment
from ember.core.delivery import Delivery, Receipt, delivery_id
from ember.core.errors import ModelError
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind, ReplyRoute
from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import Risk, ToolRun
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel, ScriptedModel
from ember.runtime.loop import NOT_RESUMED_TEXT
from ember.store.deliveries import SqlDeliveryStore
from ember.store.sessions import SqlSessionStore
from ember.tools.base import ToolRegistry, TurnTool
from tests.conftest import CHANNEL, Harness, NoteArgs, note_tool, serving_runtime, session_key
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, Reply, serving
from tests.pgserver import ENGINES, RUNTIMES, engine_settings
from tests.sse import chunks, events

# --- the runtime, started and stopped as a process would -----------------------------------------


@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """The runtime's inbox and outbox (the delivery store) on SQLite, on PostgreSQL, and on PostgreSQL
    with the Redis bus."""
    return engine_settings(settings, request.param, request)


class Blocking:
    """A model function that answers `steps` first, then waits for `release`: the turn stays in flight."""

    def __init__(self, text: str = "late answer", steps: tuple[ModelReply, ...] = ()) -> None:
        self.text = text
        self.steps = list(steps)
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, messages: list[Message], tools: object) -> ModelReply:
        if self.steps:
            return self.steps.pop(0)
        self.entered.set()
        await self.release.wait()
        return ModelReply(text=self.text)


async def cut_off_turn(settings: Settings, text: str, message_id: str, *, steps: tuple[ModelReply, ...] = (),
                       tools: ToolRegistry | None = None) -> None:
    """Leave `text` accepted and unanswered: the process stops while the model is still working on it
    (after the tool `steps`, which are committed)."""
    blocking = Blocking(steps=steps)
    async with serving_runtime(settings, FunctionModel(blocking), tools=tools) as h:
        await h.publish(text, message_id=message_id)
        await asyncio.wait_for(blocking.entered.wait(), 10)
        await h.runtime.loop.stop(grace_s=0)  # the turn is cut off before it answers
        closing = await h.next_closing()
    assert closing.kind is OutboundKind.ERROR  # "interrupted", nothing committed as an answer


async def undelivered(settings: Settings, channels: Iterable[str] = (CHANNEL,)) -> list[Delivery]:
    async with open_database(settings) as db:
        return await SqlDeliveryStore(db).undelivered(channels)


async def history(settings: Settings, key: str = session_key()) -> list[Message]:
    async with open_database(settings) as db:
        return await SqlSessionStore(db).history(key)


def shapes(messages: list[Message]) -> list[tuple[Role, str]]:
    return [(m.role, m.content) for m in messages]


def closings(h: Harness, chat: str = "c1") -> list[OutboundEvent]:
    return [e for e in h.chats[chat].events if e.kind in (OutboundKind.FINAL, OutboundKind.ERROR)]


def assert_delivery_id_names_the_answer(final: OutboundEvent, stored: list[Message]) -> None:
    """`<turn_id>:<seq>`, where seq is the committed answer's, of the same turn, with the same text."""
    assert final.delivery_id is not None
    turn_id, _, seq = final.delivery_id.rpartition(":")
    [answer] = [m for m in stored if m.seq == int(seq)]
    assert (answer.role, answer.tool_calls, answer.turn_id, answer.content) == (
        Role.ASSISTANT, (), turn_id, final.text)
    assert final.turn_id == turn_id


# --- redeliveries --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_redelivered_message_gets_its_recorded_answer_again(settings: Settings, stream: bool) -> None:
    model = ScriptedModel([ModelReply(text="the one answer")])
    async with serving_runtime(settings, model) as h:
        await h.publish("question", message_id="m1", stream=stream)
        first = await h.next_closing()
        await h.publish("question", message_id="m1", stream=stream)
        again = await h.next_closing()
        await h.settled()
        sent = h.chats["c1"].events
    assert first.kind is again.kind is OutboundKind.FINAL
    assert again.text == first.text == "the one answer"
    assert again.delivery_id == first.delivery_id is not None
    assert again.stream_full_text  # it replaces whatever draft the channel shows
    assert [e.kind for e in sent[sent.index(first) + 1:]] == [OutboundKind.FINAL]  # no deltas the second time
    assert len(model.requests) == 1
    assert shapes(await history(settings)) == [(Role.USER, "question"), (Role.ASSISTANT, "the one answer")]


async def test_a_redelivery_while_the_first_turn_runs_gets_the_same_answer(settings: Settings) -> None:
    blocking = Blocking("answered once")
    model = FunctionModel(blocking)
    async with serving_runtime(settings, model) as h:
        await h.publish("question", message_id="m1")
        await asyncio.wait_for(blocking.entered.wait(), 10)
        await h.publish("question", message_id="m1")  # the channel delivered it twice
        await asyncio.sleep(0.05)
        blocking.release.set()
        first, second = await h.next_closing(), await h.next_closing()
        await h.settled()
        assert closings(h) == [first, second]
    assert first.kind is second.kind is OutboundKind.FINAL
    assert first.text == second.text == "answered once"
    assert first.delivery_id == second.delivery_id is not None
    assert len(model.requests) == 1
    assert shapes(await history(settings)) == [(Role.USER, "question"), (Role.ASSISTANT, "answered once")]


async def test_a_redelivery_of_a_failed_turn_is_a_retry(settings: Settings) -> None:
    model = ScriptedModel([ModelError("the model is down"), ModelReply(text="back up")])
    async with serving_runtime(settings, model) as h:
        await h.publish("question", message_id="m1")
        failed = await h.next_closing()
        await h.publish("question", message_id="m1")
        retried = await h.next_closing()
        await h.publish("question", message_id="m1")  # answered now: the record, not a third call
        resent = await h.next_closing()
    assert failed.kind is OutboundKind.ERROR and "the model is down" in failed.text
    assert retried.kind is OutboundKind.FINAL and retried.text == "back up"
    assert (resent.text, resent.delivery_id) == (retried.text, retried.delivery_id)
    # The retry saw the question once: it was accepted once, by the first delivery.
    assert [m.content for m in model.requests[1] if m.role is Role.USER] == ["question"]
    model.assert_complete()
    stored = await history(settings)
    assert shapes(stored) == [(Role.USER, "question"), (Role.ASSISTANT, "back up")]
    assert_delivery_id_names_the_answer(retried, stored)


async def test_a_message_without_an_id_is_still_accepted_once(settings: Settings) -> None:
    async with serving_runtime(settings, ScriptedModel([ModelReply(text="a"), ModelReply(text="b")])) as h:
        await h.runtime.bus.publish_inbound(InboundEvent(channel=CHANNEL, chat_id="c1", sender_id="tester",
                                                         text="one"))
        first = await h.next_closing()
        second = await h.turn("two")
    assert first.kind is second.kind is OutboundKind.FINAL
    assert first.delivery_id != second.delivery_id
    async with open_database(settings) as db:
        assert await SqlDeliveryStore(db).unanswered() == []


# --- recovery at start-up ------------------------------------------------------------------------


async def test_recovery_resumes_a_cut_off_turn_once(settings: Settings) -> None:
    await cut_off_turn(settings, "question", "m1")
    [accepted] = await history(settings)
    model = ScriptedModel([ModelReply(text="resumed answer")])
    async with serving_runtime(settings, model, channels=[CHANNEL], recover=True) as h:
        final = await h.next_closing()
        await h.settled()
        assert closings(h) == [final]
    assert final.kind is OutboundKind.FINAL and final.text == "resumed answer"
    assert final.reply_to == "m1" and final.turn_id == accepted.turn_id
    # The model saw the original question once; it was not written a second time.
    assert [(m.role, m.content) for m in model.requests[0] if m.role is not Role.SYSTEM] == [(Role.USER, "question")]
    stored = await history(settings)
    assert shapes(stored) == [(Role.USER, "question"), (Role.ASSISTANT, "resumed answer")]
    assert final.delivery_id == delivery_id(accepted.turn_id or "", 1)
    assert_delivery_id_names_the_answer(final, stored)
    assert await undelivered(settings) == []


async def test_recovery_picks_up_after_the_committed_tool_steps(settings: Settings) -> None:
    noted: list[str] = []
    step = ModelReply(tool_calls=(ToolCall(id="call_1", name="note", arguments='{"text": "x"}'),))
    await cut_off_turn(settings, "question", "m1", steps=(step,), tools=ToolRegistry([note_tool(noted)]))
    model = ScriptedModel([ModelReply(text="done after the note")])
    async with serving_runtime(settings, model, channels=[CHANNEL], recover=True,
                               tools=ToolRegistry([note_tool(noted)])) as h:
        final = await h.next_closing()
    assert final.text == "done after the note"
    assert noted == ["x"]  # the committed step is not run again
    assert [m.role for m in model.requests[0]] == [Role.SYSTEM, Role.USER, Role.ASSISTANT, Role.TOOL]
    assert shapes(await history(settings)) == [
        (Role.USER, "question"), (Role.ASSISTANT, ""), (Role.TOOL, "noted x"), (Role.ASSISTANT, "done after the note"),
    ]


async def test_a_resumed_turns_answer_sends_the_files_its_committed_steps_sent(settings: Settings) -> None:
    chart = Attachment(digest="c" * 64, media_type="image/png", size=71, name="chart.png")

    async def send(args: Any, run: ToolRun) -> str:  # send_file's bookkeeping, without the workspace
        run.files.append(chart)
        return "chart.png will be sent with your answer."
    tools = ToolRegistry([TurnTool("send_chart", "Send the chart.", NoteArgs, send, risk=Risk.READ)])
    step = ModelReply(tool_calls=(ToolCall(id="call_1", name="send_chart", arguments='{"text": "x"}'),))
    await cut_off_turn(settings, "the chart, please", "m1", steps=(step,), tools=tools)
    async with serving_runtime(settings, ScriptedModel([ModelReply(text="Here it is.")]), channels=[CHANNEL],
                               recover=True, tools=tools) as h:
        final = await h.next_closing()
    assert final.text == "Here it is." and final.attachments == (chart,)
    assert (await history(settings))[-1].attachments == (chart,)


@pytest.mark.parametrize("policy", [{"resume_window_s": 0}, {"interrupted_turns": "notice"}])
async def test_recovery_outside_the_window_answers_with_a_notice(settings: Settings, policy: dict[str, Any]) -> None:
    await cut_off_turn(settings, "question", "m1")
    [accepted] = await history(settings)
    model = ScriptedModel([])
    async with serving_runtime(settings.model_copy(update=policy), model, channels=[CHANNEL], recover=True) as h:
        final = await h.next_closing()
        await h.settled()
        assert closings(h) == [final]
    assert final.kind is OutboundKind.FINAL and final.text == NOT_RESUMED_TEXT
    assert final.reply_to == "m1" and final.delivery_id == delivery_id(accepted.turn_id or "", 1)
    assert model.requests == []
    stored = await history(settings)
    assert shapes(stored) == [(Role.USER, "question"), (Role.ASSISTANT, NOT_RESUMED_TEXT)]
    assert_delivery_id_names_the_answer(final, stored)


@pytest.mark.parametrize("settings", ["postgresql+redis"], indirect=True)
async def test_a_later_message_waits_for_the_cut_off_one_on_a_shared_bus(settings: Settings) -> None:
    """The cut-off message's entry is still pending on Redis, under the process that stopped: a
    later message of its session waits until that entry is taken over, the cut-off turn is resumed
    and answers its own question, and only then is the later one answered (issue: per-session
    order across workers and deaths)."""
    settings = settings.model_copy(update={"worker_timeout_s": 1.0})
    await cut_off_turn(settings, "first question", "m1")
    model = ScriptedModel([ModelReply(text="answer to the first"), ModelReply(text="answer to the second")])
    async with serving_runtime(settings, model) as h:
        await h.publish("second question", message_id="m2")
        first, second = await h.next_closing(), await h.next_closing()
        await h.publish("first question", message_id="m1")  # the channel delivers the cut-off one again
        again = await h.next_closing()
    assert [(e.text, e.reply_to) for e in (first, second)] == [("answer to the first", "m1"),
                                                               ("answer to the second", "m2")]
    assert (again.text, again.reply_to, again.delivery_id) == (first.text, "m1", first.delivery_id)
    assert len(model.requests) == 2
    assert shapes(await history(settings)) == [
        (Role.USER, "first question"), (Role.ASSISTANT, "answer to the first"),
        (Role.USER, "second question"), (Role.ASSISTANT, "answer to the second")]


# On Redis the later message waits for the cut-off one instead (the test above).
@pytest.mark.parametrize("settings", ENGINES, indirect=True)
async def test_a_cut_off_turn_redelivered_after_a_later_message_gets_the_notice_not_the_later_answer(
        settings: Settings) -> None:
    """Resumed then, the turn would answer the later question (the model reads the history to
    its end), and the first question's asker would get the second's answer."""
    await cut_off_turn(settings, "first question", "m1")
    model = ScriptedModel([ModelReply(text="answer to the second")])
    async with serving_runtime(settings, model) as h:
        await h.publish("second question", message_id="m2")
        assert (await h.next_closing()).text == "answer to the second"
        await h.publish("first question", message_id="m1")  # the channel delivers the cut-off one again
        again = await h.next_closing()
    assert (again.kind, again.text, again.reply_to) == (OutboundKind.FINAL, NOT_RESUMED_TEXT, "m1")
    assert len(model.requests) == 1
    assert shapes(await history(settings)) == [
        (Role.USER, "first question"), (Role.USER, "second question"), (Role.ASSISTANT, "answer to the second"),
        (Role.ASSISTANT, NOT_RESUMED_TEXT)]


# On Redis the later message waits for the cut-off one instead (the test above).
@pytest.mark.parametrize("settings", ENGINES, indirect=True)
async def test_a_cut_off_turn_gets_the_notice_also_when_consolidation_left_no_question_in_the_window(
        settings: Settings) -> None:
    """Whether a later question came is read from the whole history, not from the window since
    the consolidation boundary, which may hold answers only."""
    await cut_off_turn(settings, "first question", "m1")
    model = ScriptedModel([ModelReply(text="answer to the second")])
    async with serving_runtime(settings, model) as h:
        await h.publish("second question", message_id="m2")
        assert (await h.next_closing()).text == "answer to the second"
        # Both questions behind the boundary: the window holds the answer alone.
        assert await h.runtime.sessions.advance_boundary(session_key(), expected=0, new=2, summary="two questions")
        await h.publish("first question", message_id="m1")
        again = await h.next_closing()
    assert (again.kind, again.text, again.reply_to) == (OutboundKind.FINAL, NOT_RESUMED_TEXT, "m1")
    assert len(model.requests) == 1


async def test_recovery_leaves_answered_messages_alone(settings: Settings) -> None:
    async with serving_runtime(settings, ScriptedModel([ModelReply(text="answered")])) as h:
        await h.publish("question", message_id="m1")
        await h.next_closing()
    model = ScriptedModel([])
    async with serving_runtime(settings, model, channels=[CHANNEL], recover=True) as h:
        await h.settled()
        assert h.chats["c1"].events == []
    assert model.requests == []
    assert shapes(await history(settings)) == [(Role.USER, "question"), (Role.ASSISTANT, "answered")]


async def test_recovery_is_idempotent(settings: Settings) -> None:
    await cut_off_turn(settings, "question", "m1")
    blocking = Blocking("resumed once")
    model = FunctionModel(blocking)
    async with serving_runtime(settings, model, channels=[CHANNEL], recover=True) as h:
        await asyncio.wait_for(blocking.entered.wait(), 10)
        await h.publish("question", message_id="m1")  # the channel redelivers it while it is being resumed
        blocking.release.set()
        final, resent = await h.next_closing(), await h.next_closing()
        await h.settled()
        assert closings(h) == [final, resent]
    assert (final.text, resent.text) == ("resumed once", "resumed once")
    assert final.delivery_id == resent.delivery_id is not None
    async with serving_runtime(settings, model, channels=[CHANNEL], recover=True) as h:
        await h.settled()
        assert h.chats["c1"].events == []  # recovered again: neither resumed nor re-sent
    assert len(model.requests) == 1
    assert shapes(await history(settings)) == [(Role.USER, "question"), (Role.ASSISTANT, "resumed once")]


async def test_a_redelivery_of_a_cut_off_message_resumes_it(settings: Settings) -> None:
    await cut_off_turn(settings, "question", "m1")
    model = ScriptedModel([ModelReply(text="picked up")])
    async with serving_runtime(settings, model) as h:  # no recovery: the channel sends it again
        await h.publish("question", message_id="m1")
        final = await h.next_closing()
    assert final.text == "picked up"
    assert [m.content for m in model.requests[0] if m.role is Role.USER] == ["question"]
    assert shapes(await history(settings)) == [(Role.USER, "question"), (Role.ASSISTANT, "picked up")]


# --- the outbox: answers committed but never confirmed -------------------------------------------


async def commit_unconfirmed_answer(settings: Settings, *, channel: str = CHANNEL, chat: str = "c1",
                                    message_id: str = "m1") -> Delivery:
    """The state a crash between the commit of an answer and its delivery leaves, through the store API."""
    settings.home_dir.mkdir(parents=True, exist_ok=True)
    turn_id = uuid.uuid4().hex
    async with open_database(settings) as db:
        sessions = SqlSessionStore(db)
        session = await sessions.load(f"{channel}:{chat}")
        receipt = Receipt(channel=channel, message_id=message_id, chat_id=chat, sender_id="tester", turn_id=turn_id)
        await sessions.append(session, [Message.user("question", turn_id=turn_id)], receipt=receipt)
        owed = Delivery(delivery_id=delivery_id(turn_id, session.next_seq), turn_id=turn_id, channel=channel,
                        chat_id=chat, reply_to=message_id, kind="final", text="the committed answer")
        await sessions.append(session, [Message.assistant(owed.text, turn_id=turn_id)], delivery=owed)
    return owed


async def test_an_unconfirmed_answer_is_resent_at_the_next_start_then_confirmed(settings: Settings) -> None:
    owed = await commit_unconfirmed_answer(settings)
    model = ScriptedModel([])
    async with serving_runtime(settings, model, channels=[CHANNEL], recover=True) as h:
        final = await h.next_closing()
        await h.settled()
        assert closings(h) == [final]
    assert (final.kind, final.text, final.delivery_id, final.reply_to) == (
        OutboundKind.FINAL, owed.text, owed.delivery_id, "m1")
    assert final.stream_full_text
    assert await undelivered(settings) == []
    async with serving_runtime(settings, model, channels=[CHANNEL], recover=True) as h:
        await h.settled()
        assert h.chats["c1"].events == []  # confirmed: not sent a second time
    assert model.requests == []  # an answered message is neither resumed nor retried


async def test_answers_owed_to_channels_not_served_are_left_alone(settings: Settings) -> None:
    owed = await commit_unconfirmed_answer(settings, channel="other")
    async with serving_runtime(settings, ScriptedModel([]), channels=[CHANNEL]) as h:
        await h.settled()
        assert h.chats["c1"].events == []
    assert await undelivered(settings, ["other"]) == [owed]
    async with serving_runtime(settings, ScriptedModel([]), channels=["other"]) as h:
        resent = await asyncio.wait_for(h.runtime.bus.next_outbound("other"), 5)
    assert (resent.text, resent.delivery_id) == (owed.text, owed.delivery_id)
    assert await undelivered(settings, ["other"]) == []


# --- delivery ids --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_every_final_carries_its_turn_and_seq_as_delivery_id(settings: Settings, stream: bool) -> None:
    step = ModelReply(tool_calls=(ToolCall(id="call_1", name="note", arguments='{"text": "a"}'),
                                  ToolCall(id="call_2", name="note", arguments='{"text": "b"}')))
    model = ScriptedModel([ModelReply(text="plain"), step, ModelReply(text="after tools"),
                           ModelReply(text="<think>hidden</think>visible"), ModelReply(text="again")])
    async with serving_runtime(settings, model, tools=ToolRegistry([note_tool([])])) as h:
        finals = [await h.turn(text, stream=stream) for text in ("one", "two", "three")]
        await h.publish("two", message_id="two-again", stream=stream)
        await h.next_closing()  # a new message (another id): a new turn, not a re-send
    stored = await history(settings)
    assert [f.text for f in finals] == ["plain", "after tools", "visible"]
    for final in finals:
        assert final.kind is OutboundKind.FINAL
        assert_delivery_id_names_the_answer(final, stored)
    assert [f.delivery_id.rpartition(":")[2] for f in finals if f.delivery_id] == ["1", "6", "8"]


# --- bugs found ----------------------------------------------------------------------------------


async def test_message_ids_of_two_chats_are_two_messages(settings: Settings) -> None:
    model = FunctionModel(lambda messages, tools: ModelReply(text=f"re: {messages[-1].content}"))
    async with serving_runtime(settings, model) as h:
        await h.publish("alice's secret", chat="a", message_id="1")
        await h.next_closing("a")
        await h.publish("bob's question", chat="b", message_id="1")
        to_b = await h.next_closing("b")
    assert "secret" not in to_b.text
    assert to_b.text == "re: bob's question"
    assert shapes(await history(settings, session_key("b"))) == [
        (Role.USER, "bob's question"), (Role.ASSISTANT, "re: bob's question")]


async def test_an_error_already_shown_is_not_sent_again_at_the_next_start(settings: Settings) -> None:
    async with serving_runtime(settings, ScriptedModel([ModelError("the model is down")])) as h:
        await h.publish("question", message_id="m1")
        shown = await h.next_closing()
    assert shown.kind is OutboundKind.ERROR
    async with serving_runtime(settings, ScriptedModel([]), channels=[CHANNEL]) as h:
        await h.settled()
        assert closings(h) == []


async def test_recovery_does_not_mark_delivered_what_no_served_channel_received(settings: Settings) -> None:
    settings.home_dir.mkdir(parents=True, exist_ok=True)
    async with open_database(settings) as db:
        sessions = SqlSessionStore(db)
        session = await sessions.load("other:c9")
        receipt = Receipt(channel="other", message_id="m9", chat_id="c9", sender_id="u", turn_id="t9")
        await sessions.append(session, [Message.user("for the other channel", turn_id="t9")], receipt=receipt)
    model = ScriptedModel([ModelReply(text="answer for other"), ModelReply(text="answer for other")])
    async with serving_runtime(settings, model, channels=[CHANNEL], recover=True) as h:
        await h.settled()
    async with open_database(settings) as db:
        deliveries = SqlDeliveryStore(db)
        left_for_its_channel = await deliveries.unanswered() != [] or await deliveries.undelivered(["other"]) != []
    assert left_for_its_channel, "answered on a channel nobody serves, and recorded as delivered"
    async with serving_runtime(settings, model, channels=["other"], recover=True) as h:
        received = await asyncio.wait_for(h.runtime.bus.next_outbound("other"), 5)
    assert (received.kind, received.text) == (OutboundKind.FINAL, "answer for other")


# --- through the gateway: `ember serve` over HTTP ------------------------------------------------

SECRETS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}


def auth(identity: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[identity]}"}


@pytest.fixture(scope="module")
def model_module() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture
def model(model_module: ModelServer) -> Iterator[ModelServer]:
    model_module.responder = None
    model_module.requests.clear()
    yield model_module
    model_module.responder = None


@pytest.fixture(scope="module")
def gateway(model_module: ModelServer, launch_module_gateway: LaunchGateway) -> GatewayProcess:
    return launch_module_gateway(model_module, keys=SECRETS, EMBER_MODEL_MAX_ATTEMPTS="1")


def native_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    return [(event.name or "", event.json()) for event in events(response.iter_lines())]


def native_send(gateway: GatewayProcess, identity: str, key: str, body: dict[str, Any]) -> list[tuple[str, dict]]:
    with httpx.stream("POST", gateway.url(f"/api/sessions/{key}/messages"), json=body, headers=auth(identity),
                      timeout=30) as response:
        assert response.status_code == 200, response.read()
        return native_events(response)


def closing_of(events: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    [closing] = [(kind, data) for kind, data in events if kind in ("final", "error")]
    return closing


def gateway_history(gateway: GatewayProcess, identity: str, key: str) -> list[tuple[str, str]]:
    response = httpx.get(gateway.url(f"/api/sessions/{key}/messages"), headers=auth(identity), timeout=10)
    assert response.status_code == 200, response.text
    return [(m["role"], m["content"]) for m in response.json()["messages"]]


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_gateway_native_resend_gets_the_recorded_answer(gateway: GatewayProcess, model: ModelServer) -> None:
    key, message_id = fresh("native"), fresh("msg")
    model.push(Reply(text="answered once"))
    first = closing_of(native_send(gateway, "alice", key, {"text": "question", "message_id": message_id}))
    again = native_send(gateway, "alice", key, {"text": "question", "message_id": message_id})
    assert first[0] == "final" and first[1]["text"] == "answered once"
    assert [kind for kind, _ in again] == ["final"]  # the record, without a second stream
    assert again[0][1]["text"] == "answered once" and again[0][1]["delivery_id"] == first[1]["delivery_id"]
    assert len(model.requests) == 1
    assert gateway_history(gateway, "alice", key) == [("user", "question"), ("assistant", "answered once")]


@pytest.mark.parametrize("stream", [False, True])
def test_gateway_openai_idempotency_key_gets_the_recorded_answer(gateway: GatewayProcess, model: ModelServer,
                                                                 stream: bool) -> None:
    key, idempotency = fresh("openai"), fresh("idem")
    model.push(Reply(text="the answer"))
    headers = {**auth("alice"), "X-Ember-Session": key, "Idempotency-Key": idempotency}
    body = {"model": "ember", "messages": [{"role": "user", "content": "question"}], "stream": stream}
    texts = []
    for _ in range(2):
        response = httpx.post(gateway.url("/v1/chat/completions"), json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        if stream:
            texts.append("".join(c["choices"][0]["delta"].get("content") or ""
                                 for c in chunks(response.text.splitlines())))
        else:
            texts.append(response.json()["choices"][0]["message"]["content"])
    assert texts == ["the answer", "the answer"]
    assert len(model.requests) == 1
    assert gateway_history(gateway, "alice", key) == [("user", "question"), ("assistant", "the answer")]


def test_gateway_resend_while_the_first_streams_is_409_in_flight(gateway: GatewayProcess,
                                                                 model: ModelServer) -> None:
    key, message_id = fresh("flight"), fresh("msg")
    model.push(Reply(text=" ".join(f"word{i}" for i in range(40)), chunk_delay_s=0.03))
    body = {"text": "slow question", "message_id": message_id}
    with httpx.stream("POST", gateway.url(f"/api/sessions/{key}/messages"), json=body, headers=auth("alice"),
                      timeout=30) as first:
        lines = first.iter_lines()
        assert any(line == "event: delta" for line in lines)  # the first is streaming now
        native = httpx.post(gateway.url(f"/api/sessions/{key}/messages"), json=body, headers=auth("alice"),
                            timeout=10)
        openai = httpx.post(gateway.url("/v1/chat/completions"), timeout=10,
                            headers={**auth("alice"), "X-Ember-Session": key, "Idempotency-Key": message_id},
                            json={"model": "ember", "messages": [{"role": "user", "content": "slow question"}]})
        rest = list(lines)
    for response in (native, openai):
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "in_flight"
    assert "event: final" in rest
    assert len(model.requests) == 1
    assert [role for role, _ in gateway_history(gateway, "alice", key)] == ["user", "assistant"]


def test_gateway_invalid_idempotency_key_is_400(gateway: GatewayProcess, model: ModelServer) -> None:
    key = fresh("bad")
    response = httpx.post(gateway.url("/v1/chat/completions"), timeout=10,
                          headers={**auth("alice"), "X-Ember-Session": key, "Idempotency-Key": "no spaces/slashes"},
                          json={"model": "ember", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_message_id"
    assert model.requests == []


@pytest.mark.parametrize("message_id", ["has space", "x" * 129, "", "slash/inside"])
def test_gateway_invalid_native_message_id_is_a_client_error(gateway: GatewayProcess, model: ModelServer,
                                                              message_id: str) -> None:
    key = fresh("bad")
    response = httpx.post(gateway.url(f"/api/sessions/{key}/messages"), headers=auth("alice"), timeout=10,
                          json={"text": "hi", "message_id": message_id})
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert "message_id" in (error["param"] or "") + error["message"]
    assert model.requests == []
    assert httpx.get(gateway.url(f"/api/sessions/{key}/messages"), headers=auth("alice")).status_code == 404


def test_gateway_invalid_native_message_id_is_400_like_the_idempotency_key(gateway: GatewayProcess,
                                                                          model: ModelServer) -> None:
    response = httpx.post(gateway.url(f"/api/sessions/{fresh('bad')}/messages"), headers=auth("alice"),
                          timeout=10, json={"text": "hi", "message_id": "has space"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_message_id"


def test_gateway_message_ids_are_per_identity(gateway: GatewayProcess, model: ModelServer) -> None:
    key, message_id, idempotency = fresh("shared"), fresh("msg"), fresh("idem")
    model.responder = lambda body: Reply(text=f"for: {body['messages'][-1]['content']}")
    alice = closing_of(native_send(gateway, "alice", key, {"text": "alice's secret", "message_id": message_id}))
    bob = closing_of(native_send(gateway, "bob", key, {"text": "bob's question", "message_id": message_id}))
    assert alice[1]["text"] == "for: alice's secret"
    assert bob[0] == "final" and bob[1]["text"] == "for: bob's question"
    assert bob[1]["delivery_id"] != alice[1]["delivery_id"]
    assert gateway_history(gateway, "bob", key) == [("user", "bob's question"), ("assistant", "for: bob's question")]
    # The same through the OpenAI route's Idempotency-Key.
    answers = []
    for identity in ("alice", "bob"):
        response = httpx.post(gateway.url("/v1/chat/completions"), timeout=30,
                              headers={**auth(identity), "X-Ember-Session": key, "Idempotency-Key": idempotency},
                              json={"model": "ember", "messages": [{"role": "user", "content": f"{identity} asks"}]})
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
    assert answers == ["for: alice asks", "for: bob asks"]
    assert len(model.requests) == 4


# --- reply routes and messages accepted before their turn -----------------------------------------

async def test_an_answer_goes_to_the_events_reply_route_and_no_other_chat(settings: Settings) -> None:
    async with serving_runtime(settings, ScriptedModel([ModelReply(text="for the creator")])) as h:
        await h.runtime.bus.publish_inbound(InboundEvent(
            channel=CHANNEL, chat_id="task-7", sender_id="tester", text="a scheduled run", message_id="run-1",
            reply=ReplyRoute(CHANNEL, "creator")))
        closing = await h.next_closing("creator")
        await h.settled("task-7")
    assert (closing.kind, closing.text, closing.reply_to) == (OutboundKind.FINAL, "for the creator", "run-1")
    assert h.chats["task-7"].events == []
    assert shapes(await history(settings, session_key("task-7"))) == [
        (Role.USER, "a scheduled run"), (Role.ASSISTANT, "for the creator")]
    assert await undelivered(settings) == []
    async with open_database(settings) as db:  # the question, asked in task-7, is answered
        assert (await SqlDeliveryStore(db).receipt(CHANNEL, "task-7", "run-1")).answered_at is not None


async def test_a_message_accepted_before_its_turn_started_runs_once_after_a_crash(settings: Settings) -> None:
    accepted = InboundEvent(channel=CHANNEL, chat_id="c1", sender_id="tester", text="accepted, then the crash",
                            message_id="hook-1")
    async with open_database(settings) as db:  # the channel answered 202; the process died before the turn
        store = SqlDeliveryStore(db)
        assert await store.accept(accepted)
        assert not await store.accept(accepted)  # a replay is known
    calls: list[str] = []

    async def answer(messages: list[Message], tools: object) -> ModelReply:
        calls.append(messages[-1].content)
        return ModelReply(text="answered after the restart")

    async with serving_runtime(settings, FunctionModel(answer), channels=[CHANNEL], recover=True) as h:
        closing = await h.next_closing()
    assert closing.text == "answered after the restart"
    async with serving_runtime(settings, FunctionModel(answer), channels=[CHANNEL], recover=True) as h:
        await h.settled()
    assert calls == ["accepted, then the crash"]
    assert shapes(await history(settings)) == [(Role.USER, "accepted, then the crash"),
                                               (Role.ASSISTANT, "answered after the restart")]
