"""The ModelClient protocol: a streamed completion with tool calls."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ember.core.errors import ModelError
from ember.core.messages import Message, ToolCall
from ember.core.sampling import Sampling
from ember.core.tools import ToolSpec


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelReply:
    """The whole of one model response; always the last event of a stream."""

    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    reasoning_blocks: str | None = None  # the provider's own, for Message.reasoning_blocks
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    truncated: bool = False  # cut off at the output limit (or the context window)
    model: str | None = None  # which model of a router's chain answered
    provider: str | None = None  # "openai", "anthropic": who served it
    passed_over: tuple[str, ...] = ()  # the models a router tried or skipped first, each with why


ModelEvent = TextDelta | ReasoningDelta | ModelReply


class ModelClient(Protocol):
    name: str

    def stream(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *,
               sampling: Sampling | None = None) -> AsyncIterator[ModelEvent]:
        """Deltas as they arrive, then exactly one ModelReply. Raises ModelError.

        `sampling`: the caller's options for this call, over the client's own settings.
        """
        ...

    async def aclose(self) -> None:
        """Release the client's connections; it is not used afterwards."""
        ...


async def complete(model: ModelClient, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> ModelReply:
    """Run a stream to its end and return the reply."""
    async for event in model.stream(messages, tools):
        if isinstance(event, ModelReply):
            return event
    raise ModelError(f"model {model.name} ended its stream without a reply")


class ModelEndpoint(ModelClient, Protocol):
    """A client of one provider's endpoint, which `ember doctor` and `ember models --check` can ask."""

    base_url: str

    async def list_models(self) -> list[str]:
        """The model names the endpoint offers; raises ModelError when it does not answer."""
        ...
