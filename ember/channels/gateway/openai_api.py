"""The OpenAI-compatible routes: any OpenAI client can talk to an Ember agent.

Ember keeps the conversation: the last user message of a request is the new
message, and the session comes from the `X-Ember-Session` header, else the
request's `user` field, else the messages before the new one: the session whose
conversation they are, or a new one seeded with them (conversations.py). The
response's `X-Ember-Session` header names it.

Streaming sends only visible text. The final answer reconciles the draft: what
the deltas have not yet said of it is sent as one more delta, so the deltas of
the answering step add up to the committed answer, and it is never sent twice.
Text a model writes before calling a tool is streamed too, followed by a blank
line; the tool calls themselves are not part of this protocol's output. Its
clients cannot answer approval requests, so calls that need one are denied.

The protocol has no place for an answer's files: each is named at the end of the
content with the address the native API serves it at, and listed (with `url`) in
the message's `attachments`, which stock clients ignore.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.channels.attachments import files_named
from ember.channels.gateway.conversations import Conversations, Thread, conversation
from ember.channels.gateway.http import (
    IDEMPOTENCY_HEADER,
    KEEPALIVE_S,
    SESSION_HEADER,
    SSE_HEADERS,
    SSE_KEEPALIVE,
    ApiError,
    checked_client_id,
    checked_key,
    evaluation_requested,
    next_event,
    read_json,
    sse,
)
from ember.channels.gateway.metrics import GatewayMetrics, TurnClock
from ember.channels.gateway.sampling import DEFAULT_LIMITS, SamplingLimits, requested_sampling
from ember.channels.gateway.schemas import ChatCompletionRequest
from ember.channels.gateway.turns import IN_FLIGHT_TEXT, InFlight, TurnRequest, TurnRouter, session_key
from ember.channels.gateway.uploads import Intake, parts_weight
from ember.core.attachments import Attachment
from ember.core.errors import BusUnavailable
from ember.core.events import OutboundEvent, OutboundKind, TurnUsage
from ember.core.messages import Message
from ember.core.sampling import Sampling


class OpenAIApi:
    def __init__(self, router: TurnRouter, metrics: GatewayMetrics, conversations: Conversations, intake: Intake, *,
                 agent_id: str, limits: SamplingLimits = DEFAULT_LIMITS) -> None:
        self._router = router
        self._intake = intake
        self._conversations = conversations
        self._metrics = metrics
        self._agent_id = agent_id
        self._max_body_bytes = intake.max_body_bytes
        self._files = intake.allowance(parts_weight)
        self._limits = limits
        self._created = int(time.time())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        """The default agent, then each named agent: a client picks one as its model."""
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self._created, "owned_by": "ember"}
            for name in (self._agent_id, *sorted(self._router.agents))]})

    async def chat_completions(self, request: Request) -> Response:
        body = await read_json(request, ChatCompletionRequest, self._max_body_bytes, self._files)
        message = await self._message(request, body)
        headers = {SESSION_HEADER: message.key}
        completion = _Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), message.agent or self._agent_id)
        clock = self._metrics.clock("openai")
        if body.stream:
            completion.include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._stream(message, completion, clock)
            return StreamingResponse(stream, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        try:
            async with self._turn(message, stream=False) as queue:
                while (event := await queue.get()).kind not in (OutboundKind.FINAL, OutboundKind.ERROR):
                    pass
        except InFlight as exc:
            raise ApiError(409, IN_FLIGHT_TEXT, code="in_flight") from exc
        if event.kind is OutboundKind.ERROR:
            clock.closed("error")
            raise ApiError(502, event.text, code="turn_failed", headers=headers)
        shown = _with_files(event, message.key)
        await self._answered(message, shown)
        clock.closed("final")
        files = [{**file.to_dict(), "url": _url(file, message.key)} for file in event.attachments]
        return JSONResponse(completion.whole(shown, event.usage, files), headers=headers)

    async def _message(self, request: Request, body: ChatCompletionRequest) -> _Message:
        """The request's new message and where it goes; ApiError for what is wrong with it."""
        last = max((i for i, m in enumerate(body.messages) if m.role == "user"), default=None)
        question = body.messages[last] if last is not None else None
        files = await self._intake.from_parts(question.content, f"messages[{last}]") \
            if question is not None and isinstance(question.content, list) else []
        if question is None or last is None or not (question.text().strip() or files):
            raise ApiError(400, "messages must end with a user message that has text or files", code="no_user_message",
                           param="messages")
        sampling = requested_sampling(body, self._limits)
        identity: str = request.state.identity
        named = self._named_session(request, body)
        client_id = request.headers.get(IDEMPOTENCY_HEADER)
        if client_id is not None:
            checked_client_id(client_id, f"the {IDEMPOTENCY_HEADER} header")
        evaluation = evaluation_requested(request)
        if self._router.in_flight(identity, client_id):
            raise ApiError(409, IN_FLIGHT_TEXT, code="in_flight")
        if named is None:  # the messages before the new one say which conversation it continues
            thread = await self._conversations.thread(identity, conversation(body.messages[:last]))
            key = thread.key
        else:
            thread, key = None, named
        # A model id that names an agent picks it; any other (clients send their own) is the default agent.
        agent = body.model if body.model in self._router.agents else None
        text = await self._intake.heard(question.text(), files)
        attachments = await self._intake.keep(session_key(identity, key), files)
        return _Message(identity, key, text, client_id, question.name, evaluation, sampling, thread, agent, attachments)

    def _named_session(self, request: Request, body: ChatCompletionRequest) -> str | None:
        # The user field is checked even when the header names the session: the document says what it may be.
        user = checked_key(body.user, "the user field") if body.user else None
        if header := request.headers.get(SESSION_HEADER):
            return checked_key(header, f"the {SESSION_HEADER} header")
        return user

    def _turn(self, message: _Message, *, stream: bool) -> AbstractAsyncContextManager[asyncio.Queue[OutboundEvent]]:
        # An OpenAI client cannot answer approval requests: calls that need one are denied.
        return self._router.turn(TurnRequest(
            message.identity, message.key, message.text, stream=stream, can_approve=False,
            client_id=message.client_id, sender_name=message.name, evaluation=message.evaluation,
            sampling=message.sampling, history=message.thread.seed if message.thread else (), agent=message.agent,
            attachments=message.attachments))

    async def _answered(self, message: _Message, shown: str) -> None:
        """Before the client has the answer: its next request, with the answer, finds the session."""
        if message.thread is not None:
            question = Message.user(message.text, name=message.name)
            await self._conversations.answered(message.identity, message.thread, question, shown)

    async def _stream(self, message: _Message, completion: _Completion, clock: TurnClock) -> AsyncIterator[bytes]:
        step = ""  # visible text of the current model step, as streamed
        said: list[str] = []  # every piece of text streamed in this turn
        try:
            async with self._turn(message, stream=True) as queue:
                yield completion.chunk({"role": "assistant", "content": ""})
                while True:
                    event = await next_event(queue, KEEPALIVE_S)
                    if event is None:
                        yield SSE_KEEPALIVE
                    elif event.kind is OutboundKind.DELTA:
                        clock.delta()
                        piece = "\n\n" + event.text if said and not step else event.text
                        step += event.text
                        said.append(piece)
                        yield completion.chunk({"content": piece})
                    elif event.kind is OutboundKind.TOOL_CALL:
                        step = ""
                    elif event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
                        rest = _rest(_with_files(event, message.key), step, bool(said))
                        if event.kind is OutboundKind.FINAL:
                            await self._answered(message, "".join(said) + rest)
                        for part in _closing(event, completion, rest):
                            yield part
                        clock.closed("final" if event.kind is OutboundKind.FINAL else "error")
                        return
        except InFlight:  # a twin request got in between the handler's check and here
            error = {"message": IN_FLIGHT_TEXT, "type": "invalid_request_error", "code": "in_flight", "param": None}
            yield sse(None, {"error": error})
            yield sse(None, "[DONE]")
        except BusUnavailable as exc:  # the message was not handed over: the client sends it again
            yield sse(None, {"error": {"message": str(exc), "type": "server_error", "code": "bus_unavailable",
                                       "param": None}})
            yield sse(None, "[DONE]")
        finally:
            clock.abandoned()


