"""The Channel seam: every entrance (terminal, gateway, webhooks, chat platforms) is one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ember.core.events import OutboundEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelCapabilities:
    """What a channel can do with a turn's output."""

    streams: bool = False  # shows deltas as they come (a live request, a terminal)
    edits: bool = False  # streams by editing one message it has sent (chat platforms)
    buttons: bool = False  # can put an approval to a person as buttons
    # Asks its person to approve a tool call (buttons, or a typed /approve): a turn resumed after
    # a restart can still ask. Its turns stream when it `edits`.
    approvals: bool = False
    max_message_chars: int | None = None  # longer answers are split by the channel
    # Reports each delivery itself (a remote target that can fail): an answer counts as delivered
    # only once `deliver` has returned, and one `deliver` refuses for good is never re-sent.
    confirms_delivery: bool = False


class DeliveryRefused(Exception):
    """The target refused an answer for good (a 4xx): it is recorded as given up, not retried."""


class Channel(Protocol):
    """An entrance: it publishes the messages it accepts to the bus, and is handed what is
    addressed to it. `deliver` raising leaves a committed answer owed: it is sent again later."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> ChannelCapabilities: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def deliver(self, event: OutboundEvent) -> None: ...
