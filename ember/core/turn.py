"""The plain values the pipeline stages hand to each other for one turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ember.core.attachments import Attachment
from ember.core.delivery import Delivery
from ember.core.events import InboundEvent, TurnUsage
from ember.core.messages import Message, Session, ToolCall


class StreamSink(Protocol):
    """Where a turn's live output goes while it is being produced."""

    async def delta(self, text: str) -> None: ...

    async def tool_call(self, call: ToolCall) -> None: ...

    async def tool_result(self, call: ToolCall, result: str) -> None: ...

    async def finalize(self, answer: Delivery, usage: TurnUsage | None = None) -> bool:
        """Send the committed answer (with what the turn's model calls used); True when it reached the channel."""
        ...

    def close(self) -> None:
        """The turn ends without a final (stopped, failed): live output not yet sent is dropped."""
        ...


class _NoStream:
    """The sink of a turn nobody watches live (a request that does not stream, a scheduled task):
    its output goes nowhere until the answer is committed, which the loop then sends."""

    async def delta(self, text: str) -> None:
        pass

    async def tool_call(self, call: ToolCall) -> None:
        pass

    async def tool_result(self, call: ToolCall, result: str) -> None:
        pass

    async def finalize(self, answer: Delivery, usage: TurnUsage | None = None) -> bool:
        return False

    def close(self) -> None:
        pass


NO_STREAM: StreamSink = _NoStream()


class TurnControl(Protocol):
    """Stops the turn running in a session: where the agent loop runs it (in this process, or,
    scaled out, wherever it holds the session's lease)."""

    async def stop_turn(self, session_key: str) -> str | None:
        """Cancel it, keeping what it committed; the turn's id, or None if none was running."""
        ...


@dataclass(slots=True, kw_only=True)
class PipelineContext:
    """What ContextStage prepared: the session (with the user message already
    committed) and the exact prompt the model will see."""

    event: InboundEvent
    turn_id: str
    identity: str  # the person the turn is for
    session: Session
    prompt: list[Message]
    intro_text: str = ""
    stream: StreamSink = NO_STREAM
    agent: str | None = None  # the named agent it runs as (None: the default agent)
    memory_identity: str = ""  # whose memory it reads and writes: the person's, or its agent's own with them


@dataclass(frozen=True, slots=True, kw_only=True)
class InferenceResult:
    response_text: str
    total_tool_calls: int = 0
    tool_names: tuple[str, ...] = ()
    should_review_skills: bool = False
    should_review_memory: bool = False
    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from (or written to) a provider's cache
    files: tuple[Attachment, ...] = ()  # what the turn's tools sent with its answer, stored in its session


@dataclass(frozen=True, slots=True)
class ProcessResult:
    answer: Delivery  # as committed
    outbound_sent: bool
    usage: TurnUsage | None = None

    @property
    def response_text(self) -> str:
        return self.answer.text

    @property
    def delivery_id(self) -> str:
        return self.answer.delivery_id