def _rest(text: str, step: str, shown: bool) -> str:
    """What the stream has not yet said of the final `text`, after the current step's `step`.
    Should the draft ever stray from the record, the record follows it whole."""
    return text[len(step):] if text.startswith(step) else ("\n\n" if shown else "") + text


def _url(file: Attachment, key: str) -> str:
    """Where the native API serves an answer's file."""
    return f"/api/sessions/{quote(key, safe='')}/attachments/{file.digest}"


def _with_files(event: OutboundEvent, key: str) -> str:
    """The answer as an OpenAI client shows it: its files named at the end, each with its address."""
    return files_named(event.text, event.attachments, lambda file: f"GET {_url(file, key)}")


def _closing(event: OutboundEvent, completion: _Completion, rest: str) -> list[bytes]:
    if event.kind is OutboundKind.ERROR:
        error = {"message": event.text, "type": "server_error", "code": "turn_failed", "param": None}
        return [sse(None, {"error": error}), sse(None, "[DONE]")]
    parts = [completion.chunk({"content": rest})] if rest else []
    parts.append(completion.chunk({}, finish_reason="stop"))
    if completion.include_usage:  # after the finish, as OpenAI sends it
        parts.append(completion.usage_chunk(event.usage))
    return [*parts, sse(None, "[DONE]")]


@dataclass(frozen=True, slots=True)
class _Message:
    identity: str
    key: str
    text: str
    client_id: str | None
    name: str | None
    evaluation: bool
    sampling: Sampling | None
    thread: Thread | None  # where a request that names no session goes
    agent: str | None = None  # the named agent the request's model names (None: the default agent)
    attachments: tuple[Attachment, ...] = ()  # stored in the session already


class _Completion:
    def __init__(self, completion_id: str, created: int, model: str) -> None:
        self.id = completion_id
        self.created = created
        self.model = model
        self.include_usage = False  # stream_options.include_usage: every chunk says usage, the last one has it

    def chunk(self, delta: dict[str, Any], *, finish_reason: str | None = None) -> bytes:
        return sse(None, {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            **({"usage": None} if self.include_usage else {}),
        })

    def usage_chunk(self, usage: TurnUsage | None) -> bytes:
        return sse(None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                          "model": self.model, "choices": [], "usage": _usage(usage)})

    def whole(self, text: str, usage: TurnUsage | None, files: list[dict[str, Any]]) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, **({"attachments": files} if files else {})}
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": _usage(usage),
        }


def _usage(usage: TurnUsage | None) -> dict[str, Any] | None:
    """The turn's tokens as OpenAI counts them: prompt tokens include the cached ones."""
    if usage is None:
        return None
    prompt = usage.input_tokens + usage.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": usage.output_tokens,
            "total_tokens": prompt + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
