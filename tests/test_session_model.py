"""A model-based test of one session over the real store and the real loop.

A hypothesis state machine sends turns (plain, with tool steps, failing),
redelivers earlier messages, crashes the runtime in the middle of a turn,
restarts it with and without recovery and consolidates, keeping its own
record of what must be in the session. After every step the store and what
the channel received must agree with it:

    I1  every accepted message is in the history once, with its receipt
    I2  at most one answer per message; every final sent for it has the same
        delivery id ("<turn_id>:<seq>" of that answer) and text
    I3  the history, and the window a turn loads, are protocol-valid
    I4  no reasoning text in the history or in anything the channel was sent
    I5  the consolidation boundary only moves forward, never into a tool chain
    I6  at most one pending job per kind and key

A crash is the runtime stopped with no grace while the model or a tool is
still working (what is committed stays, the rest is cut off); the next
process opens the same store.

The machine runs on each runtime of RUNTIMES: the SQLite file, a PostgreSQL
database of each example's own, and that with the Redis bus in a namespace of
each example's own. On Redis a crashed process's message stays pending under
its name until the next process takes it over, after a short worker timeout:
as a later message of the session waits for it, the next process handles it
first, resumed if it is still the session's last question, else with the
notice, whether or not it recovers (tests/test_cluster.py covers takeovers
between live processes).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from pydantic import BaseModel, SecretStr
from sqlalchemy import func, select

from ember.app.runtime import Runtime, build_runtime, running
from ember.config.settings import Settings
from ember.core.errors import ModelError
from ember.core.events import OutboundEvent, OutboundKind
from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import Risk
from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.runtime.loop import NOT_RESUMED_TEXT
from ember.store import schema
from ember.tools.base import FunctionTool, ToolRegistry
from tests.conftest import CHANNEL, Harness
from tests.pgserver import RUNTIMES, PgServer
from tests.test_store import assert_protocol_valid

T = TypeVar("T")
CHAT = "c1"
KEY = f"{CHANNEL}:{CHAT}"
WAIT_S = 10.0

Shape = tuple[Role, str]


@dataclass(frozen=True, slots=True)
class Step:
    """One model call as the machine plans it."""

    kind: Literal["tool", "final", "hang", "tool_hang", "error"]
    label: str = ""


class Script:
    """The model and the tool the machine drives: each model call takes the next planned step."""

    def __init__(self) -> None:
        self.plan: deque[Step] = deque()
        self.unplanned = 0
        self.hanging = asyncio.Event()
        self._never = asyncio.Event()

    async def reply(self, messages: list[Message], tools: object) -> ModelReply:
        if messages[0].content == SUMMARY_INSTRUCTION:  # background consolidation
            return ModelReply(text="<think>secret</think>A summary.")
        if not self.plan:
            self.unplanned += 1
            raise ModelError("the machine planned no model call here")
        step = self.plan.popleft()
        if step.kind == "error":
            raise ModelError("scripted model failure")
        if step.kind == "hang":
            self.hanging.set()
            await self._never.wait()
        if step.kind == "final":
            return ModelReply(text=f"<think>secret</think>{step.label}", reasoning="secret")
        text = "hang" if step.kind == "tool_hang" else step.label
        call = ToolCall(id=f"call_{step.label or 'hang'}", name="note", arguments=json.dumps({"text": text}))
        return ModelReply(text="<think>secret</think>", tool_calls=(call,))

    def tool(self) -> FunctionTool[NoteArgs]:
        async def note(args: NoteArgs) -> str:
            if args.text == "hang":
                self.hanging.set()
                await self._never.wait()
            return f"noted {args.text}"

        return FunctionTool("note", "Write a note down.", NoteArgs, note, risk=Risk.READ)


class NoteArgs(BaseModel):
    text: str


@dataclass(slots=True)
class Sent:
    """A message the channel sent, and what became of it."""

    text: str
    status: Literal["answered", "cut", "errored"]


def tool_shapes(label: str) -> list[Shape]:
    return [(Role.ASSISTANT, ""), (Role.TOOL, f"noted {label}")]


class SessionMachine(RuleBasedStateMachine):
    # Whether the bus hands a crashed process's unfinished message to the next process (Redis).
    takes_over = False

    # Each example's store and bus: where the settings of a fresh home point (the SQLite file there
    # unless a subclass says otherwise), and what to drop once the example is done.
    def runtime_of(self, settings: Settings) -> Settings:
        return settings

    def drop_runtime(self) -> None:
        pass

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="ember-session-model-"))
        self.settings = self.runtime_of(Settings(
            home=self.dir / "home", consolidation_threshold=8, consolidation_keep_recent=2,
            job_backoff_base_s=0.01))
        self.script = Script()
        self.expected: list[Shape] = []
        self.sent: dict[str, Sent] = {}
        self.finals: dict[str, set[tuple[str | None, str]]] = {}
        self.texts_seen: list[str] = []
        self.boundary = 0
        self.counter = 0
        self.stack: AsyncExitStack | None = None
        self.run(self.start(recover=False))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.run(self.stop())
        finally:
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            self.drop_runtime()

    # --- processes -------------------------------------------------------------------------------

    async def start(self, *, recover: bool, notice: bool = False) -> None:
        config = self.settings.model_copy(update={"interrupted_turns": "notice"}) if notice else self.settings
        self.script.hanging = asyncio.Event()
        cut = [mid for mid, sent in self.sent.items() if sent.status == "cut"]
        # Without recovery, a message taken over is redelivered, not recovered: the notice setting
        # (asked for with recovery only) leaves it alone.
        handled = recover or (self.takes_over and bool(cut))
        # Each resumed if its question is still the session's last, else answered with the notice.
        resumed = [mid for mid in cut if not notice and self.last_asked(mid)]
        if handled:
            self.script.plan.extend(Step("final", self.label("r")) for _ in resumed)
        self.stack = AsyncExitStack()
        self.runtime: Runtime = await build_runtime(config, FunctionModel(self.script.reply),
                                                    tools=ToolRegistry([self.script.tool()]))
        await self.stack.enter_async_context(running(self.runtime, channels=[CHANNEL], recover=recover))
        self.harness = Harness(self.runtime)
        self.stack.push_async_callback(self.harness.close)
        if handled:
            # Recovered (or taken over) in the order they were accepted: one session, one turn at a time.
            for mid in cut:
                final = await self.closing(mid)
                assert final.kind is OutboundKind.FINAL, final
                self.expected.append((Role.ASSISTANT, final.text if mid in resumed else NOT_RESUMED_TEXT))
                assert final.text == NOT_RESUMED_TEXT or mid in resumed, final
                self.sent[mid].status = "answered"
            assert not self.script.plan, "recovery did not resume every cut-off turn"

    async def stop(self) -> None:
        if self.stack is not None:
            self.collect()
            await self.stack.aclose()
            self.stack = None

    def collect(self) -> None:
        """Note every final the channel got, by the message it answers."""
        for event in self.harness.chats[CHAT].events:
            self.texts_seen.append(event.text)
            if event.kind is OutboundKind.FINAL and event.reply_to is not None:
                self.finals.setdefault(event.reply_to, set()).add((event.delivery_id, event.text))
        self.harness.chats[CHAT].events.clear()

    async def closing(self, message_id: str, seen: int = 0) -> OutboundEvent:
        """The final or error answering `message_id`, after the first `seen` events of the channel
        (re-sends of older answers may arrive in between)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            events = self.harness.chats[CHAT].events
            for event in events[seen:]:
                if event.reply_to == message_id and event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
                    return event
            seen = len(events)
            await asyncio.sleep(0.005)
        raise AssertionError(f"no answer to {message_id} within {WAIT_S}s")

    def last_asked(self, mid: str) -> bool:
        """Whether `mid`'s question is the last one in the history, so that resuming its turn
        answers it and no other."""
        asked = [content for role, content in self.expected if role is Role.USER]
        return asked[-1] == self.sent[mid].text

    def label(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    async def send(self, message_id: str, text: str, *, stream: bool = False) -> OutboundEvent:
        seen = len(self.harness.chats[CHAT].events)
        await self.harness.publish(text, chat=CHAT, message_id=message_id, stream=stream)
        return await self.closing(message_id, seen)

    def plan_tools(self, count: int) -> list[Step]:
        return [Step("tool", self.label("t")) for _ in range(count)]

    def expect_steps(self, steps: list[Step]) -> None:
        for step in steps:
            if step.kind == "tool":
                self.expected += tool_shapes(step.label)

    # --- rules -----------------------------------------------------------------------------------

    @rule(tools=st.integers(0, 2), stream=st.booleans())
    def turn(self, tools: int, stream: bool) -> None:
        mid, text = self.label("m"), self.label("q")
        steps = [*self.plan_tools(tools), Step("final", self.label("a"))]
        self.script.plan.extend(steps)
        final = self.run(self.send(mid, text, stream=stream))
        assert (final.kind, final.text) == (OutboundKind.FINAL, steps[-1].label), final
        self.expected.append((Role.USER, text))
        self.expect_steps(steps)
        self.expected.append((Role.ASSISTANT, steps[-1].label))
        self.sent[mid] = Sent(text, "answered")

    @rule()
    def failing_turn(self) -> None:
        mid, text = self.label("m"), self.label("q")
        self.script.plan.append(Step("error"))
        closing = self.run(self.send(mid, text))
        assert closing.kind is OutboundKind.ERROR, closing
        self.expected.append((Role.USER, text))
        self.sent[mid] = Sent(text, "errored")

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data(), tools=st.integers(0, 1))
    def redeliver(self, data: st.DataObject, tools: int) -> None:
        mid = data.draw(st.sampled_from(sorted(self.sent)), label="message")
        sent = self.sent[mid]
        if sent.status == "answered":
            closing = self.run(self.send(mid, sent.text))  # the record again; the model is not asked
            assert closing.kind is OutboundKind.FINAL and closing.stream_full_text, closing
            return
        if sent.status == "cut" and not self.last_asked(mid):
            # Resumed now, its turn would answer a later question: it gets the notice instead.
            closing = self.run(self.send(mid, sent.text))
            assert (closing.kind, closing.text) == (OutboundKind.FINAL, NOT_RESUMED_TEXT), closing
            self.expected.append((Role.ASSISTANT, NOT_RESUMED_TEXT))
            sent.status = "answered"
            return
        # Cut off or failed: the turn runs (again) from what was committed, its question not written twice.
        steps = [*self.plan_tools(tools), Step("final", self.label("a"))]
        self.script.plan.extend(steps)
        closing = self.run(self.send(mid, sent.text))
        assert (closing.kind, closing.text) == (OutboundKind.FINAL, steps[-1].label), closing
        self.expect_steps(steps)
        self.expected.append((Role.ASSISTANT, steps[-1].label))
        sent.status = "answered"

    @rule(tools=st.integers(0, 2), in_tool=st.booleans(), recover=st.booleans(), notice=st.booleans())
    def crash(self, tools: int, in_tool: bool, recover: bool, notice: bool) -> None:
        """The process stops mid-turn, after `tools` committed tool steps; the next one opens the same file."""
        mid, text = self.label("m"), self.label("q")
        steps = [*self.plan_tools(tools), Step("tool_hang" if in_tool else "hang")]
        self.script.plan.extend(steps)

        async def cut_off() -> None:
            await self.harness.publish(text, chat=CHAT, message_id=mid)
            await asyncio.wait_for(self.script.hanging.wait(), WAIT_S)
            await self.runtime.loop.stop(grace_s=0)
            await self.stop()

        self.run(cut_off())
        assert not self.script.plan
        self.expected.append((Role.USER, text))
        self.expect_steps(steps)  # committed before the cut; the hanging step never was
        self.sent[mid] = Sent(text, "cut")
        self.run(self.start(recover=recover, notice=notice and recover))

    @rule(recover=st.booleans())
    def restart(self, recover: bool) -> None:
        self.run(self.stop())
        self.run(self.start(recover=recover))

    @rule()
    def consolidate(self) -> None:
        self.run(self.runtime.consolidation.consolidate(KEY))

    # --- invariants, on the real store -----------------------------------------------------------

    @invariant()
    def session_agrees_with_the_model(self) -> None:
        self.run(self.check())

    async def check(self) -> None:
        self.collect()
        assert self.script.unplanned == 0, "the model was asked when the machine planned no call"
        history = await self.runtime.sessions.history(KEY)
        # I1: everything committed, once, in order; nothing else.
        assert [(m.role, m.content) for m in history] == self.expected
        users = [m.content for m in history if m.role is Role.USER]
        assert sorted(users) == sorted(sent.text for sent in self.sent.values())
        # I3
        assert_protocol_valid(history)
        window = await self.runtime.sessions.load(KEY)
        assert_protocol_valid(window.messages)
        # I4
        assert not any("secret" in m.content or "<think" in m.content for m in history)
        assert not any("secret" in text or "<think" in text for text in self.texts_seen)
        await self.check_answers(history)
        # I5
        assert window.last_consolidated >= self.boundary, "the boundary moved back"
        self.boundary = window.last_consolidated
        assert self.boundary >= len(history) or history[self.boundary].role is not Role.TOOL
        assert window.messages == [m for m in history if (m.seq or 0) >= self.boundary]
        # I6
        j = schema.jobs
        async with self.runtime.db.read() as conn:
            duplicates = (await conn.execute(
                select(j.c.kind, j.c.dedupe_key).where(j.c.status == "pending")
                .group_by(j.c.kind, j.c.dedupe_key).having(func.count() > 1)
            )).all()
        assert duplicates == []

    async def check_answers(self, history: list[Message]) -> None:
        """I1 (receipts) and I2."""
        i = schema.inbox
        async with self.runtime.db.read() as conn:
            rows = (await conn.execute(select(i.c.message_id, i.c.turn_id, i.c.answered_at)
                                       .where(i.c.channel == CHANNEL))).all()
        receipts = {row.message_id: row for row in rows}
        assert sorted(receipts) == sorted(self.sent), "a receipt too many or too few"
        by_seq = {m.seq: m for m in history}
        for mid, sent in self.sent.items():
            receipt = receipts[mid]
            answers = [m for m in history
                       if m.turn_id == receipt.turn_id and m.role is Role.ASSISTANT and not m.tool_calls]
            assert len(answers) == (1 if sent.status == "answered" else 0), (mid, sent, answers)
            assert (receipt.answered_at is None) == (sent.status == "cut")
            finals = self.finals.get(mid, set())
            assert len(finals) <= 1, f"{mid} was answered differently: {finals}"
            for delivery, text in finals:
                turn_id, _, seq = (delivery or "").rpartition(":")
                answer = by_seq[int(seq)]
                assert (turn_id, answer.turn_id, answer.content) == (receipt.turn_id, receipt.turn_id, text)


