"""The terminal channel: sends a line to the agent and renders what comes back."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from rich.console import Console

from ember.bus.base import Bus
from ember.core.events import InboundEvent, OutboundKind

CHANNEL = "cli"
TOOL_PREVIEW_CHARS = 200


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    ok: bool


class CliChannel:
    def __init__(self, bus: Bus, console: Console, *, chat_id: str, sender_id: str = "local-user") -> None:
        self._bus = bus
        self._console = console
        self._chat_id = chat_id
        self._sender_id = sender_id

    async def send(self, text: str, *, stream: bool) -> Answer:
        """One turn. With `stream`, deltas and tool steps are printed as they come
        and the final answer is printed only where it differs from the draft."""
        await self._bus.publish_inbound(
            InboundEvent(channel=CHANNEL, chat_id=self._chat_id, sender_id=self._sender_id, text=text,
                         message_id=uuid.uuid4().hex, stream=stream)
        )
        draft = ""
        while True:
            event = await self._bus.next_outbound(CHANNEL)
            if event.chat_id != self._chat_id:
                continue
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
            elif event.kind is OutboundKind.FINAL:
                if stream:
                    self._show_final(draft, event.text)
                return Answer(event.text, ok=True)
            else:
                if stream:
                    self._end_line(draft)
                return Answer(event.text, ok=False)

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
