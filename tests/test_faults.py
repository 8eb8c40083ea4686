"""Fault injection: each failure has a defined outcome, and nothing committed is lost.

The model endpoint (a scripted HTTP server), background jobs, the channel and
the disk each fail in turn; the runtime around them is the real one.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError

from ember.app.database import open_database
from ember.app.models import Models, configured_model
from ember.app.runtime import (
    Runtime,
    _job_handlers,
    build_runtime,
    memory_service,
    skill_library,
)
from ember.bus.memory import InProcessBus
from ember.config.settings import Settings
from ember.core.delivery import Delivery, Receipt, delivery_id
from ember.core.errors import ModelError, StoreBusy, StoreUnavailable
from ember.core.events import OutboundEvent, OutboundKind
from ember.core.jobs import Job, JobKind
from ember.core.messages import Message, Role
from ember.memory.consolidation import SUMMARY_INSTRUCTION, ConsolidationWorker
from ember.memory.embeddings import HashingEmbedder
from ember.memory.identity import Identities
from ember.memory.prompt import RecallBudget
from ember.memory.service import MemoryService
from ember.models.base import ModelClient, ModelReply
from ember.models.metered import MeteredModel
from ember.models.scripted import FunctionModel, ScriptedModel
from ember.pipeline.context import ContextStage, Persona
from ember.pipeline.inference import InferenceLimits, InferenceStage
from ember.pipeline.response import DerivedWorkPolicy, ResponseStage
from ember.runtime.approvals import ApprovalBroker
from ember.runtime.background import BackgroundRunner, HostRunner, JobHandler, RetryPolicy
from ember.runtime.channels import ChannelHub
from ember.runtime.delivery import DeliveryWorker
from ember.runtime.leases import HostLock, LocalLeases
from ember.runtime.loop import AgentLoop, Pipeline, RecoveryPolicy
from ember.runtime.usage import UsageRecorder
from ember.store import schema
from ember.store.deliveries import SqlDeliveryStore
from ember.store.jobs import SqlJobStore
from ember.store.sessions import SqlSessionStore
from ember.store.sqlite import database
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tasks import SqlTaskStore
from ember.store.traces import SqlTraceStore
from ember.store.tx import Statement
from ember.store.usage import SqlUsageStore
from ember.tools.approval import ApprovalGate
from ember.tools.base import FunctionTool, ToolRegistry
from ember.tools.mcp import start_mcp
from tests.conftest import (
    CHANNEL,
    IDENTITY,
    Harness,
    NoteArgs,
    job_counts,
    note_tool,
    of_kind,
    running_harness,
    serving_runtime,
    session_key,
)
from tests.modelserver import ModelServer, Reply
from tests.pgserver import RUNTIMES, engine_settings

KEY = session_key()


# --- runtimes ------------------------------------------------------------------------------------


@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """The runtime's store and bus on SQLite, on PostgreSQL, and on PostgreSQL with the Redis bus."""
    return engine_settings(settings, request.param, request)


# For the tests of a runtime that `assemble` wires on the home's SQLite file around an in-process
# bus (a RefusingBus, to fail the channel), and of that file locked by another connection.
sqlite_only = pytest.mark.parametrize("settings", ["sqlite"], indirect=True)


def echo_tool(seen: list[str]) -> FunctionTool[NoteArgs]:
    return note_tool(seen, name="echo", says="echo:")


def http_settings(settings: Settings, base_url: str, **changes: object) -> Settings:
    return settings.model_copy(update={"model": "test-model", "model_base_url": base_url, "model_api_key": "k",
                                       "model_max_attempts": 2, "model_timeout_s": 5.0, **changes})


class RefusingBus(InProcessBus):
    """The in-process bus, whose channel goes away for the first `refuse_finals` finals."""

    def __init__(self, *, refuse_finals: int) -> None:
        super().__init__()
        self.refused: list[OutboundEvent] = []
        self._refuse = refuse_finals

    async def publish_outbound(self, event: OutboundEvent) -> None:
        if event.kind is OutboundKind.FINAL and self._refuse > 0:
            self._refuse -= 1
            self.refused.append(event)
            raise ConnectionError("the channel went away")
        await super().publish_outbound(event)

    def drain(self, channel: str = CHANNEL) -> list[OutboundEvent]:
        """What the channel was sent and has not read yet."""
        queue = self._outbound[channel]
        return [queue.get_nowait() for _ in range(queue.qsize())]


