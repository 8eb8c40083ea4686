"""Shared fixtures: a hermetic environment and a runtime driven through its bus."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pydantic import BaseModel
from sqlalchemy import func, select

from ember.app.runtime import Runtime, build_runtime, running
from ember.config.settings import Settings
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.journal import TurnJournal
from ember.core.memory import default_identity
from ember.core.tools import Decision, Risk, ToolAction, ToolRun, Verdict
from ember.models.base import ModelClient
from ember.store import schema
from ember.store.sqlite.database import SqliteDatabase
from ember.tools.base import FunctionTool, ToolRegistry, Toolset
from ember.tools.delegate import DelegationSpec

CHANNEL = "test"
SENDER = "tester"  # who sends every message of the test channel
# Whose memory a test-channel session writes to and reads from (no [identities] bindings).
IDENTITY = default_identity(f"{CHANNEL}:{SENDER}")
# The system message's section of this session's episodic summaries (ember/pipeline/context.py).
EPISODES_HEADING = "Earlier in this conversation:"

# The scripted OpenAI-compatible and Anthropic servers, as the `model_server` and `anthropic_server` fixtures;
# a throwaway Redis as `redis_server` and PostgreSQL as `pg_server`; headless Chromium as `browser` and `page`.
pytest_plugins = ("tests.modelserver", "tests.anthropicserver", "tests.gatewayproc", "tests.redisserver",
                  "tests.pgserver", "tests.browser")


@pytest.fixture(autouse=True)
def hermetic_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No user configuration leaks into a test."""
    for name in list(os.environ):
        if name.startswith(("EMBER_", "OPENAI_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[SqliteDatabase]:
    database = SqliteDatabase(tmp_path / "ember.db")
    await database.open()
    yield database
    await database.close()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    # The delegate tool is left out of the tools a test gives its model (tests/test_delegation.py adds it).
    return Settings(home=tmp_path / "home", consolidation_threshold=1_000, consolidation_keep_recent=2,
                    job_backoff_base_s=0.01, delegation=DelegationSpec(enabled=False))


@dataclass
class Conversation:
    """Everything the test channel received for one chat."""

    events: list[OutboundEvent] = field(default_factory=list)
    closed: asyncio.Queue[OutboundEvent] = field(default_factory=asyncio.Queue)

    def of(self, kind: OutboundKind) -> list[OutboundEvent]:
        return [e for e in self.events if e.kind is kind]


class Harness:
    """A running runtime plus a test channel that records what it is sent."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.chats: defaultdict[str, Conversation] = defaultdict(Conversation)
        self._markers: dict[str, asyncio.Event] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            event = await self.runtime.bus.next_outbound(CHANNEL)
            if event.turn_id in self._markers:
                self._markers[event.turn_id].set()
                continue
            chat = self.chats[event.chat_id]
            chat.events.append(event)
            if event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
                chat.closed.put_nowait(event)

    async def publish(self, text: str, *, chat: str = "c1", stream: bool = False,
                      message_id: str | None = None, can_approve: bool = False) -> None:
        await self.runtime.bus.publish_inbound(
            InboundEvent(channel=CHANNEL, chat_id=chat, sender_id=SENDER, text=text,
                         message_id=message_id or uuid.uuid4().hex, stream=stream, can_approve=can_approve)
        )

    async def next_closing(self, chat: str = "c1", timeout: float = 20.0) -> OutboundEvent:
        """The next FINAL or ERROR of a chat."""
        return await asyncio.wait_for(self.chats[chat].closed.get(), timeout)

    async def turn(self, text: str, *, chat: str = "c1", stream: bool = False) -> OutboundEvent:
        await self.publish(text, chat=chat, stream=stream)
        return await self.next_closing(chat)

    async def settled(self, chat: str = "c1", timeout: float = 20.0) -> None:
        """Until the loop has handled everything queued for `chat`'s session and sent to the channel,
        and the test channel has read it: what a test then finds missing was never sent.

        A quiet message (recovery of one never accepted: nothing to do) goes behind what is queued
        for the session, which a session's turns are in order with; once it ended and no turn runs,
        a marker goes to the channel behind what the turns sent, addressed as their answers are (on
        Redis, to this process's stream, by the quiet message's route), and is not recorded."""
        loop = self.runtime.loop
        ended, marker = loop.turns_ended, f"settled-{uuid.uuid4().hex}"
        read = self._markers[marker] = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                await self.runtime.bus.publish_inbound(InboundEvent(
                    channel=CHANNEL, chat_id=chat, sender_id=SENDER, text="", message_id=marker, recovery=True))
                while not (loop.idle.is_set() and loop.turns_ended > ended):
                    await asyncio.sleep(0.005)  # a positive wait: the quiet message's turn comes and goes
                await self.runtime.bus.publish_outbound(OutboundEvent(
                    channel=CHANNEL, chat_id=chat, kind=OutboundKind.DELTA, text="", turn_id=marker,
                    reply_to=marker))
                await read.wait()
        finally:
            del self._markers[marker]

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


def session_key(chat: str = "c1") -> str:
    return f"{CHANNEL}:{chat}"


async def job_counts(db: SqliteDatabase) -> dict[tuple[str, str], int]:
    """(kind, status) -> how many jobs: every turn also queues work of its own (archiving its
    messages, embedding them), so a test counts the kinds it is about."""
    j = schema.jobs
    async with db.read() as conn:
        rows = await conn.execute(select(j.c.kind, j.c.status, func.count()).group_by(j.c.kind, j.c.status))
        return {(kind, status): count for kind, status, count in rows}


def of_kind(counts: dict[tuple[str, str], int], kind: str) -> dict[str, int]:
    """The status counts of one kind of job, as `SqlJobStore.counts` gives them for all."""
    return {status: n for (k, status), n in counts.items() if k == kind}


@asynccontextmanager
async def running_harness(runtime: Runtime, *, channels: Iterable[str] = (),
                          recover: bool = False) -> AsyncIterator[Harness]:
    """`runtime` started as a process would start it, with the test channel reading for the block."""
    async with running(runtime, channels=channels, recover=recover):
        harness = Harness(runtime)
        try:
            yield harness
        finally:
            await harness.close()


@asynccontextmanager
async def serving_runtime(settings: Settings, model: ModelClient, *, tools: Toolset | None = None,
                          channels: Iterable[str] = (), recover: bool = False) -> AsyncIterator[Harness]:
    """One "process": a runtime on `settings.home` with `tools` (none by default), the test channel
    reading for the block; `channels` and `recover` as `running` takes them."""
    runtime = await build_runtime(settings, model, tools=tools or ToolRegistry())
    async with running_harness(runtime, channels=channels, recover=recover) as harness:
        yield harness


@pytest.fixture
def start(settings: Settings):  # type: ignore[no-untyped-def]
    """`async with start(model) as h:` runs a runtime on `model` for the block (the built-in tools
    unless `tools` is given)."""

    @asynccontextmanager
    async def _start(model: ModelClient, *, tools: Toolset | None = None,
                     config: Settings | None = None) -> AsyncIterator[Harness]:
        async with running_harness(await build_runtime(config or settings, model, tools=tools)) as harness:
            yield harness

    return _start


class NoteArgs(BaseModel):
    text: str


def note_tool(calls: list[str], *, name: str = "note", says: str = "noted") -> FunctionTool[NoteArgs]:
    """A read-risk tool that records each text it is given and answers `"<says> <text>"`."""

    async def note(args: NoteArgs) -> str:
        calls.append(args.text)
        return f"{says} {args.text}"

    return FunctionTool(name, "Write a note down.", NoteArgs, note, risk=Risk.READ)


class FixedApprover:
    """Answers every approval request the same way, and remembers what it was asked."""

    def __init__(self, decision: Decision = Decision.DENY) -> None:
        self.decision = decision
        self.asked: list[ToolAction] = []

    async def approve(self, action: ToolAction) -> Verdict:
        self.asked.append(action)
        return Verdict(self.decision, "user:tester", time.time())


def tool_run(approver: FixedApprover | None = None) -> ToolRun:
    return ToolRun("test:c1", "turn-1", approver or FixedApprover(), TurnJournal(), "local")
