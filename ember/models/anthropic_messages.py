"""Claude, through the official `anthropic` SDK: the Messages API, streamed.

Text and tool use stream as content blocks (a tool's input as `input_json_delta`
fragments). Extended thinking, when `thinking_budget` is set, streams into
the reasoning field; each thinking block is kept whole with its signature in
`reasoning_blocks`, because within a tool loop the API wants the last
assistant message's thinking back exactly as it sent it. A turn resumed after
a restart has lost those blocks (they are never stored), so that request goes
without thinking rather than fail.

Stop reasons: `max_tokens` and `model_context_window_exceeded` end the reply
as truncated; `refusal` is a ModelRefused; `pause_turn` is continued by
sending the partial answer back, as the API asks. The SDK's retries are off:
models/retry.py retries the opening of a request only, and its errors become
Ember's kinds (`typed`), 529 "overloaded" included.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anthropic
from anthropic import AsyncAnthropic

from ember.core.errors import (
    ContextTooLong,
    ModelBadRequest,
    ModelError,
    ModelRateLimited,
    ModelRefused,
    ModelTimedOut,
    ModelUnavailable,
    StreamBroken,
)
from ember.core.messages import Message, Role, ToolCall
from ember.core.sampling import Sampling
from ember.core.tools import ToolSpec
from ember.models.attachments import anthropic_blocks, blind_notice
from ember.models.base import ModelEvent, ModelReply, ReasoningDelta, TextDelta
from ember.models.retry import open_with_retries, retry_after_seconds
from ember.models.spec import ANTHROPIC_BASE_URL, ANTHROPIC_PREFIX, DEFAULT_MAX_TOKENS
from ember.models.unreachable import LISTING, unreachable_text

# A paused turn is continued at most this many times before the answer so far is returned.
MAX_CONTINUATIONS = 3
_UNAVAILABLE_TYPES = {"overloaded_error", "api_error", "timeout_error"}
_TRUNCATED = {"max_tokens", "model_context_window_exceeded"}


def typed(exc: anthropic.AnthropicError, where: str, base_url: str | None = None) -> ModelError:
    """The kind of ModelError an SDK error is, with `where` and what the API said."""
    message = f"{where}: {_describe(exc, base_url)}"
    if isinstance(exc, anthropic.APITimeoutError):
        return ModelTimedOut(message)
    if isinstance(exc, anthropic.APIConnectionError):
        return ModelUnavailable(message)
    if not isinstance(exc, anthropic.APIStatusError):
        return ModelError(message)
    status, kind = exc.status_code, _error_type(exc)
    if status == 429 or kind == "rate_limit_error":
        return ModelRateLimited(message, retry_after_seconds(exc.response.headers.get("retry-after")))
    if status >= 500 or status in (408, 409) or kind in _UNAVAILABLE_TYPES:
        return ModelUnavailable(message)
    if status == 413 or "prompt is too long" in message.lower():
        return ContextTooLong(message)
    return ModelBadRequest(message)


def _error_type(exc: anthropic.APIStatusError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error")
    return str(error.get("type", "")) if isinstance(error, dict) else ""


def _describe(exc: anthropic.AnthropicError, base_url: str | None = None) -> str:
    if isinstance(exc, anthropic.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
        said = error.get("message") or exc.message
        return f"HTTP {exc.status_code} {error.get('type') or ''}: {said}".replace("  ", " ")
    if isinstance(exc, anthropic.APITimeoutError):
        return "no answer within the timeout"
    if isinstance(exc, anthropic.APIConnectionError):
        return unreachable_text(base_url, exc)
    return str(exc)


def _tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's input as the API takes it back: an object, whatever the model wrote."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return {"unparsed_arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def _assistant_blocks(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = list(json.loads(message.reasoning_blocks)) if message.reasoning_blocks else []
    if message.content.strip():
        blocks.append({"type": "text", "text": message.content})
    blocks += [{"type": "tool_use", "id": call.id, "name": call.name, "input": _tool_input(call.arguments)}
               for call in message.tool_calls]
    return blocks


def _sent_back(block: dict[str, Any]) -> dict[str, Any]:
    """A streamed content block as the API takes it back: a tool's input parsed from its fragments."""
    if block["type"] != "tool_use":
        return block
    fragments = block.get("partial_json")
    return {"type": "tool_use", "id": block["id"], "name": block["name"],
            "input": _tool_input(fragments) if fragments else block.get("input") or {}}