async def assemble(settings: Settings, model: ModelClient, *, bus: InProcessBus | None = None,
                   embed: Callable[[MemoryService], JobHandler] | None = None) -> Runtime:
    """The runtime as build_runtime wires it, with the bus or the embed job handler replaced."""
    home = settings.home_dir
    home.mkdir(parents=True, exist_ok=True)
    identities = Identities(settings.identities)
    db = SqliteDatabase(settings.database_path)
    await db.open()
    sessions, jobs, traces = SqlSessionStore(db), SqlJobStore(db), SqlTraceStore(db)
    memory = memory_service(settings, db, HashingEmbedder())
    await memory.open()
    leases = LocalLeases(home / "locks" / "sessions")
    bus = bus or InProcessBus()
    approvals = ApprovalBroker(bus, settings.tool_policy.timeout_s)
    skills = skill_library(settings, db)
    consolidation = ConsolidationWorker(sessions, leases, model, memory, keep_recent=settings.consolidation_keep_recent)
    usage = UsageRecorder(SqlUsageStore(db))
    metered = MeteredModel(model, {}, usage.record)
    handlers = _job_handlers(sessions, leases, metered, memory, skills, consolidation)
    if embed is not None:
        handlers[JobKind.EMBED] = embed(memory)
    runner = BackgroundRunner(jobs, handlers, HostRunner(HostLock(home / "locks" / "background-runner"), jobs),
                              retry=RetryPolicy(max_attempts=settings.job_max_attempts,
                                                backoff_base_s=settings.job_backoff_base_s))
    pipeline = Pipeline(
        context=ContextStage(sessions, memory, Persona(settings.agent_name, settings.system_prompt), identities,
                             RecallBudget(settings.memory_profile_facts, settings.memory_recall_tokens)),
        inference=InferenceStage(model, ApprovalGate(ToolRegistry(), settings.tool_policy), sessions,
                                 InferenceLimits()),
        response=ResponseStage(sessions, runner, memory, DerivedWorkPolicy(settings.consolidation_threshold)),
    )
    deliveries = DeliveryWorker(SqlDeliveryStore(db), bus)
    loop = AgentLoop(bus, leases, sessions, pipeline, traces, approvals, deliveries,
                     RecoveryPolicy(settings.interrupted_turns, settings.resume_window_s))
    return Runtime(db=db, sessions=sessions, jobs=jobs, traces=traces, memory=memory, bus=bus, approvals=approvals,
                   runner=runner, loop=loop, consolidation=consolidation, mcp=await start_mcp({}),
                   deliveries=deliveries, identities=identities, usage=usage,
                   channels=ChannelHub(bus, deliveries), tasks=SqlTaskStore(db), skills=skills,
                   tools=ToolRegistry(), models=Models(metered, metered, usage, owned=(metered,)))


@asynccontextmanager
async def wired(settings: Settings, model: ModelClient, *, bus: InProcessBus | None = None,
                embed: Callable[[MemoryService], JobHandler] | None = None) -> AsyncIterator[Harness]:
    async with running_harness(await assemble(settings, model, bus=bus, embed=embed)) as harness:
        yield harness


async def stored(settings: Settings) -> list[tuple[Role, str]]:
    async with open_database(settings) as db:
        return [(m.role, m.content) for m in await SqlSessionStore(db).history(KEY)]


def closings(h: Harness) -> list[OutboundEvent]:
    return [e for e in h.chats["c1"].events if e.kind in (OutboundKind.FINAL, OutboundKind.ERROR)]


# --- the model fails -----------------------------------------------------------------------------


