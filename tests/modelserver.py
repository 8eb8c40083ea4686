"""A scripted OpenAI-compatible model server speaking real HTTP, for tests.

The test pushes replies; each `POST /v1/chat/completions` takes the next one
and answers it the way OpenAI does: Server-Sent Events of
`chat.completion.chunk` objects (text, reasoning and tool-call fragments, a
finish chunk, a usage chunk, then `[DONE]`) when the request streams, one
`chat.completion` object otherwise. Every request body is recorded, so a test
can assert what history the model saw.

`dialect` answers as a local model server's OpenAI-compatible endpoint does
instead: "ollama" (a role in every delta, its `fp_ollama` fingerprint) or
"llamacpp" (the usage and timings on the finish chunk). With `takes_tools`
False, a request that carries `tools` is refused the way each refuses it: an
Ollama model whose template has no tools (400), llama.cpp without `--jinja` (500).
With an `Embedder`, `POST /v1/embeddings` answers too (floats, or base64 when asked).
`serve_forever` serves it in a process of its own, as the benchmarks do.

    from tests.modelserver import Reply, model_server

    def test_x(model_server):
        model_server.push(Reply(text="hi"))
        ... point a client at model_server.base_url ...
        assert model_server.requests[0]["messages"][-1]["content"] == "hello"
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import socket
import struct
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from ember.runtime.titles import TITLE_INSTRUCTION
from ember.tools.explain import EXPLAIN_INSTRUCTION
from tests.loopback import LoopbackServer, started

MODEL = "test-model"
# Who made the request being answered, when it came under a caller's name (None: at /v1 itself).
CALLER: ContextVar[str | None] = ContextVar("modelserver_caller", default=None)
CANNED_EXPLANATION = json.dumps({"explanation": "It does what the request says, in the workspace.",
                                 "risk": "medium", "reason": "changes a file"})
# Small enough that tags and words are cut across chunks, as real streams do.
CHUNK_CHARS = 4
ARGUMENT_FRAGMENTS = 3
_WORD = re.compile(r"\w+", re.UNICODE)


# What the speech route's audio starts with: an Ogg page's capture pattern, as a real Opus file's does.
SPOKEN_PREFIX = b"OggS\x00\x02" + bytes(22)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """One scripted answer of the model.

    `status` answers that HTTP error instead, with `error_code` and
    `error_message` in its OpenAI-shaped body (defaults: the status, "scripted
    HTTP <status>") and `retry_after` as its Retry-After header. `cut_after_chunks` drops the
    connection after that many stream events. `chunk_delay_s` pauses after
    each stream event, to make a slow stream. `hold` keeps the answer back until
    the test sets the event (or `hold_timeout_s` passes): a model call the caller
    is stuck in while the test kills or pauses it.
    """

    text: str = ""
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, arguments as JSON text)
    reasoning: str | None = None
    status: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    retry_after: str | None = None
    cut_after_chunks: int | None = None
    chunk_delay_s: float = 0.0
    # Sent as they are instead of the reply's chunks: for servers that break the protocol.
    raw_events: tuple[str, ...] = ()
    hold: threading.Event | None = None
    hold_timeout_s: float = 60.0
    delay_s: float = 0.0  # before the answer starts, as a model takes a while to read its prompt
    # As the crash harness answers: the text streamed in these pieces (else CHUNK_CHARS each), the
    # calls under these ids (else call_<request>_<index>), `pause()` seconds after each event that
    # carries text or a call, and `watch` told ("chunk", n) once the n-th text piece is sent and
    # ("done", 0) once the stream has ended.
    pieces: tuple[str, ...] | None = None
    call_ids: tuple[str, ...] = ()
    pause: Callable[[], float] | None = None
    watch: Callable[[str, int], None] | None = None


def hashed_vector(text: str, dims: int = 384) -> list[float]:
    """Feature hashing: each word adds +-1 at a position its crc32 picks; unit length. Texts that share
    words come out close, as a real embedding model's would."""
    vector = [0.0] * dims
    for word in _WORD.findall(text.lower()):
        h = zlib.crc32(word.encode())
        vector[h % dims] += 1.0 if h & 0x80000000 else -1.0
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


@dataclass(frozen=True, slots=True)
class Embedder:
    """What answers `POST /v1/embeddings`: `vector` for each input text; `model` is listed at /v1/models."""

    model: str = "test-embed"
    vector: Callable[[str], list[float]] = hashed_vector


def tool_call(name: str, **arguments: Any) -> tuple[str, str]:
    return name, json.dumps(arguments)


class _ConnectionCut(Exception):
    """Raised inside a stream to make the server drop the connection mid-response."""


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _split(text: str, parts: int) -> list[str]:
    size = max(1, -(-len(text) // parts))
    return _pieces(text, size) or [""]


def _call_id(reply: Reply, request_number: int, index: int) -> str:
    return reply.call_ids[index] if index < len(reply.call_ids) else f"call_{request_number}_{index}"


def _usage(body: dict[str, Any], reply: Reply) -> dict[str, int]:
    prompt = sum(len(str(m.get("content") or "").split()) for m in body.get("messages", []))
    completion = len(reply.text.split()) + len(reply.tool_calls)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _deltas(reply: Reply, request_number: int) -> Iterator[dict[str, Any]]:
    for piece in _pieces(reply.reasoning or "", CHUNK_CHARS):
        yield {"reasoning_content": piece}
    for piece in reply.pieces if reply.pieces is not None else _pieces(reply.text, CHUNK_CHARS):
        yield {"content": piece}
    for index, (name, arguments) in enumerate(reply.tool_calls):
        # The first fragment names the call; the arguments follow in pieces.
        yield {"tool_calls": [{"index": index, "id": _call_id(reply, request_number, index), "type": "function",
                               "function": {"name": name, "arguments": ""}}]}
        for piece in _split(arguments, ARGUMENT_FRAGMENTS):
            yield {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


def stream_chunks(reply: Reply, body: dict[str, Any], request_number: int,
                  dialect: str = "openai") -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects OpenAI (or the server `dialect` names) would send for `reply`."""
    head = {"id": f"chatcmpl-{request_number}", "object": "chat.completion.chunk", "created": 0,
            "model": body.get("model", MODEL), **_FINGERPRINTS.get(dialect, {})}
    role = {"role": "assistant"} if dialect == "ollama" else {}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{**head, "choices": [{"index": 0, "delta": {**role, **delta}}]}
               for delta in _deltas(reply, request_number)]
    finish = {**head, "choices": [{"index": 0, "delta": {**role}, "finish_reason":
                                   "tool_calls" if reply.tool_calls else "stop"}]}
    chunks.append(finish)
    if dialect == "llamacpp":
        finish |= {"usage": _usage(body, reply), "timings": {"prompt_n": 1, "predicted_n": 1}}
    elif (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": _usage(body, reply)})
    return chunks


_FINGERPRINTS = {"ollama": {"system_fingerprint": "fp_ollama"}, "llamacpp": {"system_fingerprint": "b6000-test"}}


def tools_refused(dialect: str, model: str) -> JSONResponse:
    """How a server without tool support answers a request that carries `tools`."""
    if dialect == "llamacpp":
        return JSONResponse({"error": {"code": 500, "message": "tools param requires --jinja flag",
                                       "type": "server_error"}}, status_code=500)
    return JSONResponse({"error": {"message": f"registry.ollama.ai/library/{model}:latest does not support tools",
                                   "type": "api_error", "param": None, "code": None}}, status_code=400)


def completion(reply: Reply, body: dict[str, Any], request_number: int) -> dict[str, Any]:
    """The `chat.completion` object OpenAI would answer for `reply` without streaming."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": _call_id(reply, request_number, i), "type": "function",
             "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(reply.tool_calls)
        ]
    return {
        "id": f"chatcmpl-{request_number}", "object": "chat.completion", "created": 0,
        "model": body.get("model", MODEL),
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if reply.tool_calls else "stop"}],
        "usage": _usage(body, reply),
    }


def _error(status: int, message: str, code: str | int | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "test_error", "code": code or status}},
                        status_code=status, headers=headers)