def on_shared_runtime(server: PgServer, schema: str, redis_url: str | None) -> type[SessionMachine]:
    """The machine with each example on a PostgreSQL database of its own, and on `redis_url`'s bus."""
    examples = itertools.count()

    class SharedSessionMachine(SessionMachine):
        takes_over = redis_url is not None

        def runtime_of(self, settings: Settings) -> Settings:
            self.url = server.fresh_database(template=schema)
            update: dict[str, object] = {"database_url": SecretStr(self.url), "worker_timeout_s": 3600.0}
            if redis_url is not None:
                update |= {"redis_url": SecretStr(redis_url), "redis_namespace": f"model{next(examples)}",
                           "worker_timeout_s": 2.0}
            return settings.model_copy(update=update)

        def drop_runtime(self) -> None:
            server.drop_database(self.url)

    return SharedSessionMachine


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_session_survives_turns_redeliveries_crashes_and_consolidation(
        runtime: str, request: pytest.FixtureRequest) -> None:
    machine = SessionMachine if runtime == "sqlite" else on_shared_runtime(
        request.getfixturevalue("pg_server"), request.getfixturevalue("pg_schema"),
        request.getfixturevalue("redis_server").url if runtime == "postgresql+redis" else None)
    # On Redis each crash waits out worker_timeout_s for the takeover: half the examples, the same steps.
    # PostgreSQL's store has a model test of its own (test_store_model.py): fewer examples here too.
    examples = {"sqlite": 20, "postgresql": 12, "postgresql+redis": 10}[runtime]
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=20, deadline=None,
        derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
