"""What the chat platforms' tests share: a tool that needs approval, a model that calls it, a
model that sends files, and what a test reads back: the texts a chat shows, and what was kept of a sender; and a channel
registered so that a test can wait until everything a chat was sent has been delivered."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import httpx
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.routing import Route

from ember.app.runtime import Runtime, running
from ember.channels.gateway.http import ApiError
from ember.core.channels import Channel, ChannelCapabilities
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import Risk
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store.tx import Statement
from ember.tools.base import FunctionTool
from tests.loopback import served_here


class WriteArgs(BaseModel):
    path: str


def writing_tool(ran: list[str]) -> FunctionTool[WriteArgs]:
    """A write-risk tool (so it asks first) that records each path it was allowed to write."""
    async def write(args: WriteArgs) -> str:
        ran.append(args.path)
        return f"wrote {args.path}"
    return FunctionTool("write_note", "Write a note file.", WriteArgs, write, risk=Risk.WRITE,
                        subject=lambda a: a.path, verb="write the file")


def asking_model() -> FunctionModel:
    """Calls write_note on notes.txt, then answers with what the call returned."""
    def reply(messages: list[Message], tools: Any) -> ModelReply:
        if messages[-1].role is Role.TOOL:
            return ModelReply(text=f"Result: {messages[-1].content}")
        return ModelReply(tool_calls=(ToolCall("w1", "write_note", json.dumps({"path": "notes.txt"})),))
    return FunctionModel(reply)


def sending_model(*names: str, seen: list[Message] | None = None) -> FunctionModel:
    """Answers a message that brings files "A small picture."; any other by sending the workspace
    files `names` (send_file), then "Here you are.". Each message it is asked about goes in `seen`."""
    def reply(messages: list[Message], tools: Any) -> ModelReply:
        if messages[-1].role is Role.TOOL:
            return ModelReply(text="Here you are.")
        if seen is not None:
            seen.append(messages[-1])
        if messages[-1].attachments:
            return ModelReply(text="A small picture.")
        return ModelReply(tool_calls=tuple(ToolCall(f"s{n}", "send_file", json.dumps({"path": name}))
                                           for n, name in enumerate(names)))
    return FunctionModel(reply)


class Settling:
    """A platform's channel as the runtime is given it: what it is handed goes to the channel,
    but for the markers `settled` sends, which it takes back (the channel never sees them)."""

    def __init__(self, channel: Channel, runtime: Runtime) -> None:
        self.channel = channel
        self._runtime = runtime
        self._markers: dict[str, asyncio.Event] = {}

    @property
    def name(self) -> str:
        return self.channel.name

    @property
    def capabilities(self) -> ChannelCapabilities:
        return self.channel.capabilities

    async def start(self) -> None:
        await self.channel.start()

    async def stop(self) -> None:
        await self.channel.stop()

    async def deliver(self, event: OutboundEvent) -> None:
        if event.turn_id in self._markers:
            self._markers[event.turn_id].set()
            return
        await self.channel.deliver(event)

    async def settled(self, chat_id: str, *, turn_waits: bool = False, timeout_s: float = 30) -> None:
        """Until the loop has handled everything queued for the chat's session and the channel has
        delivered what the turns sent the chat: what the platform then misses was never sent.
        `turn_waits`: the session's turn waits for a person (an approval), so only what was sent
        so far is waited for.

        As tests/conftest.py's Harness.settled: a quiet message (recovery of one never accepted:
        nothing to do) goes behind what is queued for the session; once it ended and no turn runs,
        a marker goes to the chat behind what the turns sent it, in its delivery order."""
        loop = self._runtime.loop
        ended, marker = loop.turns_ended, f"settled-{uuid.uuid4().hex}"
        read = self._markers[marker] = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                if not turn_waits:
                    await self._runtime.bus.publish_inbound(InboundEvent(
                        channel=self.name, chat_id=chat_id, sender_id="settled", text="", message_id=marker,
                        recovery=True))
                    while not (loop.idle.is_set() and loop.turns_ended > ended):
                        await asyncio.sleep(0.005)  # a positive wait: the quiet message's turn comes and goes
                await self._runtime.bus.publish_outbound(OutboundEvent(
                    channel=self.name, chat_id=chat_id, kind=OutboundKind.TOOL_CALL, text="", turn_id=marker))
                await read.wait()
        finally:
            del self._markers[marker]


def settling(runtime: Runtime, channel: Channel) -> Settling:
    """`channel` registered with `runtime`, as a Settling."""
    registered = Settling(channel, runtime)
    runtime.channels.register(registered)
    return registered


def settled_in(runtime: Runtime, name: str) -> Settling:
    """The Settling registered as channel `name`."""
    registered = runtime.channels.get(name)
    assert isinstance(registered, Settling), f"{name} was registered without settling()"
    return registered


async def answered(runtime: Runtime, channel: str, chat_id: str, *, answers: int = 1, timeout_s: float = 30) -> None:
    """Once the chat's session has `answers` answers and the channel has shown them (anything sent
    twice shows by then)."""
    async with asyncio.timeout(timeout_s):
        while len([m for m in await runtime.sessions.history(f"{channel}:{chat_id}")
                   if m.role is Role.ASSISTANT]) < answers:
            await asyncio.sleep(0.05)
        await settled_in(runtime, channel).settled(chat_id)


async def texts_when(texts: Callable[[], list[str]], count: int, settled: Callable[[], Awaitable[None]], *,
                     timeout_s: float = 30) -> list[str]:
    """`texts()` once it has `count` of them and `settled()` returned: anything sent twice shows by then."""
    async with asyncio.timeout(timeout_s):
        while len(texts()) < count:
            await asyncio.sleep(0.02)
    await settled()
    return texts()


async def kept(runtime: Runtime, sender: str) -> int:
    """How many of `sender`'s messages the store kept."""
    return await runtime.db.run_read(lambda tx: tx.execute(Statement(
        "SELECT COUNT(*) FROM accepted_inbound WHERE sender_id = :sender"), {"sender": sender}).fetchone()[0])


class CalledBack(Channel, Protocol):
    """A platform's channel that the platform calls back at routes of its own."""

    def routes(self) -> list[Route]: ...


@asynccontextmanager
async def called_back(runtime: Runtime, channel: CalledBack) -> AsyncIterator[httpx.AsyncClient]:
    """`runtime` running with `channel`, whose routes are served on this loop as `ember serve`
    serves them; a client to post to them as the platform does."""
    settling(runtime, channel)
    app = Starlette(routes=channel.routes(), exception_handlers={ApiError: lambda request, exc: exc.response()})
    async with running(runtime, recover=True), served_here(app) as origin, \
            httpx.AsyncClient(base_url=origin, timeout=10) as http:
        yield http
