"""The terminal channel: sends a line to the agent and renders what comes back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rich.console import Console

from ember.bus.base import InboundPublisher
from ember.core.channels import ChannelCapabilities
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.tools import decision_from_reply
from ember.runtime.approvals import ApprovalBroker, Resolution

CHANNEL = "cli"
SENDER = "local-user"  # the terminal's one person
TOOL_PREVIEW_CHARS = 200

async def read_line(prompt: str) -> str:
    """A line from stdin (a terminal or a pipe); EOF reads as an empty answer."""
    try:
        return await asyncio.to_thread(input, prompt)
    except EOFError:
        return ""


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    ok: bool


class CliChannel:
    """`console` shows the conversation; approval questions go to `prompts` and
    are answered by `ask` (stdin by default)."""

    name = CHANNEL
    capabilities = ChannelCapabilities(streams=True)

    def __init__(self, bus: InboundPublisher, approvals: ApprovalBroker, console: Console, prompts: Console, *,
                 chat_id: str, ask: Callable[[str], Awaitable[str]] = read_line, agent: str | None = None) -> None:
        """`agent`: the named agent its messages ask for (None: the session's, else the default)."""
        self._bus = bus
        self._agent = agent
        self._approvals = approvals
        self._console = console
        self._prompts = prompts
        self._chat_id = chat_id
        self._sender_id = SENDER
        self._ask = ask
        self._waiting: dict[str, asyncio.Queue[OutboundEvent]] = {}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def deliver(self, event: OutboundEvent) -> None:
        queue = self._waiting.get(event.reply_to or "")
        if queue is not None:  # else e.g. an earlier process's answer, re-sent: it is in the history
            queue.put_nowait(event)

    async def send(self, text: str, *, stream: bool) -> Answer:
        """One turn. With `stream`, deltas and tool steps are printed as they come
        and the final answer is printed only where it differs from the draft."""
        message_id = uuid.uuid4().hex
        self._waiting[message_id] = queue = asyncio.Queue()
        try:
            await self._bus.publish_inbound(
                InboundEvent(channel=CHANNEL, chat_id=self._chat_id, sender_id=self._sender_id, text=text,
                             message_id=message_id, stream=stream, can_approve=True, agent=self._agent)
            )
            return await self._show(queue, stream)
        finally:
            del self._waiting[message_id]

    async def _show(self, queue: asyncio.Queue[OutboundEvent], stream: bool) -> Answer:
        draft = ""
        while True:
            event = await queue.get()
            if event.kind is OutboundKind.DELTA:
                draft += event.text
                self._console.print(event.text, end="", markup=False, highlight=False)
            elif event.kind is OutboundKind.TOOL_CALL:
                self._end_line(draft)
                draft = ""
                self._console.print(f"  → {event.text}", style="dim", markup=False, highlight=False)
            elif event.kind is OutboundKind.TOOL_RESULT:
                preview = " ".join(event.text.split())[:TOOL_PREVIEW_CHARS]
                self._console.print(f"  ← {preview}", style="dim", markup=False, highlight=False)
            elif event.kind is OutboundKind.APPROVAL_REQUEST:
                self._end_line(draft)
                draft = ""
                await self._answer(event)
            elif event.kind is OutboundKind.FINAL:
                if stream:
                    self._show_final(draft, event.text)
                return Answer(event.text, ok=True)
            else:
                if stream:
                    self._end_line(draft)
                return Answer(event.text, ok=False)

    async def _answer(self, event: OutboundEvent) -> None:
        assert event.approval is not None
        request = event.approval
        self._prompts.print(f"[bold yellow]?[/bold yellow] {event.text}", highlight=False)
        self._prompts.print(f"  [y]es once, [a]lways in this session, [N]o (denied after {request.timeout_s:g} s): ",
                            end="", markup=False, highlight=False)
        answer = (await self._ask("")).strip().lower()
        decision = decision_from_reply(answer)
        outcome = await self._approvals.resolve(request.id, decision, by=self._sender_id,
                                                scope=f"{CHANNEL}:{self._chat_id}")
        if outcome is not Resolution.RESOLVED:
            self._prompts.print("  too late: nobody answered in time, so it was denied", style="dim")

    def _show_final(self, draft: str, final: str) -> None:
        if draft == final:
            self._console.print()
            return
        # The stream's draft and the committed answer differ (e.g. a capped tool loop): show the record.
        self._end_line(draft)
        self._console.print(final, markup=False, highlight=False)

    def _end_line(self, draft: str) -> None:
        if draft:
            self._console.print()
