"""DESIGN.md §2: the order of ResponseStage.finalize is the contract.

Each collaborator is a real implementation wrapped to write into one shared
log, so the tests observe the order in which things happened.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest

from ember.bus.memory import InProcessBus
from ember.config.settings import Settings
from ember.core.errors import ModelError
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.jobs import JobKind
from ember.core.messages import Message, Role, Session, ToolCall
from ember.memory.embeddings import HashingEmbedder
from ember.memory.identity import Identities
from ember.memory.prompt import RecallBudget
from ember.memory.review import REVIEW_INSTRUCTION
from ember.memory.service import MemoryService
from ember.models.base import ModelReply, TextDelta
from ember.models.scripted import FunctionModel, ScriptedModel
from ember.pipeline.context import ContextStage, Persona
from ember.pipeline.inference import InferenceLimits, InferenceStage
from ember.pipeline.response import DerivedWorkPolicy, ResponseStage
from ember.runtime.approvals import ApprovalBroker
from ember.runtime.delivery import DeliveryWorker
from ember.runtime.leases import LocalLeases
from ember.runtime.loop import AgentLoop, Pipeline, RecoveryPolicy
from ember.skills.review import REVIEW_INSTRUCTION as SKILL_REVIEW_INSTRUCTION
from ember.store.deliveries import SqlDeliveryStore
from ember.store.engine import Database
from ember.store.jobs import SqlJobStore
from ember.store.memories import SqlMemoryStore
from ember.store.sessions import SqlSessionStore
from ember.store.traces import SqlTraceStore
from ember.tools.base import ToolRegistry
from tests.conftest import job_counts, session_key
from tests.pgserver import RUNTIMES, engine_settings

Log = list[tuple[str, str]]


# The tests of a whole runtime (`start`) run on each runtime; those of the Rig stay on SQLite (`db`):
# it assembles the loop by hand around the in-process bus, to log the order of its steps.
@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """A runtime's sessions and jobs on SQLite, on PostgreSQL, and on PostgreSQL with the Redis bus."""
    return engine_settings(settings, request.param, request)


class RecordingStore:
    """The real store, logging each commit and the jobs queued in it; can be
    told to fail the final one, or to hang once it is committed."""

    def __init__(self, inner: SqlSessionStore, log: Log, *, fail_final: bool = False,
                 hang_after_final: bool = False) -> None:
        self.inner = inner
        self._log = log
        self._fail_final = fail_final
        self._hang_after_final = hang_after_final

    async def load(self, key: str) -> Session:
        return await self.inner.load(key)

    async def last_question(self, key: str) -> str | None:
        return await self.inner.last_question(key)

    async def append(self, session: Session, messages: Sequence[Message], **records: Any) -> None:
        is_final = messages[-1].role is Role.ASSISTANT and not messages[-1].tool_calls
        if is_final and self._fail_final:
            raise OSError("disk full")
        await self.inner.append(session, messages, **records)
        self._log.append(("save", messages[-1].content))
        self._log.extend(("queue", job.kind) for job in records.get("jobs", ()))
        if is_final and self._hang_after_final:
            await asyncio.Event().wait()

    async def advance_boundary(self, key: str, **boundary: Any) -> bool:
        return await self.inner.advance_boundary(key, **boundary)


class RecordingScheduler:
    def __init__(self, log: Log) -> None:
        self._log = log

    def wake(self, delay_s: float = 0.0) -> None:
        self._log.append(("wake", ""))


class RecordingBus(InProcessBus):
    """Logs each final the loop or the stream publisher sends; can refuse finals."""

    def __init__(self, log: Log, *, fail_final: bool = False) -> None:
        super().__init__()
        self._log = log
        self._fail_final = fail_final

    async def publish_outbound(self, event: OutboundEvent) -> None:
        if event.kind is OutboundKind.FINAL:
            self._log.append(("final", event.text))
            if self._fail_final:
                raise ConnectionError("channel went away")
        await super().publish_outbound(event)

    def drain(self, channel: str = "test") -> list[OutboundEvent]:
        queue = self._outbound[channel]
        return [queue.get_nowait() for _ in range(queue.qsize())]