def to_anthropic(messages: Sequence[Message], vision: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """(system text, messages) as the Messages API takes them: system messages joined, tool
    results as `tool_result` blocks of a user message, consecutive messages of one role merged,
    a user's files after its text (models/attachments.py)."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"] += blocks
        else:
            turns.append({"role": role, "content": blocks})

    for message in messages:
        if message.role is Role.SYSTEM:
            system.append(message.content)
        elif message.role is Role.USER:
            text = f"{message.name}: {message.content}" if message.name else message.content
            add("user", [{"type": "text", "text": text or "(empty message)"},
                         *anthropic_blocks(message.attachments, vision)])
        elif message.role is Role.TOOL:
            add("user", [{"type": "tool_result", "tool_use_id": message.tool_call_id,
                          "content": message.content or "(no output)"}])
        else:
            add("assistant", _assistant_blocks(message))
    if turns and turns[0]["role"] != "user":
        turns.insert(0, {"role": "user", "content": [{"type": "text", "text": "(the conversation so far)"}]})
    return "\n\n".join(part for part in system if part), turns


def _thinking_replayable(turns: list[dict[str, Any]]) -> bool:
    """Thinking may be on unless the last assistant message used a tool without its thinking blocks."""
    last = next((turn for turn in reversed(turns) if turn["role"] == "assistant"), None)
    if last is None or not any(block["type"] == "tool_use" for block in last["content"]):
        return True
    return last["content"][0]["type"] in ("thinking", "redacted_thinking")


@dataclass(slots=True)
class _Answer:
    """What the stream has said so far, across continuations of a paused turn."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)  # this response's content blocks, as sent
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    stop_reason: str | None = None
    said: bool = False  # a delta reached the consumer
    notice: str | None = None  # to say first: the model cannot see the message's images

    def reply(self) -> ModelReply:
        thinking = [b for b in self.blocks if b["type"] in ("thinking", "redacted_thinking")]
        calls = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                arguments = block.pop("partial_json", "") or json.dumps(block.get("input") or {})
                calls.append(ToolCall(id=block["id"], name=block["name"], arguments=arguments))
        return ModelReply(
            text="".join(self.text), tool_calls=tuple(calls), reasoning="".join(self.reasoning) or None,
            reasoning_blocks=json.dumps(thinking) if thinking else None,
            input_tokens=self.input_tokens, output_tokens=self.output_tokens,
            cache_read_tokens=self.cache_read_tokens, cache_write_tokens=self.cache_write_tokens,
            truncated=self.stop_reason in _TRUNCATED, provider="anthropic")


@dataclass(frozen=True, slots=True)
class TokenLimits:
    """An answer's token limit (the API requires one), and extended thinking's budget (None: off)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    thinking_budget: int | None = None


class AnthropicModel:
    def __init__(self, *, model: str, api_key: str | None, base_url: str | None = None, timeout_s: float = 60.0,
                 max_attempts: int = 4, limits: TokenLimits = TokenLimits(), vision: bool = False) -> None:
        self.name = model.removeprefix(ANTHROPIC_PREFIX)
        self.base_url = base_url or ANTHROPIC_BASE_URL
        self._max_attempts = max_attempts
        self._max_tokens = limits.max_tokens
        self._thinking_budget = limits.thinking_budget
        self._vision = vision
        self._client = AsyncAnthropic(api_key=api_key or "not-set", base_url=self.base_url, timeout=timeout_s,
                                      max_retries=0)

    async def stream(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *,
                     sampling: Sampling | None = None) -> AsyncIterator[ModelEvent]:
        system, turns = to_anthropic(messages, self._vision)
        request: dict[str, Any] = {"model": self.name, "max_tokens": self._max_tokens, "messages": turns}
        if system:
            request["system"] = system
        if tools:
            request["tools"] = [{"name": t.name, "description": t.description, "input_schema": t.parameters}
                                for t in tools]
        if self._thinking_budget and _thinking_replayable(turns):
            request["thinking"] = {"type": "enabled", "budget_tokens": self._thinking_budget}
        elif sampling is not None and sampling.max_tokens is not None:
            # Not while thinking, whose budget must fit under it. The Messages API as the SDK
            # speaks it takes no temperature or top_p: those are not sent.
            request["max_tokens"] = sampling.max_tokens
        answer = _Answer(notice=blind_notice(messages, self._vision, self.name))
        for _ in range(MAX_CONTINUATIONS + 1):
            answer.blocks, answer.stop_reason = [], None
            async for event in self._response(request, answer):
                yield event
            if answer.stop_reason != "pause_turn":
                break
            # The API paused a long turn: sent back as it is, the answer goes on where it stopped.
            request["messages"] = [*turns, {"role": "assistant", "content": [_sent_back(b) for b in answer.blocks]}]
        if answer.stop_reason == "refusal":
            raise ModelRefused(f"model {self.name} declined to answer (stop reason: refusal)")
        yield answer.reply()

    async def _response(self, request: dict[str, Any], answer: _Answer) -> AsyncIterator[ModelEvent]:
        async def open_stream() -> Any:
            try:
                return await self._client.messages.create(**request, stream=True)
            except anthropic.AnthropicError as exc:
                raise typed(exc, f"model {self.name} at {self.base_url} failed", self.base_url) from exc

        events = await open_with_retries(open_stream, self._max_attempts)
        if answer.notice:  # said once the model has taken the request: a fallback model says its own
            answer.text.append(answer.notice)
            answer.said = True
            yield TextDelta(answer.notice)
            answer.notice = None
        try:
            async with events:  # closes the connection even when the consumer stops early
                async for event in events:
                    for delta in self._read(event, answer):
                        answer.said = True
                        yield delta
        except anthropic.AnthropicError as exc:
            error = typed(exc, f"model {self.name} at {self.base_url}", self.base_url)
            if not answer.said and isinstance(error, ModelUnavailable):
                raise error from exc  # nothing shown yet: another model may still answer
            raise StreamBroken(f"the model stream from {self.base_url} broke off: {_describe(exc)}") from exc
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            raise StreamBroken(f"the model stream from {self.base_url} broke off: {exc}") from exc

    @staticmethod
    def _read(event: Any, answer: _Answer) -> list[ModelEvent]:
        kind = event.type
        if kind == "message_start":
            usage = event.message.usage
            answer.input_tokens += usage.input_tokens or 0
            answer.cache_read_tokens += getattr(usage, "cache_read_input_tokens", None) or 0
            answer.cache_write_tokens += getattr(usage, "cache_creation_input_tokens", None) or 0
        elif kind == "content_block_start":
            answer.blocks.append(event.content_block.model_dump(exclude_none=True))
        elif kind == "content_block_delta":
            block, delta = answer.blocks[event.index], event.delta
            if delta.type == "text_delta":
                block["text"] = block.get("text", "") + delta.text
                answer.text.append(delta.text)
                return [TextDelta(delta.text)]
            if delta.type == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.thinking
                answer.reasoning.append(delta.thinking)
                return [ReasoningDelta(delta.thinking)]
            if delta.type == "signature_delta":
                block["signature"] = block.get("signature", "") + delta.signature
            elif delta.type == "input_json_delta":  # the whole input is parsed once, at the end
                block["partial_json"] = block.get("partial_json", "") + delta.partial_json
        elif kind == "message_delta":
            answer.stop_reason = event.delta.stop_reason or answer.stop_reason
            if event.usage is not None and event.usage.output_tokens is not None:
                answer.output_tokens += event.usage.output_tokens
        return []

    async def aclose(self) -> None:
        await self._client.close()

    async def list_models(self) -> list[str]:
        """For `ember doctor` and `ember models --check`: the endpoint answers and the key works."""
        try:
            page = await self._client.models.list()
        except anthropic.AnthropicError as exc:
            raise typed(exc, LISTING, self.base_url) from exc
        return [item.id for item in page.data]
