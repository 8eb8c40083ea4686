"""A scripted Anthropic Messages API server speaking real HTTP, for tests.

`POST /v1/messages` takes the next pushed `Turn` and streams it as the API
does: `message_start`, then per content block `content_block_start`, its
deltas (`thinking_delta` + `signature_delta`, `text_delta`,
`input_json_delta` fragments) and `content_block_stop`, a `ping`, then
`message_delta` (stop reason, output tokens) and `message_stop`. Errors come
back in the API's shape, as an HTTP status or as an `error` event mid-stream.

It checks what the real API checks about thinking: with thinking on, the
last assistant message of a tool loop must start with the thinking block this
server sent, signature intact.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.loopback import LoopbackServer, started

MODEL = "claude-test"
CHUNK_CHARS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One scripted response. `status` answers that HTTP error instead (`error_type`,
    `error_message`, `retry_after`); `stream_error` sends an `error` event of that type
    after `error_after_text` characters of text."""

    text: str = ""
    thinking: str | None = None
    redacted_thinking: str | None = None
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, input as JSON text)
    stop_reason: str | None = None  # default: tool_use when there are calls, else end_turn
    status: int | None = None
    error_type: str = "api_error"
    error_message: str = "scripted error"
    retry_after: str | None = None
    stream_error: str | None = None
    error_after_text: int = 0
    input_tokens: int = 21
    output_tokens: int = 7
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


def signature(thinking: str) -> str:
    return "sig-" + hashlib.sha256(thinking.encode()).hexdigest()[:24]


def _pieces(text: str) -> list[str]:
    return [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)] or [""]


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def _error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_test"}


class AnthropicServer:
    """Serves scripted turns on 127.0.0.1 from a background thread; records every request."""

    def __init__(self, model: str = MODEL) -> None:
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._script: deque[Turn] = deque()
        self._issued: set[str] = set()  # signatures this server sent
        self._server = LoopbackServer(Starlette(routes=[
            Route("/v1/messages", self._messages, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ]), "Anthropic server")

    @property
    def base_url(self) -> str:
        return self._server.origin  # the SDK adds /v1 itself

    def push(self, *turns: Turn) -> None:
        self._script.extend(turns)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    async def _messages(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if problem := self._invalid(body):
            return JSONResponse(_error_body("invalid_request_error", problem), status_code=400)
        if not self._script:
            return JSONResponse(_error_body("api_error", "anthropicserver: no scripted turn left"), status_code=500)
        turn = self._script.popleft()
        if turn.status is not None:
            headers = {"retry-after": turn.retry_after} if turn.retry_after else None
            return JSONResponse(_error_body(turn.error_type, turn.error_message), status_code=turn.status,
                                headers=headers)
        return StreamingResponse(iter(list(self._events(turn, body))), media_type="text/event-stream")

    def _invalid(self, body: dict[str, Any]) -> str | None:
        for name in ("model", "max_tokens", "messages"):
            if name not in body:
                return f"{name}: Field required"
        thinking = body.get("thinking") or {}
        if thinking.get("type") == "enabled" and thinking.get("budget_tokens", 0) >= body["max_tokens"]:
            return "`max_tokens` must be greater than `thinking.budget_tokens`"
        assistants = [m for m in body["messages"] if m["role"] == "assistant"]
        last = assistants[-1]["content"] if assistants else []
        if thinking.get("type") == "enabled" and any(block["type"] == "tool_use" for block in last):
            first = last[0]
            if first["type"] not in ("thinking", "redacted_thinking"):
                return (f"messages.{len(body['messages']) - 2}.content.0.type: Expected `thinking` or "
                        f"`redacted_thinking`, but found `{first['type']}`. When `thinking` is enabled, a final "
                        "`assistant` message must start with a thinking block")
            if first["type"] == "thinking" and first.get("signature") not in self._issued:
                return "Invalid `signature` in `thinking` block"
        return None

    def _events(self, turn: Turn, body: dict[str, Any]) -> Iterator[str]:
        number = len(self.requests)
        yield _sse("message_start", {"type": "message_start", "message": {
            "id": f"msg_{number}", "type": "message", "role": "assistant", "content": [], "model": body["model"],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": turn.input_tokens, "output_tokens": 1,
                      "cache_read_input_tokens": turn.cache_read_tokens,
                      "cache_creation_input_tokens": turn.cache_write_tokens}}})
        index = 0
        if turn.thinking is not None:
            sig = signature(turn.thinking)
            self._issued.add(sig)
            yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
            for piece in _pieces(turn.thinking):
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "thinking_delta", "thinking": piece}})
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "signature_delta", "signature": sig}})
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        if turn.redacted_thinking is not None:
            yield _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                "type": "redacted_thinking", "data": turn.redacted_thinking}})
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        if turn.text or turn.stream_error:
            yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": {"type": "text", "text": ""}})
            sent = 0
            for piece in _pieces(turn.text):
                if turn.stream_error and sent >= turn.error_after_text:
                    yield _sse("error", _error_body(turn.stream_error, "scripted stream error"))
                    return
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "text_delta", "text": piece}})
                sent += len(piece)
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        yield _sse("ping", {"type": "ping"})
        for call_number, (name, arguments) in enumerate(turn.tool_calls):
            yield _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                "type": "tool_use", "id": f"toolu_{number}_{call_number}", "name": name, "input": {}}})
            third = max(1, len(arguments) // 3)
            for start in range(0, len(arguments), third):
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": arguments[start:start + third]}})
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        stop = turn.stop_reason or ("tool_use" if turn.tool_calls else "end_turn")
        yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                     "usage": {"output_tokens": turn.output_tokens}})
        yield _sse("message_stop", {"type": "message_stop"})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"data": [{"id": self.model, "type": "model", "display_name": "Claude (test)",
                                       "created_at": "2026-01-01T00:00:00Z"}],
                             "has_more": False, "first_id": self.model, "last_id": self.model})


def serving(model: str = MODEL) -> AbstractContextManager[AnthropicServer]:
    return started(AnthropicServer(model))


@pytest.fixture
def anthropic_server() -> Iterator[AnthropicServer]:
    with serving() as server:
        yield server