async def test_a_model_failing_on_every_attempt_is_one_error_and_the_session_goes_on(
        settings: Settings, model_server: ModelServer) -> None:
    config = http_settings(settings, model_server.base_url, model_max_attempts=2)
    model_server.push(Reply(status=500), Reply(status=503), Reply(text="back again"))
    async with serving_runtime(config, configured_model(config)) as h:
        failed = await h.turn("first", stream=True)
        await h.settled()
        assert closings(h) == [failed]
        later = await h.turn("second")
    assert failed.kind is OutboundKind.ERROR
    assert "HTTP 503" in failed.text and "after 2 attempts" in failed.text
    assert later.kind is OutboundKind.FINAL and later.text == "back again"
    assert len(model_server.requests) == 3
    # The second request carried both user messages: the failed turn's question was kept.
    assert [m["content"] for m in model_server.requests[2]["messages"] if m["role"] == "user"] == ["first", "second"]
    assert await stored(config) == [(Role.USER, "first"), (Role.USER, "second"), (Role.ASSISTANT, "back again")]


async def test_a_5xx_then_success_is_retried_into_one_answer(settings: Settings, model_server: ModelServer) -> None:
    config = http_settings(settings, model_server.base_url, model_max_attempts=3)
    model_server.push(Reply(status=502), Reply(text="second time lucky"))
    async with serving_runtime(config, configured_model(config)) as h:
        final = await h.turn("question", stream=True)
        await h.settled()
        assert closings(h) == [final]
        deltas = "".join(e.text for e in h.chats["c1"].of(OutboundKind.DELTA))
    assert final.kind is OutboundKind.FINAL and final.text == "second time lucky"
    assert deltas == "second time lucky"  # the failed attempt streamed nothing
    assert len(model_server.requests) == 2
    assert await stored(config) == [(Role.USER, "question"), (Role.ASSISTANT, "second time lucky")]


async def test_a_model_that_never_answers_times_out_into_one_error(settings: Settings,
                                                                   model_server: ModelServer) -> None:
    silent = threading.Event()  # set only at the end: both calls wait past their timeout
    model_server.push(Reply(text="too late", hold=silent, hold_timeout_s=30),
                      Reply(text="too late", hold=silent, hold_timeout_s=30))
    config = http_settings(settings, model_server.base_url, model_timeout_s=0.3, model_max_attempts=2)
    try:
        async with serving_runtime(config, configured_model(config)) as h:
            failed = await h.turn("anyone there?")
            await h.settled()
            assert closings(h) == [failed]
    finally:
        silent.set()
    assert failed.kind is OutboundKind.ERROR and "timed out" in failed.text
    assert len(model_server.requests) == 2  # two attempts, then given up
    assert await stored(config) == [(Role.USER, "anyone there?")]


async def test_a_stream_that_stalls_past_the_timeout_is_one_clear_error(settings: Settings,
                                                                          model_server: ModelServer) -> None:
    config = http_settings(settings, model_server.base_url, model_timeout_s=0.5, model_max_attempts=1)
    model_server.push(Reply(text="a slow start and then nothing", chunk_delay_s=3.0))
    async with serving_runtime(config, configured_model(config)) as h:
        failed = await h.turn("question", stream=True)
        await h.settled()
        assert closings(h) == [failed]
    assert failed.kind is OutboundKind.ERROR
    assert failed.text.startswith("Sorry, I could not answer"), failed.text  # a model error, not an Ember bug
    assert await stored(config) == [(Role.USER, "question")]


async def test_malformed_tool_arguments_are_a_result_the_model_corrects(settings: Settings,
                                                                         model_server: ModelServer) -> None:
    config = http_settings(settings, model_server.base_url)
    seen: list[str] = []
    model_server.push(Reply(tool_calls=(("echo", '{"text": "unterminated'),)),
                      Reply(tool_calls=(("echo", '{"text": "fixed"}'),)),
                      Reply(text="Echoed it."))
    async with serving_runtime(config, configured_model(config), tools=ToolRegistry([echo_tool(seen)])) as h:
        final = await h.turn("echo something")
    assert final.kind is OutboundKind.FINAL and final.text == "Echoed it."
    assert seen == ["fixed"]  # the broken call never reached the tool
    first_result = [m for m in model_server.requests[1]["messages"] if m["role"] == "tool"]
    assert len(first_result) == 1 and first_result[0]["content"].startswith("Error:")
    assert "not valid JSON" in first_result[0]["content"]
    history = await stored(config)
    assert [role for role, _ in history] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT, Role.TOOL,
                                             Role.ASSISTANT]
    assert history[2][1].startswith("Error:") and history[4][1] == "echo: fixed"