def loop_of(db: Database, bus: InProcessBus, store: RecordingStore, pipeline: Pipeline,
            traces: SqlTraceStore) -> AgentLoop:
    return AgentLoop(bus, LocalLeases(db.path.parent / "locks"), store, pipeline, traces,
                     ApprovalBroker(bus, timeout_s=5), DeliveryWorker(SqlDeliveryStore(db), bus), RecoveryPolicy())


class Rig:
    """The loop assembled by hand around recording collaborators."""

    def __init__(self, db: Database, model: FunctionModel, *, fail_final: bool = False,
                 hang_after_final: bool = False, fail_delivery: bool = False, threshold: int = 1_000,
                 intro: str = "") -> None:
        self.log: Log = []
        self.bus = RecordingBus(self.log, fail_final=fail_delivery)
        self.sessions = SqlSessionStore(db)
        self.store = RecordingStore(self.sessions, self.log, fail_final=fail_final,
                                    hang_after_final=hang_after_final)
        memory = MemoryService(SqlMemoryStore(db), HashingEmbedder())
        self.context = ContextStage(self.store, memory, Persona("Ember", "You are {agent_name}.", intro), Identities(),
                                    RecallBudget())
        self.inference = InferenceStage(model, ToolRegistry(), self.store, InferenceLimits())
        self.response = ResponseStage(self.store, RecordingScheduler(self.log), memory, DerivedWorkPolicy(threshold))
        self.traces = SqlTraceStore(db)  # the loop's: it reads the traces the loop recorded and kept
        self.loop = loop_of(db, self.bus, self.store, Pipeline(self.context, self.inference, self.response),
                            self.traces)

    async def run_turn(self, text: str, *, stream: bool) -> list[OutboundEvent]:
        """One turn through the loop's own edge, `_on_inbound`; returns what the channel got."""
        await self.loop._on_inbound(InboundEvent(channel="test", chat_id="c1", sender_id="u", text=text, stream=stream))
        return self.bus.drain()


def reply(text: str) -> ScriptedModel:
    return ScriptedModel([ModelReply(text=text)])


async def test_strip_before_save_save_before_derived_work_finalize_last(db: Database) -> None:
    rig = Rig(db, reply("<think>secret plan</think>The answer."), threshold=2)
    sent = await rig.run_turn("question", stream=True)
    assert rig.log == [
        ("save", "question"),
        ("save", "The answer."),          # stripped before it was saved
        ("queue", JobKind.ARCHIVE),       # derived work queued in the answer's own commit
        ("queue", JobKind.CONSOLIDATE),
        ("wake", ""),                     # and started only after it
        ("final", "The answer."),         # delivery after both
    ]
    finals = [e for e in sent if e.kind is OutboundKind.FINAL]
    assert len(finals) == 1 and finals[0].stream_full_text
    assert "secret" not in "".join(e.text for e in sent)


async def test_outbound_sent_suppresses_the_outer_publish(db: Database) -> None:
    rig = Rig(db, reply("streamed"))
    sent = await rig.run_turn("q", stream=True)
    assert [e.text for e in sent if e.kind is OutboundKind.FINAL] == ["streamed"]
    assert [kind for kind, _ in rig.log if kind == "final"] == ["final"]


async def test_without_a_stream_the_loop_publishes_the_final_once(db: Database) -> None:
    rig = Rig(db, reply("plain"))
    sent = await rig.run_turn("q", stream=False)
    assert [(e.kind, e.text) for e in sent] == [(OutboundKind.FINAL, "plain")]
    assert rig.log[-1] == ("final", "plain")
    assert sent[0].stream_full_text and sent[0].delivery_id is not None  # the committed record, as re-sent


