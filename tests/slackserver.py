"""A Slack Web API of the tests' own, on 127.0.0.1: the methods Ember's channel calls (auth.test,
chat.postMessage, chat.update, chat.delete, chat.postEphemeral; apps.connections.open and Socket
Mode's WebSocket, on aiohttp's server) with Slack's envelopes and errors
(`{"ok": false, "error": ...}`, `message_not_found`, `invalid_auth`, and 429 `ratelimited` with
Retry-After when a test asks for one); and the other side of the Events API: events and button
presses as Slack sends them, signed with the app's signing secret (v0)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlencode

import aiohttp
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.loopback import LoopbackServer, started

TOKEN = "xoxb-test-token-0123456789"
APP_TOKEN = "xapp-1-test-app-token-0123456789"
SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
BOT_USER = "UBOT0001"
_ts = itertools.count(1)


@dataclass
class Posted:
    ts: str
    channel: str
    thread_ts: str | None
    text: str
    blocks: list[dict[str, Any]] | None
    edits: int = 0
    deleted: bool = False


@dataclass
class FakeSlack:
    token: str = TOKEN
    posted: dict[str, Posted] = field(default_factory=dict)
    ephemeral: list[dict[str, Any]] = field(default_factory=list)
    writes: list[tuple[float, str, bool]] = field(default_factory=list)  # (when, method, accepted)
    # method -> Retry-After seconds of the 429s to answer its next calls with
    rate_limits: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    files: dict[str, bytes] = field(default_factory=dict)  # by file id, served at /files-pri/<id>
    # Files the bot uploaded (files.getUploadURLExternal, the upload, files.completeUploadExternal):
    # (channel, thread_ts, name, bytes), once completed.
    uploaded: list[tuple[str, str | None, str, bytes]] = field(default_factory=list)
    origin: str = ""
    _uploads: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # file id -> (name, bytes) sent
    # Socket Mode: the address apps.connections.open gives, the envelopes to send on the socket and
    # the envelope ids the app acknowledged.
    app_token: str = APP_TOKEN
    socket_url: str = ""
    envelopes: list[dict[str, Any]] = field(default_factory=list)
    acked: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def visible(self, channel: str, thread_ts: str | None = None) -> list[str]:
        """The texts a person sees in the conversation (or one thread of it), oldest first."""
        with self._lock:
            return [p.text for p in self.posted.values()
                    if p.channel == channel and p.thread_ts == thread_ts and not p.deleted]

    def cards(self, channel: str) -> list[Posted]:
        with self._lock:
            return [p for p in self.posted.values() if p.channel == channel and p.blocks and not p.deleted]

    async def _api(self, request: Request) -> Response:
        method = request.path_params["method"]
        if method == "apps.connections.open":  # the app-level token's one method
            if request.headers.get("authorization") != f"Bearer {self.app_token}":
                return JSONResponse({"ok": False, "error": "invalid_auth"})
            return _ok(url=self.socket_url)
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return JSONResponse({"ok": False, "error": "invalid_auth"})
        raw = await request.body()
        if request.headers.get("content-type", "").startswith("application/json"):
            params: dict[str, Any] = json.loads(raw or b"{}")
        else:
            params = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
        params = {**request.query_params, **params}  # some methods' arguments come in the query string
        with self._lock:
            return self._call(method, params)

    def _call(self, method: str, params: dict[str, Any]) -> Response:
        if method in ("chat.postMessage", "chat.update") and self.rate_limits[method]:
            retry_after = self.rate_limits[method].pop(0)
            self.writes.append((time.monotonic(), method, False))
            return JSONResponse({"ok": False, "error": "ratelimited"}, status_code=429,
                                headers={"Retry-After": str(retry_after)})
        if method == "auth.test":
            return _ok(user_id=BOT_USER, user="ember", team="Test Team", team_id="T0001")
        if method == "chat.postMessage":
            ts = f"{1_700_000_000 + next(_ts)}.000100"
            blocks = _maybe_json(params.get("blocks"))
            self.posted[ts] = Posted(ts, str(params["channel"]), params.get("thread_ts"), str(params.get("text", "")),
                                     blocks or None)
            self.writes.append((time.monotonic(), method, True))
            return _ok(channel=params["channel"], ts=ts, message={"text": params.get("text", ""), "ts": ts})
        if method == "chat.update":
            posted = self.posted.get(str(params.get("ts")))
            if posted is None or posted.deleted or posted.channel != params.get("channel"):
                return JSONResponse({"ok": False, "error": "message_not_found"})
            posted.text, posted.blocks = str(params.get("text", "")), _maybe_json(params.get("blocks")) or None
            posted.edits += 1
            self.writes.append((time.monotonic(), method, True))
            return _ok(channel=posted.channel, ts=posted.ts, text=posted.text)
        if method == "chat.delete":
            posted = self.posted.get(str(params.get("ts")))
            if posted is None or posted.deleted:
                return JSONResponse({"ok": False, "error": "message_not_found"})
            posted.deleted = True
            return _ok(channel=posted.channel, ts=posted.ts)
        if method == "files.getUploadURLExternal":
            file_id = f"FUP{len(self._uploads) + 1:04d}"
            self._uploads[file_id] = (str(params.get("filename")), b"")
            return _ok(upload_url=f"{self.origin}/upload/{file_id}", file_id=file_id)
        if method == "files.completeUploadExternal":
            for sent in _maybe_json(params.get("files")) or []:
                name, data = self._uploads[sent["id"]]
                if not data:
                    return JSONResponse({"ok": False, "error": "file_upload_not_found"})
                self.uploaded.append((str(params.get("channel_id")), params.get("thread_ts"), name, data))
            return _ok(files=[{"id": f["id"]} for f in _maybe_json(params.get("files")) or []])
        if method == "chat.postEphemeral":
            self.ephemeral.append(params)
            return _ok(message_ts=f"{1_700_000_000 + next(_ts)}.000200")
        return JSONResponse({"ok": False, "error": "unknown_method"}, status_code=404)

    async def _file(self, request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {self.token}":  # Slack's sign-in page, in fact
            return Response(b"<html>sign in</html>", status_code=302, headers={"Location": "https://slack.com/"})
        data = self.files.get(request.path_params["file_id"])
        return Response(data, media_type="application/octet-stream") if data is not None else Response(status_code=404)

    def shared(self, origin: str, data: bytes, name: str, mimetype: str) -> dict[str, Any]:
        """A file as a message event lists it, its bytes served to the bot token."""
        file_id = f"F{len(self.files) + 1:04d}"
        self.files[file_id] = data
        return {"id": file_id, "name": name, "mimetype": mimetype, "size": len(data),
                "url_private_download": f"{origin}/files-pri/{file_id}"}

    def send_on_socket(self, kind: str, payload: dict[str, Any]) -> str:
        """An envelope for the app's socket (events_api, interactive); its id, to wait for its ack."""
        envelope_id = f"env-{next(_ts)}"
        with self._lock:
            self.envelopes.append({"envelope_id": envelope_id, "type": kind, "payload": payload,
                                   "accepts_response_payload": False, "retry_attempt": 0})
        return envelope_id

    async def _socket(self, request: web.Request) -> web.WebSocketResponse:
        """Socket Mode's WebSocket: hello, then each envelope queued; the app's acks are recorded."""
        socket = web.WebSocketResponse(heartbeat=None)
        await socket.prepare(request)
        await socket.send_json({"type": "hello", "num_connections": 1, "debug_info": {"host": "fake"},
                                "connection_info": {"app_id": "A0001"}})

        async def read() -> None:
            async for message in socket:
                if message.type == aiohttp.WSMsgType.TEXT and (envelope_id := json.loads(message.data).get(
                        "envelope_id")):
                    with self._lock:
                        self.acked.append(envelope_id)

        reader = asyncio.ensure_future(read())
        try:
            while not socket.closed:
                with self._lock:
                    ready, self.envelopes = self.envelopes, []
                for envelope in ready:
                    await socket.send_json(envelope)
                await asyncio.sleep(0.02)
        finally:
            reader.cancel()
        return socket

    async def _upload(self, request: Request) -> Response:
        file_id = request.path_params["file_id"]
        with self._lock:
            if file_id not in self._uploads:
                return Response(status_code=404)
            self._uploads[file_id] = (self._uploads[file_id][0], await request.body())
        return Response(b"OK - " + str(len(self._uploads[file_id][1])).encode())

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/api/{method}", self._api, methods=["GET", "POST"]),
                                 Route("/files-pri/{file_id}", self._file, methods=["GET"]),
                                 Route("/upload/{file_id}", self._upload, methods=["POST"])])


