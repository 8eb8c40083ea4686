"""Chat messages as the session stores them and models read them."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace

from ember.core.attachments import Attachment


class Role(enum.StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool invocation requested by the model.

    `arguments` is the raw JSON text the model produced; it may be malformed,
    which the tool layer reports back to the model instead of crashing.
    """

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ToolCall:
        id_, name, arguments = data["id"], data["name"], data["arguments"]
        if not (isinstance(id_, str) and isinstance(name, str) and isinstance(arguments, str)):
            raise ValueError(f"malformed tool call: {data!r}")
        return cls(id=id_, name=name, arguments=arguments)


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One entry of a session's history.

    `seq` is the message's position in its session, assigned by the store when
    the message is committed; it is None for a message not yet stored.
    `reasoning` holds a provider's separate reasoning field; it is replayed to
    the model only within the tool loop of the turn that produced it.
    `name` is who wrote it where a session has several participants (a group
    chat), as the `name` of the OpenAI chat format. `reasoning_blocks` is a
    provider's reasoning as it sent it (Anthropic's thinking blocks with their
    signatures, as JSON), which it wants back within the tool loop; it is
    never stored. `attachments` are the files a user message came with, or an answer sent (a
    tool's file, a spoken reply), by reference; a model call's prompt carries a user's files'
    content (core/attachments.py).
    """

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None
    turn_id: str | None = None
    seq: int | None = None
    name: str | None = None
    reasoning_blocks: str | None = None
    attachments: tuple[Attachment, ...] = ()

    @classmethod
    def system(cls, content: str) -> Message:
        return cls(role=Role.SYSTEM, content=content)

    @classmethod
    def user(cls, content: str, *, turn_id: str | None = None, name: str | None = None,
             attachments: tuple[Attachment, ...] = ()) -> Message:
        return cls(role=Role.USER, content=content, turn_id=turn_id, name=name, attachments=attachments)

    @classmethod
    def assistant(
        cls,
        content: str,
        *,
        tool_calls: tuple[ToolCall, ...] = (),
        reasoning: str | None = None,
        reasoning_blocks: str | None = None,
        turn_id: str | None = None,
        name: str | None = None,
        attachments: tuple[Attachment, ...] = (),
    ) -> Message:
        return cls(
            role=Role.ASSISTANT,
            content=content,
            tool_calls=tool_calls,
            reasoning=reasoning,
            reasoning_blocks=reasoning_blocks,
            turn_id=turn_id,
            name=name,
            attachments=attachments,
        )

    @classmethod
    def tool_result(cls, call_id: str, content: str, *, turn_id: str | None = None,
                    attachments: tuple[Attachment, ...] = ()) -> Message:
        """`attachments`: files the call had the answer send (send_file); no model is shown them here."""
        return cls(role=Role.TOOL, content=content, tool_call_id=call_id, turn_id=turn_id, attachments=attachments)

    @property
    def has_tool_calls(self) -> bool:
        return self.role is Role.ASSISTANT and bool(self.tool_calls)

    def without_reasoning(self) -> Message:
        if self.reasoning is None and self.reasoning_blocks is None:
            return self
        return replace(self, reasoning=None, reasoning_blocks=None)

    def to_json_dict(self) -> dict[str, object]:
        """The public shape of a message (`ember sessions show --json`)."""
        return {
            "seq": self.seq,
            "role": self.role.value,
            "content": self.content,
            "tool_calls": [call.to_dict() for call in self.tool_calls],
            "tool_call_id": self.tool_call_id,
            "name": self.name,
            "attachments": [attachment.to_dict() for attachment in self.attachments],
        }


def encode_tool_calls(calls: tuple[ToolCall, ...]) -> str | None:
    return json.dumps([call.to_dict() for call in calls]) if calls else None


def encode_attachments(attachments: tuple[Attachment, ...]) -> str | None:
    return json.dumps([attachment.to_dict() for attachment in attachments]) if attachments else None


def decode_attachments(raw: str | None) -> tuple[Attachment, ...]:
    if not raw:
        return ()
    data = json.loads(raw)
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        raise ValueError("attachments is not a list of objects")
    return tuple(Attachment.from_dict(item) for item in data)


def decode_tool_calls(raw: str | None) -> tuple[ToolCall, ...]:
    if not raw:
        return ()
    data = json.loads(raw)
    if not isinstance(data, list):
        raise ValueError("tool_calls is not a list")
    return tuple(ToolCall.from_dict(item) for item in data)


@dataclass(slots=True)
class Session:
    """A session's state as one turn sees it.

    `messages` holds the window since `last_consolidated` (a seq boundary: every
    message with a smaller seq has been folded into episodic memory).
    `next_seq` is the seq the next appended message receives. Seqs equal list
    indexes of the full history, except where an unreadable row was set aside.
    `metadata` is written when the session is created (its first commit).
    """

    key: str
    messages: list[Message] = field(default_factory=list)
    last_consolidated: int = 0
    next_seq: int = 0
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def unconsolidated_count(self) -> int:
        return self.next_seq - self.last_consolidated