async def test_a_tool_call_event_that_is_not_json_is_one_model_error(settings: Settings,
                                                                      model_server: ModelServer) -> None:
    config = http_settings(settings, model_server.base_url)
    broken = ('data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": '
              '[{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "echo", '
              '"arguments": "{\\"text\\": \n\n')
    model_server.push(Reply(raw_events=(broken, "data: [DONE]\n\n")), Reply(text="fine now"))
    async with serving_runtime(config, configured_model(config), tools=ToolRegistry([echo_tool([])])) as h:
        failed = await h.turn("go")
        later = await h.turn("again")
    assert failed.kind is OutboundKind.ERROR and failed.text.startswith("Sorry, I could not answer")
    assert later.text == "fine now"
    assert await stored(config) == [(Role.USER, "go"), (Role.USER, "again"), (Role.ASSISTANT, "fine now")]


async def test_a_stream_cut_midway_is_one_error_and_no_partial_answer(settings: Settings,
                                                                       model_server: ModelServer) -> None:
    config = http_settings(settings, model_server.base_url, model_max_attempts=3)
    model_server.push(Reply(text="This answer never finishes streaming to the end.", cut_after_chunks=4),
                      Reply(text="whole answer"))
    async with serving_runtime(config, configured_model(config)) as h:
        failed = await h.turn("question", stream=True)
        await h.settled()
        assert closings(h) == [failed]
        streamed = "".join(e.text for e in h.chats["c1"].of(OutboundKind.DELTA))
        later = await h.turn("again")
    assert failed.kind is OutboundKind.ERROR and "broke off" in failed.text
    assert streamed  # part of it was shown as a draft...
    assert len(model_server.requests) == 2  # ...so it was not retried (that would repeat the draft)
    assert later.text == "whole answer"
    # ...and no part of it was committed.
    assert await stored(config) == [(Role.USER, "question"), (Role.USER, "again"), (Role.ASSISTANT, "whole answer")]
    async with open_database(config) as db:
        owed = await SqlDeliveryStore(db).undelivered([CHANNEL])
    assert [d.text for d in owed if d.kind == "final"] == []


# --- background work fails -----------------------------------------------------------------------