async def test_intro_is_merged_by_the_system_and_streamed_first(db: Database) -> None:
    rig = Rig(db, reply("<think>x</think>Hello."), intro="I'm {agent_name} on {channel}.")
    sent = await rig.run_turn("hi", stream=True)
    expected = "I'm Ember on test.\n\nHello."
    assert "".join(e.text for e in sent if e.kind is OutboundKind.DELTA) == expected
    assert [e.text for e in sent if e.kind is OutboundKind.FINAL] == [expected]
    assert (await rig.sessions.history("test:c1"))[-1].content == expected


async def test_one_error_response_when_the_commit_fails(db: Database) -> None:
    rig = Rig(db, reply("never saved"), fail_final=True)
    sent = await rig.run_turn("q", stream=True)
    closing = [e for e in sent if e.kind in (OutboundKind.FINAL, OutboundKind.ERROR)]
    assert [e.kind for e in closing] == [OutboundKind.ERROR]
    assert not any(kind in ("queue", "wake") for kind, _ in rig.log)  # nothing derived from a failed commit
    assert [m.content for m in await rig.sessions.history("test:c1")] == ["q"]
    assert await SqlJobStore(db).counts() == {}


async def test_one_error_response_when_stream_finalize_fails(db: Database) -> None:
    rig = Rig(db, reply("saved but not delivered"), fail_delivery=True)
    sent = await rig.run_turn("q", stream=True)
    assert [e.kind for e in sent if e.kind in (OutboundKind.FINAL, OutboundKind.ERROR)] == [OutboundKind.ERROR]
    # The commit happened before delivery and stays: the answer is in the record.
    assert (await rig.sessions.history("test:c1"))[-1].content == "saved but not delivered"
    [trace] = await rig.traces.for_session("test:c1")
    assert trace.status == "failed" and "ConnectionError" in (trace.error or "")


async def test_a_failing_review_leaves_the_answer_delivered_and_saved(start, settings, caplog) -> None:  # type: ignore[no-untyped-def]
    calls = [ToolCall(id=f"c{i}", name="list_dir", arguments="{}") for i in range(3)]
    script = [ModelReply(text="", tool_calls=tuple(calls)), ModelReply(text="All done.")]

    def model_fn(messages: list[Message], tools: object) -> ModelReply:
        if messages[0].content.startswith((REVIEW_INSTRUCTION, SKILL_REVIEW_INSTRUCTION)):
            raise RuntimeError("review model is down")
        return script.pop(0)

    config = settings.model_copy(update={"review_tool_call_threshold": 1, "job_max_attempts": 2})
    caplog.set_level(logging.WARNING)
    async with start(FunctionModel(model_fn), config=config) as h:
        final = await h.turn("look around")
        await h.runtime.runner.wait_idle()
        history = await h.runtime.sessions.history(session_key())
        counts = await h.runtime.jobs.counts()
    assert final.kind is OutboundKind.FINAL and final.text == "All done."
    assert history[-1].content == "All done."
    assert counts.get("failed") == 2  # the memory and skill reviews gave up after their retries
    for kind in ("review_memory", "review_skills"):
        assert any(kind in r.getMessage() and "review model is down" in r.getMessage() for r in caplog.records)
    assert not h.chats["c1"].of(OutboundKind.ERROR)


async def test_a_turn_cancelled_after_its_commit_delivers_the_committed_answer(db: Database) -> None:
    rig = Rig(db, reply("committed answer"), threshold=1, hang_after_final=True)
    turn = asyncio.create_task(
        rig.loop._on_inbound(InboundEvent(channel="test", chat_id="c1", sender_id="u", text="q", stream=True))
    )
    while ("save", "committed answer") not in rig.log:  # step 3 is done, and the turn hangs there
        await asyncio.sleep(0.01)
    turn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await turn
    sent = rig.bus.drain()
    assert [(e.kind, e.text) for e in sent if e.kind is not OutboundKind.DELTA] == [
        (OutboundKind.FINAL, "committed answer")
    ]
    # The consolidation it called for was committed with it, though step 4 never ran (I6).
    assert ("wake", "") not in rig.log
    assert await job_counts(db) == {(JobKind.ARCHIVE, "pending"): 1, (JobKind.CONSOLIDATE, "pending"): 1}


