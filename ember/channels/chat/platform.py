"""What every chat platform's channel does alike: its credential required at construction, and
which outbound events it shows, by edits (`show_streamed`) or, on a platform that cannot edit a
message, whole (`show_answers_only`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

from ember.channels.attachments import files_named
from ember.channels.chat.editing import EditStream
from ember.core.errors import ConfigError
from ember.core.events import OutboundEvent, OutboundKind

Show = Callable[[OutboundEvent], Awaitable[None]]


def required(secret: str | None, missing: str) -> str:
    """`secret`, or ConfigError with `missing`: which table needs it and where it may be set."""
    if not secret:
        raise ConfigError(missing)
    return secret


async def show_answers_only(event: OutboundEvent, *, ask: Show, answer: Show, sends_files: bool = False) -> None:
    """An approval request is asked and a final answer or error sent; deltas and tool steps are
    not shown, as a message once sent cannot be edited to follow them. Unless the platform
    `sends_files`, an answer's files are named at its end."""
    if event.kind is OutboundKind.APPROVAL_REQUEST:
        await ask(event)
    elif event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
        await answer(event if sends_files or not event.attachments else
                     replace(event, text=files_named(event.text, event.attachments)))


async def show_streamed(event: OutboundEvent, stream: EditStream, *, ask: Show) -> None:
    """Deltas grow the answer's draft, a tool call ends the text before it, an approval request
    is asked, and the final answer (or error) replaces the draft."""
    if event.kind is OutboundKind.DELTA:
        await stream.delta(event)
    elif event.kind is OutboundKind.TOOL_CALL:
        stream.tool_step(event)
    elif event.kind is OutboundKind.APPROVAL_REQUEST:
        await ask(event)
    elif event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
        await stream.final(event)