def _ok(**fields: Any) -> JSONResponse:
    return JSONResponse({"ok": True, **fields})


def _maybe_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) and value[:1] in "[{" else value


class _SocketServer:
    """The WebSocket half of the fake, on aiohttp's server in a thread of its own."""

    def __init__(self, fake: FakeSlack) -> None:
        self._fake = fake
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-slack-socket", daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)

    async def _serve(self) -> str:
        app = web.Application()
        app.router.add_get("/link", self._fake._socket)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"ws://127.0.0.1:{port}/link"

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@contextmanager
def serving_slack() -> Iterator[tuple[FakeSlack, str]]:
    """The fake Web API (and Socket Mode's WebSocket), and the api_base_url that points a client at it."""
    fake = FakeSlack()
    sockets = _SocketServer(fake)
    with started(LoopbackServer(fake.app(), "fake-slack")) as server:
        fake.origin, fake.socket_url = server.origin, sockets.start()
        try:
            yield fake, f"{server.origin}/api/"
        finally:
            sockets.stop()


# Slack's side of the Events API.

_event_ids = itertools.count(1)


def signed(body: bytes, *, secret: str = SIGNING_SECRET, at: float | None = None) -> dict[str, str]:
    """The headers Slack sends with `body`: its timestamp and v0 signature."""
    timestamp = str(int(time.time() if at is None else at))
    digest = hmac.new(secret.encode(), f"v0:{timestamp}:".encode() + body, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": timestamp, "X-Slack-Signature": f"v0={digest}",
            "Content-Type": "application/json"}


