"""What every chat platform's channel does alike: its credential required at construction, and,
on a platform that cannot edit a message, which outbound events it shows."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ember.core.errors import ConfigError
from ember.core.events import OutboundEvent, OutboundKind

Show = Callable[[OutboundEvent], Awaitable[None]]


def required(secret: str | None, missing: str) -> str:
    """`secret`, or ConfigError with `missing`: which table needs it and where it may be set."""
    if not secret:
        raise ConfigError(missing)
    return secret


async def show_answers_only(event: OutboundEvent, *, ask: Show, answer: Show) -> None:
    """An approval request is asked and a final answer or error sent; deltas and tool steps are
    not shown, as a message once sent cannot be edited to follow them."""
    if event.kind is OutboundKind.APPROVAL_REQUEST:
        await ask(event)
    elif event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
        await answer(event)