class ModelServer:
    """Serves scripted replies on 127.0.0.1 from a background thread.

    `counts` tallies what was asked: "chat" (every chat completion request), "embedding_requests",
    "embedded_texts" and "embedded_chars". With `record` False, no request body and no per-reply
    chunk count is kept: a long benchmark run would hold them all.
    """

    def __init__(self, model: str = MODEL, *, dialect: str = "openai", takes_tools: bool = True,
                 embedder: Embedder | None = None, record: bool = True) -> None:
        self.model = model
        self.dialect = dialect
        self.takes_tools = takes_tools
        self.embedder = embedder
        self.record = record
        self.counts: Counter[str] = Counter()
        self.refused: list[dict[str, Any]] = []  # requests refused for their tools
        self.requests: list[dict[str, Any]] = []
        self.chunks_sent = 0
        self.chunks_by_reply: dict[int, int] = {}  # id(reply) -> its chunks sent: one answer's, whatever else streams
        self._counted: dict[int, Reply] = {}  # kept alive, so that no later reply takes a counted one's id
        # Answers requests when no scripted reply is queued (for many concurrent clients).
        self.responder: Callable[[dict[str, Any]], Reply] | None = None
        # Answers the approval model's requests, kept out of `requests` and the script (None: scripted too).
        self.explainer: Callable[[dict[str, Any]], Reply] | None = lambda body: Reply(text=CANNED_EXPLANATION)
        self.explained: list[dict[str, Any]] = []
        # Answers the background model's requests for a session title, kept out of `requests` and the
        # script like the explanations (None: scripted too). By default no title: sessions keep their
        # first words, which tests read.
        self.titler: Callable[[dict[str, Any]], Reply] | None = lambda body: Reply(text="")
        self.titled: list[dict[str, Any]] = []
        self._script: deque[Reply] = deque()
        # What `POST /v1/audio/transcriptions` hears (None: it answers 400, as for a file it cannot
        # decode), and the (file name, content type, size, model) of each file sent to it.
        self.transcript: str | None = "(transcribed)"
        self.transcribed: list[tuple[str, str, int, str]] = []
        # What `POST /v1/audio/speech` was asked to say: (model, voice, input, response_format) each;
        # `speech_fails` answers a 500 instead.
        self.spoken: list[tuple[str, str, str, str]] = []
        self.speech_fails = False
        embeddings = [Route("/v1/embeddings", self._embeddings, methods=["POST"])] if embedder else []
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/audio/transcriptions", self._transcription, methods=["POST"]),
            Route("/v1/audio/speech", self._speech, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            *embeddings,
            # The same under a caller's name (`<origin>/<caller>/v1`): a responder reads it as CALLER.
            Route("/{caller}/v1/chat/completions", self._named_chat, methods=["POST"]),
            Route("/{caller}/v1/models", self._models, methods=["GET"]),
        ])
        self._server = LoopbackServer(self.app, "model server")

    @property
    def origin(self) -> str:
        return self._server.origin

    async def _transcription(self, request: Request) -> Response:
        """OpenAI's speech to text: a multipart form with `file` and `model`; `{"text": ...}`."""
        async with request.form() as form:
            upload, model = form.get("file"), form.get("model")
            if not hasattr(upload, "read") or not isinstance(model, str):
                return _invalid("file and model are required", None)
            data = await upload.read()
            self.transcribed.append((upload.filename or "", upload.content_type or "", len(data), model))
        if self.transcript is None:
            return _invalid("Audio file could not be decoded", "invalid_value")
        return JSONResponse({"text": self.transcript})

    async def _speech(self, request: Request) -> Response:
        """OpenAI's text to speech: JSON with model, voice and input; the audio's bytes (here an Ogg
        stream's first page and the text, which a test reads back from the file sent)."""
        body = await request.json()
        if not all(isinstance(body.get(name), str) for name in ("model", "voice", "input")):
            return _invalid("model, voice and input are required", None)
        if self.speech_fails:
            return JSONResponse({"error": {"message": "speech engine down", "type": "server_error"}}, status_code=500)
        self.spoken.append((body["model"], body["voice"], body["input"], body.get("response_format", "mp3")))
        return Response(SPOKEN_PREFIX + body["input"].encode(), media_type="audio/ogg")

    @property
    def base_url(self) -> str:
        return f"{self._server.origin}/v1"

    def push(self, *replies: Reply) -> None:
        self._script.extend(replies)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    async def _named_chat(self, request: Request) -> Response:
        CALLER.set(request.path_params["caller"])
        return await self._chat(request)

    async def _chat(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:  # the caller was killed while it sent its request
            return Response(status_code=499)
        self.counts["chat"] += 1
        messages = body.get("messages") or [{}]
        if self.explainer is not None and EXPLAIN_INSTRUCTION in str(messages[0].get("content")):
            # An approval request being explained (tools/explain.py): answered apart from the script.
            self.explained.append(body)
            reply = self.explainer(body)
            chunks = stream_chunks(reply, body, len(self.explained))
            return StreamingResponse(self._events(chunks, reply), media_type="text/event-stream")
        if self.titler is not None and TITLE_INSTRUCTION in str(messages[0].get("content")):
            self.titled.append(body)
            reply = self.titler(body)
            chunks = stream_chunks(reply, body, len(self.titled))
            return StreamingResponse(self._events(chunks, reply), media_type="text/event-stream")
        if body.get("tools") and not self.takes_tools:
            self.refused.append(body)
            return tools_refused(self.dialect, self.model)
        if self.record:
            self.requests.append(body)
        number = len(self.requests) if self.record else self.counts["chat"]
        if not self._script and self.responder is not None:
            self._script.append(self.responder(body))
        if not self._script:
            return _error(500, f"modelserver: no scripted reply left for request #{number}; "
                               "the test must push() one reply per model call")
        reply = self._script.popleft()
        if reply.hold is not None:
            deadline = time.monotonic() + reply.hold_timeout_s
            while not reply.hold.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.status is not None:
            return _error(reply.status, reply.error_message or f"scripted HTTP {reply.status}", reply.error_code,
                          {"Retry-After": reply.retry_after} if reply.retry_after else None)
        if reply.raw_events:
            return StreamingResponse(iter(reply.raw_events), media_type="text/event-stream")
        if body.get("stream"):
            return StreamingResponse(self._events(stream_chunks(reply, body, number, self.dialect), reply),
                                     media_type="text/event-stream")
        return JSONResponse(completion(reply, body, number))

    async def _events(self, chunks: list[dict[str, Any]], reply: Reply) -> AsyncIterator[str]:
        pieces = 0
        for sent, chunk in enumerate(chunks):
            if sent == reply.cut_after_chunks:
                raise _ConnectionCut(f"scripted cut after {sent} chunks")
            yield f"data: {json.dumps(chunk)}\n\n"
            self.chunks_sent += 1
            if self.record:
                self._counted[id(reply)] = reply
                self.chunks_by_reply[id(reply)] = self.chunks_by_reply.get(id(reply), 0) + 1
            delta = chunk["choices"][0].get("delta", {}) if chunk["choices"] else {}
            if delta.get("content") and reply.watch is not None:
                pieces += 1
                reply.watch("chunk", pieces)
            if reply.pause is not None and (delta.get("content") or delta.get("tool_calls")):
                await asyncio.sleep(reply.pause())
            elif reply.chunk_delay_s:
                await asyncio.sleep(reply.chunk_delay_s)
        yield "data: [DONE]\n\n"
        if reply.watch is not None:
            reply.watch("done", 0)

    async def _models(self, request: Request) -> Response:
        names = [self.model] + ([self.embedder.model] if self.embedder else [])
        return JSONResponse({"object": "list",
                             "data": [{"id": n, "object": "model", "created": 0, "owned_by": "tests"} for n in names]})

    async def _embeddings(self, request: Request) -> Response:
        assert self.embedder is not None  # the route exists only with one
        body = await request.json()
        given = body.get("input")
        texts = [given] if isinstance(given, str) else list(given or [])
        self.counts["embedding_requests"] += 1
        self.counts["embedded_texts"] += len(texts)
        self.counts["embedded_chars"] += sum(len(str(t)) for t in texts)
        data = []
        for index, text in enumerate(texts):
            # A list of token ids stands for its text: hashed alike.
            vector = self.embedder.vector(text if isinstance(text, str) else " ".join(map(str, text)))
            encoded: Any = (base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
                            if body.get("encoding_format") == "base64" else vector)
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        tokens = sum(len(str(t).split()) for t in texts)
        return JSONResponse({"object": "list", "data": data, "model": body.get("model") or self.embedder.model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def serving(model: str = MODEL, **options: Any) -> AbstractContextManager[ModelServer]:
    return started(ModelServer(model, **options))


def serve_forever(app: ASGIApp, port_file: Path, *, backlog: int = 2048, keep_alive_s: int = 60) -> None:
    """Serves `app` (a ModelServer's, or one with its routes) on a free 127.0.0.1 port in this process
    until SIGINT or SIGTERM, writing the port to `port_file` once the socket listens. Keep-alive outlasts
    the clients' idle pools: after a pause they find no closed connection to trip on."""
    # IPPROTO_TCP named: see LoopbackServer (TCP_NODELAY on accepted sockets).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    port_file.write_text(str(sock.getsockname()[1]))
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", backlog=backlog,
                            timeout_keep_alive=keep_alive_s)
    uvicorn.Server(config).run(sockets=[sock])


@pytest.fixture
def model_server() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


def _invalid(message: str, code: str | None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code, "param": "file"}},
                        status_code=400)