def message_event(text: str, *, user: str, channel: str, direct: bool = True, mention: bool = False,
                  thread_ts: str | None = None) -> dict[str, Any]:
    """An event_callback envelope as Slack sends it: a DM's `message`, or a channel's `app_mention`."""
    ts = f"{1_700_000_000 + next(_ts)}.000300"
    event: dict[str, Any] = {"type": "app_mention" if mention else "message", "user": user, "channel": channel,
                             "text": f"<@{BOT_USER}> {text}" if mention else text, "ts": ts, "event_ts": ts,
                             "channel_type": "im" if direct else "channel"}
    if thread_ts:
        event["thread_ts"] = thread_ts
    return {"type": "event_callback", "team_id": "T0001", "api_app_id": "A0001", "event": event,
            "event_id": f"Ev{next(_event_ids):08d}", "event_time": int(time.time())}


def press(card: Posted, user: str, action: str) -> tuple[bytes, dict[str, str]]:
    """The form Slack posts when `user` presses the card's button `action` (once, session, deny)."""
    button = next(e for block in card.blocks or [] if block["type"] == "actions" for e in block["elements"]
                  if e["action_id"] == f"ap:{action}")
    payload = {"type": "block_actions", "user": {"id": user}, "channel": {"id": card.channel},
               "container": {"type": "message", "message_ts": card.ts, "channel_id": card.channel},
               "message": {"ts": card.ts, "text": card.text},
               "actions": [{"action_id": button["action_id"], "value": button["value"], "type": "button"}]}
    body = urlencode({"payload": json.dumps(payload)}).encode()
    return body, {**signed(body), "Content-Type": "application/x-www-form-urlencoded"}