async def test_the_introduction_is_chosen_by_channel_and_by_the_first_messages_language(
        start, settings) -> None:  # type: ignore[no-untyped-def]
    config = settings.model_copy(update={
        "intro_template": "I am {agent_name}.",
        "intro_templates": {"zh": "我是 {agent_name}（{channel}）。", "test:ja": "{agent_name} です。"}})
    async with start(FunctionModel(lambda messages, tools: ModelReply(text="OK")), config=config) as h:
        chinese = await h.turn("你好，请帮我看看", chat="zh")
        japanese = await h.turn("こんにちは", chat="ja")
        english = await h.turn("hello", chat="en")
        again = await h.turn("你好", chat="en")  # not a new session: no introduction
    assert chinese.text == "我是 Ember（test）。\n\nOK"
    assert japanese.text == "Ember です。\n\nOK"
    assert english.text == "I am Ember.\n\nOK"
    assert again.text == "OK"


ANSWER = "A fast model streams this answer in many small chunks, one after another."


def deltas(sent: list[OutboundEvent]) -> list[OutboundEvent]:
    return [e for e in sent if e.kind is OutboundKind.DELTA]


async def test_chunks_read_while_a_delta_is_on_its_way_go_out_together(db: Database) -> None:
    """A model whose chunks are all there at once: the channel gets fewer, numbered deltas that
    still add up to the answer, every one before the final."""
    rig = Rig(db, FunctionModel(lambda messages, tools: ModelReply(text=ANSWER), chunk_size=2))
    sent = await rig.run_turn("q", stream=True)
    chunks = (len(ANSWER) + 1) // 2
    assert 1 <= len(deltas(sent)) < chunks
    assert "".join(e.text for e in deltas(sent)) == ANSWER
    assert [e.stream_index for e in deltas(sent)] == list(range(len(deltas(sent))))
    assert sent[-1].kind is OutboundKind.FINAL and sent[-1].text == ANSWER


async def test_a_model_slower_than_the_bus_has_each_chunk_sent_as_it_comes(db: Database) -> None:
    rig = Rig(db, FunctionModel(lambda messages, tools: ModelReply(text=ANSWER[:24]), chunk_size=4,
                                delta_delay_s=0.02))
    sent = await rig.run_turn("q", stream=True)
    assert [e.text for e in deltas(sent)] == [ANSWER[i:i + 4] for i in range(0, 24, 4)]


async def test_no_delta_follows_the_error_of_a_turn_that_failed_mid_stream(db: Database) -> None:
    class SlowBus(RecordingBus):
        """Deltas take a while to reach the channel, so some are on their way when the model fails."""

        async def publish_outbound(self, event: OutboundEvent) -> None:
            if event.kind is OutboundKind.DELTA:
                await asyncio.sleep(0.01)
            await super().publish_outbound(event)

    class FailingMidStream(FunctionModel):
        async def stream(self, messages, tools=(), *, sampling=None):  # type: ignore[no-untyped-def]
            for piece in ("one ", "two ", "three "):
                yield TextDelta(piece)
                await asyncio.sleep(0)
            raise ModelError("the model's connection dropped")

    rig = Rig(db, FailingMidStream(lambda messages, tools: ModelReply(text="")))
    rig.bus = SlowBus(rig.log)
    rig.loop = loop_of(db, rig.bus, rig.store, Pipeline(rig.context, rig.inference, rig.response), rig.traces)
    sent = await rig.run_turn("q", stream=True)
    await asyncio.sleep(0.05)  # a delta cancelled on its way would have arrived by now
    sent += rig.bus.drain()
    kinds = [e.kind for e in sent]
    assert kinds[-1] is OutboundKind.ERROR and kinds.count(OutboundKind.ERROR) == 1, kinds
    assert OutboundKind.FINAL not in kinds