@sqlite_only
async def test_a_failing_embedding_job_is_retried_with_backoff_and_the_answer_is_delivered_regardless(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    config = settings.model_copy(update={"job_backoff_base_s": 0.1, "job_max_attempts": 5})
    attempts: list[float] = []

    def flaky(memory: MemoryService) -> JobHandler:
        async def embed(job: Job) -> None:
            attempts.append(time.monotonic())
            if len(attempts) <= 3:
                raise ConnectionError("the embedding model is unreachable")
            await memory.flush_embeddings()
        return embed

    caplog.set_level(logging.WARNING)
    async with wired(config, ScriptedModel([ModelReply(text="answered")]), embed=flaky) as h:
        await h.runtime.memory.remember(IDENTITY, "the user likes tea")
        final = await h.turn("hello")
        assert final.kind is OutboundKind.FINAL and final.text == "answered"
        assert len(attempts) <= 1  # delivered before the job got anywhere
        await h.runtime.runner.wait_idle(timeout_s=10)
        counts = await job_counts(h.runtime.db)
        left = await h.runtime.memory.store.count_unembedded()
    # One embedding job (the turn's archived messages joined the pending one), done; and the archiving.
    assert len(attempts) == 4 and left == 0
    counts.pop((JobKind.CURATE_SKILLS, "done"), None)  # every start's skill curation
    assert counts == {(JobKind.EMBED, "done"): 1, (JobKind.ARCHIVE, "done"): 1}
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert all(gap >= 0.1 * 2 ** i * 0.9 for i, gap in enumerate(gaps)), gaps  # 0.1, 0.2, 0.4 s
    warnings = [r.getMessage() for r in caplog.records if "embed" in r.getMessage()]
    assert len(warnings) == 3 and all("retrying" in w for w in warnings)
    assert await stored(config) == [(Role.USER, "hello"), (Role.ASSISTANT, "answered")]


async def test_a_failing_consolidation_is_retried_and_the_boundary_waits_for_a_success(settings: Settings) -> None:
    config = settings.model_copy(update={"consolidation_threshold": 4, "consolidation_keep_recent": 2,
                                         "job_backoff_base_s": 0.02})
    boundaries: list[int] = []
    release = asyncio.Event()
    holder: list[Runtime] = []

    async def model_fn(messages: list[Message], tools: object) -> ModelReply:
        if messages[0].content != SUMMARY_INSTRUCTION:
            return ModelReply(text=f"re: {messages[-1].content}")
        [summary] = await holder[0].sessions.list_sessions()
        boundaries.append(summary.last_consolidated)
        if len(boundaries) <= 2:
            raise ModelError("the summary model is down")
        await release.wait()
        return ModelReply(text="They said one and two.")

    runtime = await build_runtime(config, FunctionModel(model_fn), tools=ToolRegistry())
    holder.append(runtime)
    async with running_harness(runtime) as h:
        await h.turn("one")
        await h.turn("two")  # 4 messages: consolidation is due
        while len(boundaries) < 3:
            await asyncio.sleep(0.01)
        # Two failures behind, the third attempt waiting on the model: nothing moved, nothing lost.
        during = await runtime.sessions.load(KEY)
        assert (during.last_consolidated, len(during.messages)) == (0, 4)
        assert of_kind(await job_counts(runtime.db), JobKind.CONSOLIDATE) == {"running": 1}
        release.set()
        await runtime.runner.wait_idle(timeout_s=10)
        after = await runtime.sessions.load(KEY)
        counts = await job_counts(runtime.db)
        episodes = await runtime.memory.episodes(IDENTITY, KEY, 5)
    assert boundaries == [0, 0, 0]
    assert of_kind(counts, JobKind.CONSOLIDATE) == {"done": 1}
    assert {status for _, status in counts} == {"done"}  # the other jobs the turns queued ran too
    assert after.last_consolidated == 2 and [m.content for m in after.messages] == ["two", "re: two"]
    assert [e.content for e in episodes] == ["They said one and two."]
    assert await stored(config) == [(Role.USER, "one"), (Role.ASSISTANT, "re: one"),
                                    (Role.USER, "two"), (Role.ASSISTANT, "re: two")]


# --- the channel fails ---------------------------------------------------------------------------


@sqlite_only
async def test_a_failed_send_keeps_the_answer_owed_and_the_next_start_resends_it(settings: Settings) -> None:
    bus = RefusingBus(refuse_finals=1)
    async with wired(settings, ScriptedModel([ModelReply(text="committed answer")]), bus=bus) as h:
        await h.publish("question", message_id="m1")
        shown = await h.next_closing()
        await h.settled()
        assert closings(h) == [shown]
    assert shown.kind is OutboundKind.ERROR  # the user learns the send failed
    [refused] = bus.refused
    history = await stored(settings)
    assert history == [(Role.USER, "question"), (Role.ASSISTANT, "committed answer")]
    async with open_database(settings) as db:
        [answer] = [m for m in await SqlSessionStore(db).history(KEY) if m.role is Role.ASSISTANT]
        owed = [d for d in await SqlDeliveryStore(db).undelivered([CHANNEL]) if d.kind == "final"]
        assert [(d.delivery_id, d.text) for d in owed] == [(refused.delivery_id, "committed answer")]
        assert refused.delivery_id == f"{answer.turn_id}:{answer.seq}"

        # The next start of a process serving the channel.
        next_bus = RefusingBus(refuse_finals=0)
        worker = DeliveryWorker(SqlDeliveryStore(db), next_bus)
        await worker.start([CHANNEL])
        await worker.stop()
        resent = next_bus.drain()
        finals = [e for e in resent if e.kind is OutboundKind.FINAL]
        assert [(e.text, e.delivery_id, e.reply_to) for e in finals] == [
            ("committed answer", refused.delivery_id, "m1")]
        assert [d for d in await SqlDeliveryStore(db).undelivered([CHANNEL]) if d.kind == "final"] == []


@sqlite_only
async def test_a_redelivery_after_a_failed_send_gets_the_committed_answer(settings: Settings) -> None:
    model = ScriptedModel([ModelReply(text="committed"), ModelReply(text="a second answer")])
    async with wired(settings, model, bus=RefusingBus(refuse_finals=1)) as h:
        await h.publish("question", message_id="m1")
        assert (await h.next_closing()).kind is OutboundKind.ERROR  # the send failed
        await h.publish("question", message_id="m1")
        again = await h.next_closing()
    assert (again.kind, again.text) == (OutboundKind.FINAL, "committed")
    assert len(model.requests) == 1
    assert await stored(settings) == [(Role.USER, "question"), (Role.ASSISTANT, "committed")]


async def owe_an_answer(db: SqliteDatabase, text: str = "owed answer") -> Delivery:
    """An answer committed with its outbox record, never sent (the store API, as a crash would leave it)."""
    sessions = SqlSessionStore(db)
    session = await sessions.load(KEY)
    turn_id = uuid.uuid4().hex
    receipt = Receipt(channel=CHANNEL, message_id=turn_id, chat_id="c1", sender_id="tester", turn_id=turn_id)
    await sessions.append(session, [Message.user("question", turn_id=turn_id)], receipt=receipt)
    owed = Delivery(delivery_id=delivery_id(turn_id, session.next_seq), turn_id=turn_id, channel=CHANNEL,
                    chat_id="c1", reply_to=turn_id, kind="final", text=text)
    await sessions.append(session, [Message.assistant(text, turn_id=turn_id)], delivery=owed)
    return owed


@sqlite_only
async def test_a_channel_still_down_at_the_next_start_does_not_fail_the_start(settings: Settings) -> None:
    settings.home_dir.mkdir(parents=True, exist_ok=True)
    async with open_database(settings) as db:
        owed = await owe_an_answer(db)
    runtime = await assemble(settings, ScriptedModel([ModelReply(text="fresh")]), bus=RefusingBus(refuse_finals=1))
    try:
        async with running_harness(runtime, channels=(CHANNEL,)) as h:
            fresh = await h.turn("a new question")
    except ConnectionError:
        await runtime.runner.stop()
        await runtime.db.close()
        raise
    assert fresh.text == "fresh"
    async with open_database(settings) as db:
        assert [d.delivery_id for d in await SqlDeliveryStore(db).undelivered([CHANNEL])] == [owed.delivery_id]


@sqlite_only
async def test_a_resend_refused_by_the_channel_is_tried_again_at_the_next_sweep(settings: Settings) -> None:
    settings.home_dir.mkdir(parents=True, exist_ok=True)
    async with open_database(settings) as db:
        bus = RefusingBus(refuse_finals=1)
        worker = DeliveryWorker(SqlDeliveryStore(db), bus, sweep_s=0.1)
        await worker.start([CHANNEL])
        owed = await owe_an_answer(db)
        # The first sweep that finds it is refused by the channel; a later one must send it.
        resent: list[OutboundEvent] = []
        deadline = time.monotonic() + 2
        while not resent and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            resent = bus.drain()
        await worker.stop()
        gc.collect()  # a worker task that died is reported now, not in the middle of pytest's own work
        assert [e.delivery_id for e in bus.refused] == [owed.delivery_id]
        assert [(e.delivery_id, e.text) for e in resent] == [(owed.delivery_id, owed.text)], "never tried again"


# --- the disk is locked by another process -------------------------------------------------------


@contextmanager
def write_locked(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holds SQLite's write lock on the database until the block ends (taken once
    a write of the runtime's own in flight, a job's or a trace's, has committed)."""
    other = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield other
        other.execute("COMMIT")
    finally:
        other.close()


class Gated:
    """Answers once `release` is set, after saying it was asked."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, messages: list[Message], tools: object) -> ModelReply:
        self.asked.set()
        await self.release.wait()
        return ModelReply(text=self.text)


async def lock_during(h: Harness, gated: Gated, where: str, hold_s: float) -> OutboundEvent:
    """One turn whose user message (`accept`) or answer (`answer`) commits while the lock is held."""
    path = h.runtime.db.path
    if where == "accept":
        with write_locked(path):
            await h.publish("question", message_id="m1")
            await asyncio.sleep(hold_s)
            gated.release.set()
    else:
        await h.publish("question", message_id="m1")
        await asyncio.wait_for(gated.asked.wait(), 5)
        with write_locked(path):
            gated.release.set()
            await asyncio.sleep(hold_s)
    return await h.next_closing()


@sqlite_only
@pytest.mark.parametrize("where", ["accept", "answer"])
async def test_a_briefly_locked_store_is_waited_for(settings: Settings, where: str) -> None:
    gated = Gated("answered after the wait")
    async with serving_runtime(settings, FunctionModel(gated)) as h:
        started_at = time.monotonic()
        final = await lock_during(h, gated, where, hold_s=0.7)
        took = time.monotonic() - started_at
        await h.settled()
        assert closings(h) == [final]
    assert final.kind is OutboundKind.FINAL and final.text == "answered after the wait"
    assert took >= 0.6
    assert await stored(settings) == [(Role.USER, "question"), (Role.ASSISTANT, "answered after the wait")]


async def inbox_and_outbox(settings: Settings) -> tuple[int, int]:
    """How many receipts of message m1, and how many final answers owed or sent for it."""
    i, o = schema.inbox, schema.outbox
    async with open_database(settings) as db, db.read() as conn:
        receipts = (await conn.execute(select(func.count()).where(i.c.channel == CHANNEL, i.c.message_id == "m1")
                                       )).scalar_one()
        finals = (await conn.execute(select(func.count()).where(o.c.reply_to == "m1", o.c.kind == "final")
                                     )).scalar_one()
    return receipts, finals


@sqlite_only
@pytest.mark.parametrize("where", ["accept", "answer"])
async def test_a_store_locked_past_the_busy_timeout_is_one_error_and_never_half_a_commit(
        settings: Settings, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 300)
    gated = Gated("the answer")
    async with serving_runtime(settings, FunctionModel(gated)) as h:
        failed = await lock_during(h, gated, where, hold_s=1.5)
        await h.settled()
        assert closings(h) == [failed]
    assert failed.kind is OutboundKind.ERROR
    history = await stored(settings)
    accepted, answered = await inbox_and_outbox(settings)
    # Each commit is whole or absent: a user row comes with its receipt, an answer with its outbox record.
    assert accepted == history.count((Role.USER, "question"))
    assert answered == history.count((Role.ASSISTANT, "the answer"))
    assert history == ([] if where == "accept" else [(Role.USER, "question")])
    # Nothing is lost for good: the channel's redelivery (accept) or the next start's recovery (answer) finishes it.
    retry = ScriptedModel([ModelReply(text="the answer")])
    async with serving_runtime(settings, retry, channels=(CHANNEL,), recover=True) as h:
        if where == "accept":
            await h.publish("question", message_id="m1")
        final = await h.next_closing()
    assert final.kind is OutboundKind.FINAL and final.text == "the answer"
    assert await stored(settings) == [(Role.USER, "question"), (Role.ASSISTANT, "the answer")]



@sqlite_only
async def test_a_store_locked_past_the_busy_timeout_says_so(settings: Settings, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 300)
    gated = Gated("the answer")
    async with serving_runtime(settings, FunctionModel(gated)) as h:
        failed = await lock_during(h, gated, "accept", hold_s=1.0)
    assert failed.kind is OutboundKind.ERROR
    assert "inside Ember" not in failed.text
    assert "busy" in failed.text or "locked" in failed.text


async def test_a_locked_or_broken_store_raises_embers_own_errors_not_the_drivers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 200)
    db = database.SqliteDatabase(tmp_path / "ember.db")
    await db.open()
    try:
        with write_locked(db.path):
            with pytest.raises(StoreBusy, match="Send the message again"):
                await db.run_write(lambda tx: tx.execute(Statement("CREATE TABLE t (x)")))
            with pytest.raises(StoreBusy):
                async with db.write() as conn:
                    await conn.execute(text("CREATE TABLE u (x)"))
        await db.run_write(lambda tx: tx.execute(Statement("CREATE TABLE t (x)")))  # free again: it goes through
        with pytest.raises(IntegrityError):  # a caller's own conflict stays the caller's to read
            await db.run_write(lambda tx: tx.execute(Statement("INSERT INTO jobs (id) VALUES (NULL)")))
    finally:
        await db.close()
    (tmp_path / "ember.db").write_bytes(b"not a database, just bytes " * 100)
    (tmp_path / "ember.db-wal").unlink(missing_ok=True)
    broken = database.SqliteDatabase(tmp_path / "ember.db")
    with pytest.raises(StoreUnavailable, match="the store failed"):
        await broken.open()
