"""Any OpenAI-compatible chat endpoint, through the official `openai` SDK.

The SDK's errors become the kinds of ModelError (`typed`): unavailable
(refused, timed out, 408/409/5xx), rate limited (429, with its Retry-After),
context too long, refused (content policy), bad request (any other 4xx), and a
stream broken after it started. Retries are models/retry.py's, before the
first chunk only.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import openai
from openai import AsyncOpenAI, AsyncStream, DefaultAioHttpClient

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
from ember.models.attachments import blind_notice, openai_content
from ember.models.base import ModelEvent, ModelReply, ReasoningDelta, TextDelta
from ember.models.retry import open_with_retries, retry_after_seconds
from ember.models.spec import ToolCallFormat
from ember.models.text_tools import TextCallStream, as_text_history, tools_prompt
from ember.models.unreachable import LISTING, connection_failure, unreachable_text

log = logging.getLogger(__name__)

_UNAVAILABLE_STATUS = {408, 409}
# How providers say a request is over the window, or was refused, in a 400's code or message.
_CONTEXT_CODES = {"context_length_exceeded", "string_above_max_length"}
_CONTEXT_WORDS = ("maximum context length", "context window", "context length", "too many tokens",
                  "prompt is too long")
_REFUSAL_CODES = {"content_filter", "content_policy_violation"}
# How a server says it takes no `tools` (with "tool" in the same message): llama.cpp without --jinja,
# an Ollama model whose template has none.
_NO_TOOLS_WORDS = ("jinja", "does not support", "not supported", "unsupported")


def typed(exc: openai.OpenAIError, where: str, base_url: str | None = None) -> ModelError:
    """The kind of ModelError an SDK error is, with `where` and what happened in its message
    (and, for a 404 from a `base_url` without /v1, the URL it probably meant)."""
    message = f"{where}: {_describe(exc, base_url)}"
    if (isinstance(exc, openai.NotFoundError) and base_url is not None
            and not base_url.rstrip("/").endswith("/v1")):
        message += f"; did you mean {base_url.rstrip('/')}/v1 ?"
    if isinstance(exc, openai.APITimeoutError) and connection_failure(exc) is None:
        return ModelTimedOut(message)
    if isinstance(exc, openai.APIConnectionError):
        return ModelUnavailable(message)
    if not isinstance(exc, openai.APIStatusError):
        return ModelError(message)
    status = exc.status_code
    if status == 429:
        return ModelRateLimited(message, retry_after_seconds(exc.response.headers.get("retry-after")))
    if status >= 500 or status in _UNAVAILABLE_STATUS:
        return ModelUnavailable(message)
    code = str(getattr(exc, "code", None) or "")
    text = exc.message.lower()
    if code in _CONTEXT_CODES or any(words in text for words in _CONTEXT_WORDS):
        return ContextTooLong(message)
    if code in _REFUSAL_CODES:
        return ModelRefused(message)
    return ModelBadRequest(message)


def _describe(exc: BaseException, base_url: str | None = None) -> str:
    if isinstance(exc, openai.APIStatusError):
        # The SDK's text is "Error code: N", then " - <the body's message>" when it has one.
        said = exc.message.removeprefix(f"Error code: {exc.status_code}").removeprefix(" - ").strip()
        return f"HTTP {exc.status_code}: {said}" if said else f"HTTP {exc.status_code} {_phrase(exc.status_code)}"
    if isinstance(exc, openai.APIConnectionError):
        # The aiohttp transport reports a refused connection as a connect timeout: the cause tells.
        if isinstance(exc, openai.APITimeoutError) and connection_failure(exc) is None:
            return "the request timed out"
        return unreachable_text(base_url, exc)
    return f"{type(exc).__name__}: {exc}"


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "(no reason given)"


def to_openai_message(message: Message, vision: bool = False) -> dict[str, Any]:
    if message.role is Role.TOOL:
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    if message.role is Role.USER:
        return {"role": "user", "content": openai_content(message, vision)}
    if message.role is not Role.ASSISTANT:
        return {"role": message.role.value, "content": message.content}
    payload: dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.tool_calls:
        payload["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.reasoning:
        # Providers with a separate reasoning field want it back within a tool loop.
        payload["reasoning_content"] = message.reasoning
    return payload


def to_openai_tool(spec: ToolSpec) -> dict[str, Any]:
    function = {"name": spec.name, "description": spec.description, "parameters": spec.parameters}
    return {"type": "function", "function": function}


@dataclass(slots=True)
class _PartialCall:
    index: int | None
    id: str = ""
    name: str = ""
    arguments: str = ""


class _ToolCallBuffer:
    """Reassembles tool calls from streamed fragments (`delta.tool_calls` items, as sent).

    OpenAI keys fragments by `index`; some compatible servers send each call
    whole without one, or reuse an index with a new id. A fragment starts a new
    call when its index is new or missing, or when it brings a different id.
    """

    def __init__(self) -> None:
        self._calls: list[_PartialCall] = []

    def add(self, fragments: Sequence[Mapping[str, Any]] | None) -> None:
        for fragment in fragments or ():
            function = fragment.get("function") or {}
            call = self._call_for(fragment.get("index"), fragment.get("id"), function.get("name"))
            call.id = call.id or fragment.get("id") or ""
            call.name += function.get("name") or ""
            call.arguments += function.get("arguments") or ""

    def _call_for(self, index: int | None, call_id: str | None, name: str | None) -> _PartialCall:
        if index is None and not call_id and not name and self._calls:
            return self._calls[-1]  # a bare continuation of the open call
        if index is not None:
            for call in reversed(self._calls):
                if call.index == index:
                    if call_id and call.id and call_id != call.id:
                        break  # the index was reused for a new call
                    return call
        call = _PartialCall(index)
        self._calls.append(call)
        return call

    def calls(self) -> tuple[ToolCall, ...]:
        out: list[ToolCall] = []
        seen: set[str] = set()
        for part in self._calls:
            if not part.name:
                raise ModelError(f"the model sent a tool call without a name (arguments {part.arguments[:200]!r})")
            # Results are matched to calls by id, so every id must be present and unique.
            call_id = part.id if part.id and part.id not in seen else f"call_{uuid.uuid4().hex[:16]}"
            seen.add(call_id)
            out.append(ToolCall(id=call_id, name=part.name, arguments=part.arguments or "{}"))
        return tuple(out)


class _ToolsRefused(Exception):
    """The endpoint will not take the `tools` parameter (llama.cpp without --jinja, an Ollama model without tools)."""


def _refuses_tools(exc: openai.APIStatusError) -> bool:
    said = exc.message.lower()
    return "tool" in said and any(words in said for words in _NO_TOOLS_WORDS)


class OpenAICompatibleModel:
    """`tool_call_format`: "native", the endpoint's tool calls only; "text", the tools told in the
    system prompt and the calls read from the answer's text (models/text_tools.py); "auto", native,
    with calls written as text read too, and text once the endpoint refuses the tools parameter."""

    def __init__(self, *, model: str, base_url: str, api_key: str | None, timeout_s: float = 60.0,
                 max_attempts: int = 4, tool_call_format: ToolCallFormat = "auto", vision: bool = False) -> None:
        self.name = model
        self._vision = vision
        self.base_url = base_url
        self._max_attempts = max_attempts
        self._tool_call_format = tool_call_format
        self._tools_as_text = tool_call_format == "text"
        # Retries are ours (tenacity), so they never repeat a stream that already produced text.
        # aiohttp as the SDK's transport (its documented option): at 100 concurrent turns, it
        # halves Ember's CPU per turn against the default httpx2 transport.
        self._client = AsyncOpenAI(base_url=base_url, api_key=api_key or "not-needed", timeout=timeout_s, max_retries=0,
                                   http_client=DefaultAioHttpClient())

    async def stream(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *,
                     sampling: Sampling | None = None) -> AsyncIterator[ModelEvent]:
        chunks = await self._open_for_tools(messages, tools, sampling)
        notice = blind_notice(messages, self._vision, self.name) or ""
        if notice:
            yield TextDelta(notice)
        text: list[str] = []
        reasoning: list[str] = []
        calls = _ToolCallBuffer()
        written = TextCallStream({t.name for t in tools}) if tools and self._tool_call_format != "native" else None
        usage, finish = None, None
        try:
            async with chunks:  # closes the connection even when the consumer stops early
                async for chunk in chunks:
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices")
                    finish = (choices[0].get("finish_reason") if choices else None) or finish
                    delta = choices[0].get("delta") if choices else None
                    if not delta:
                        continue
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if isinstance(thought, str) and thought:
                        reasoning.append(thought)
                        yield ReasoningDelta(thought)
                    content = delta.get("content")
                    if isinstance(content, str) and content:
                        text.append(content)
                        if shown := written.feed(content) if written else content:
                            yield TextDelta(shown)
                    calls.add(delta.get("tool_calls"))
        except (openai.OpenAIError, OSError, ValueError, AttributeError, TypeError) as exc:
            # ValueError covers malformed JSON in an event; the others, chunks of an unexpected shape.
            raise StreamBroken(f"the model stream from {self.base_url} broke off: {_describe(exc)}") from exc
        answer, tool_calls = "".join(text), calls.calls()
        if written is not None:
            tail, answer, as_text = written.finish()
            if tail:
                yield TextDelta(tail)
            tool_calls += as_text
        cached = ((usage := usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        yield ModelReply(
            text=notice + answer, tool_calls=tool_calls, reasoning="".join(reasoning) or None,
            input_tokens=max(0, (usage.get("prompt_tokens") or 0) - cached),  # as Anthropic counts: uncached only
            output_tokens=usage.get("completion_tokens") or 0,
            cache_read_tokens=cached,
            truncated=finish == "length",
            provider="openai",
        )

    async def _open_for_tools(self, messages: Sequence[Message], tools: Sequence[ToolSpec],
                              sampling: Sampling | None) -> AsyncStream[Any]:
        try:
            return await self._open(messages, tools, sampling)
        except _ToolsRefused as refused:
            # Said once: from now on this model is told its tools in the prompt, and calls them in text.
            log.warning("model %s at %s refuses the tools parameter (%s): its tools go in the system prompt "
                        "and its calls are read from its text from now on (tool_call_format = \"text\" says "
                        "so from the start)", self.name, self.base_url, refused)
            self._tools_as_text = True
            return await self._open(messages, tools, sampling)

    async def aclose(self) -> None:
        await self._client.close()

    async def list_models(self) -> list[str]:
        """For `ember doctor`: proves the endpoint answers and the key works."""
        try:
            page = await self._client.models.list()
        except openai.OpenAIError as exc:
            raise typed(exc, LISTING, self.base_url) from exc
        return [item.id for item in page.data]

    async def _open(self, messages: Sequence[Message], tools: Sequence[ToolSpec],
                    sampling: Sampling | None) -> AsyncStream[Any]:  # chunks: dicts
        as_text = self._tools_as_text and bool(tools)
        shown = _with_tools_told(as_text_history(messages), tools) if as_text else messages
        request: dict[str, Any] = {
            "model": self.name,
            "messages": [to_openai_message(m, self._vision) for m in shown],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling is not None:
            # max_tokens, not max_completion_tokens: the name every compatible server reads.
            request |= {name: value for name, value in (("max_tokens", sampling.max_tokens),
                                                        ("temperature", sampling.temperature),
                                                        ("top_p", sampling.top_p)) if value is not None}
        if tools and not as_text:
            request["tools"] = [to_openai_tool(t) for t in tools]

        async def post() -> AsyncStream[Any]:
            try:
                # The SDK's low-level post, with chunks left as the dicts they arrive as: `create`
                # first walks the whole history through its typed-dict transform (about 0.25 ms
                # per message), and each typed chunk costs a few hundred µs of pydantic construction.
                return await self._client.post(
                    "/chat/completions", body=request, cast_to=object, stream=True,
                    stream_cls=AsyncStream[object], options={"security": {"bearer_auth": True}},
                )
            except openai.APIStatusError as exc:
                if "tools" in request and self._tool_call_format == "auto" and _refuses_tools(exc):
                    raise _ToolsRefused(_describe(exc)) from exc
                raise typed(exc, f"model {self.name} at {self.base_url} failed", self.base_url) from exc
            except openai.OpenAIError as exc:
                raise typed(exc, f"model {self.name} at {self.base_url} failed", self.base_url) from exc

        return await open_with_retries(post, self._max_attempts)


def _with_tools_told(messages: list[Message], tools: Sequence[ToolSpec]) -> list[Message]:
    """`messages` with the tools described in their system prompt (one is added if there is none)."""
    told = tools_prompt(tools)
    if messages and messages[0].role is Role.SYSTEM:
        return [Message.system(f"{messages[0].content}\n\n{told}"), *messages[1:]]
    return [Message.system(told), *messages]
