"""Envelopes that cross the bus between channels and the agent loop."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ember.core.attachments import Attachment
from ember.core.messages import Message, ToolCall
from ember.core.sampling import Sampling
from ember.core.tools import ApprovalRequest


@dataclass(frozen=True, slots=True)
class ReplyRoute:
    """Where a turn's output goes: a channel, and a chat (or target) in it."""

    channel: str
    chat_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InboundEvent:
    """A user message accepted by a channel.

    `message_id` is the platform's own id for the message, when it has one.
    `stream` asks for deltas as the answer is generated. `can_approve` says
    the channel can put an approval request to a person and return the answer.
    """

    channel: str
    chat_id: str
    sender_id: str
    text: str
    message_id: str | None = None
    # Who wrote it, where a chat has several participants (a group chat): kept with the message.
    sender_name: str | None = None
    stream: bool = False
    can_approve: bool = False
    # Set by start-up recovery: finish the accepted message's interrupted turn, or do nothing.
    recovery: bool = False
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Where the answer goes when not back where the message came from (a webhook's outbound
    # target, the chat that created a scheduled task).
    reply: ReplyRoute | None = None
    # The client's options for the model calls answering it (the OpenAI route's max_tokens, ...).
    sampling: Sampling | None = None
    # The conversation before this message, as the client supplied it (user and assistant text):
    # a session this message starts begins with it. Ignored by a session that has messages.
    history: tuple[Message, ...] = ()
    # The named agent asked for (`[agents.NAME]`); None: the session's, else the default agent.
    agent: str | None = None
    # The files it came with, already stored in its session (core/attachments.py).
    attachments: tuple[Attachment, ...] = ()

    @property
    def session_key(self) -> str:
        return f"{self.channel}:{self.chat_id}"

    @property
    def origin(self) -> ReplyRoute:
        return ReplyRoute(self.channel, self.chat_id)

    @property
    def route(self) -> ReplyRoute:
        """Where this turn's deltas, approval requests and answer are sent."""
        return self.reply or self.origin


class OutboundKind(enum.StrEnum):
    DELTA = "delta"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    APPROVAL_REQUEST = "approval_request"
    FINAL = "final"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class TurnUsage:
    """The tokens of a turn's model calls: prompt tokens read fresh or from a cache, and output."""

    input_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboundEvent:
    """Something the agent sends back to a channel.

    A FINAL with `stream_full_text` carries the whole answer: channels replace
    the streamed draft with it rather than appending it. TOOL_CALL and
    TOOL_RESULT events name their call in `tool_call`; an APPROVAL_REQUEST
    carries its request in `approval`, and a channel answers it by id.
    """

    channel: str
    chat_id: str
    kind: OutboundKind
    text: str
    turn_id: str
    reply_to: str | None = None
    stream_full_text: bool = False
    tool_call: ToolCall | None = None
    approval: ApprovalRequest | None = None
    # The idempotency key of a committed answer (turn id, seq): a channel shows each once.
    delivery_id: str | None = None
    # A FINAL's: what the turn's model calls used (None: not known, e.g. an answer sent again).
    usage: TurnUsage | None = None
    # A DELTA's, TOOL_CALL's or TOOL_RESULT's place among the events its turn streamed (0: the
    # first): a reader that missed some (it joined the turn midway through another gateway, or
    # the bus lost them) knows its draft lacks them.
    stream_index: int | None = None
    # A FINAL's files, stored in `session_key` (a channel reads their bytes from there).
    attachments: tuple[Attachment, ...] = ()
    session_key: str | None = None
