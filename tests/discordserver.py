"""Discord of the tests' own, on 127.0.0.1, on aiohttp in a thread of its own: the HTTP API the bot
calls (its user, messages sent, edited and deleted, interaction callbacks; 429s with
`retry_after` when a test asks, 401 for a wrong token) and the Gateway (zlib-stream compressed
JSON: HELLO, IDENTIFY answered with READY, heartbeats acknowledged, RESUME answered with the
events missed and RESUMED). A test puts messages and button presses on the Gateway, and can drop
the connection to make the bot resume."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web

TOKEN = "MTIz.test-discord-bot-token.0123456789"
BOT_ID, APP_ID, ANA_OWNER = "900000000000000001", "900000000000000002", "900000000000000003"
_ids = itertools.count(1_000_000_000_000_000_000)


def snowflake() -> str:
    return str(next(_ids))


def user(user_id: str, name: str, *, bot: bool = False) -> dict[str, Any]:
    return {"id": user_id, "username": name, "discriminator": "0", "global_name": name, "avatar": None, "bot": bot}


@dataclass
class Shown:
    message_id: str
    channel_id: str
    content: str
    components: list[dict[str, Any]]
    reply_to: str | None
    edits: int = 0
    deleted: bool = False
    file: tuple[str, bytes] | None = None  # an attachment: (its name, its bytes)


@dataclass
class FakeDiscord:
    origin: str = ""
    shown: dict[str, Shown] = field(default_factory=dict)  # by message id, in the order sent
    ephemeral: list[str] = field(default_factory=list)  # what only a button's presser was told
    rate_limits: dict[str, int] = field(default_factory=dict)  # "POST" / "PATCH" -> 429s to answer
    limited: int = 0
    identified: int = 0  # IDENTIFYs seen
    resumed: int = 0  # RESUMEs seen
    _events: list[dict[str, Any]] = field(default_factory=list)  # dispatches, by sequence
    _sockets: list[tuple[web.WebSocketResponse, Any]] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def visible(self, channel_id: str) -> list[Shown]:
        with self._lock:
            return [m for m in self.shown.values() if m.channel_id == channel_id and not m.deleted]

    def texts(self, channel_id: str) -> list[str]:
        return [m.content for m in self.visible(channel_id)]

    def dispatched(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [event["d"] for event in self._events if event["t"] == kind]

    # The test's side: what the Gateway dispatches

    def message(self, text: str, *, author: str, channel_id: str, guild_id: str | None = None,
                mention: bool = False) -> str:
        message_id = snowflake()
        mentions = [user(BOT_ID, "ember", bot=True)] if mention else []
        data = {"id": message_id, "channel_id": channel_id, "author": user(author, f"user{author[-3:]}"),
                "content": f"<@{BOT_ID}> {text}" if mention else text, "timestamp": _now(), "edited_timestamp": None,
                "tts": False, "mention_everyone": False, "mentions": mentions, "mention_roles": [],
                "attachments": [], "embeds": [], "pinned": False, "type": 0, "flags": 0}
        if guild_id:
            data |= {"guild_id": guild_id, "member": {"roles": [], "joined_at": _now(), "deaf": False, "mute": False}}
        self.dispatch("MESSAGE_CREATE", data)
        return message_id

    def press(self, shown: Shown, decision: str, *, by: str) -> None:
        custom_id = next(b["custom_id"] for row in shown.components for b in row["components"]
                         if b["custom_id"].startswith(f"ap:{decision}:"))
        self.dispatch("INTERACTION_CREATE", {
            "id": snowflake(), "application_id": APP_ID, "type": 3, "token": f"itoken{snowflake()}", "version": 1,
            "data": {"custom_id": custom_id, "component_type": 2}, "channel_id": shown.channel_id,
            "channel": {"id": shown.channel_id, "type": 1}, "user": user(by, f"user{by[-3:]}"),
            "message": self._message(shown), "locale": "en-US", "app_permissions": "0", "entitlements": [],
            "authorizing_integration_owners": {}, "context": 1, "attachment_size_limit": 10_485_760})

    def dispatch(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            self._events.append({"op": 0, "t": kind, "d": data, "s": len(self._events) + 1})
            event, sockets = self._events[-1], list(self._sockets)
        for socket, compressor in sockets:
            assert self._loop is not None
            asyncio.run_coroutine_threadsafe(_send(socket, compressor, event), self._loop)

    def drop_connection(self) -> None:
        """Close the Gateway connection as Discord does when it wants a client to resume."""
        with self._lock:
            sockets, self._sockets = list(self._sockets), []
        for socket, _ in sockets:
            assert self._loop is not None
            asyncio.run_coroutine_threadsafe(socket.close(code=4000, message=b"reconnect"), self._loop)

    # The Gateway

    async def _gateway(self, request: web.Request) -> web.WebSocketResponse:
        assert request.query.get("compress") == "zlib-stream", "discord.py asks for zlib-stream"
        socket = web.WebSocketResponse(heartbeat=None)
        await socket.prepare(request)
        compressor = zlib.compressobj()
        await _send(socket, compressor, {"op": 10, "d": {"heartbeat_interval": 41_250}, "s": None, "t": None})
        async for frame in socket:
            if frame.type != aiohttp.WSMsgType.TEXT:
                continue
            payload = json.loads(frame.data)
            op = payload.get("op")
            if op == 1:
                await _send(socket, compressor, {"op": 11, "d": None, "s": None, "t": None})
            elif op == 2:
                await self._identified(socket, compressor, payload["d"])
            elif op == 6:
                await self._resumed(socket, compressor, payload["d"])
        with self._lock:
            self._sockets = [s for s in self._sockets if s[0] is not socket]
        return socket

    async def _identified(self, socket: web.WebSocketResponse, compressor: Any, identify: dict[str, Any]) -> None:
        if identify.get("token") != TOKEN:
            await socket.close(code=4004, message=b"Authentication failed.")
            return
        with self._lock:
            self.identified += 1
            ready = {"op": 0, "t": "READY", "s": len(self._events), "d": {
                "v": 10, "user": user(BOT_ID, "ember", bot=True), "guilds": [], "session_id": "session-1",
                "resume_gateway_url": f"ws://{self.origin.removeprefix('http://')}/gateway",
                "application": {"id": APP_ID, "flags": 0}, "shard": [0, 1]}}
            self._sockets.append((socket, compressor))
        await _send(socket, compressor, ready)

    async def _resumed(self, socket: web.WebSocketResponse, compressor: Any, resume: dict[str, Any]) -> None:
        with self._lock:
            self.resumed += 1
            missed = self._events[int(resume.get("seq") or 0):]
            self._sockets.append((socket, compressor))
        for event in missed:
            await _send(socket, compressor, event)
        await _send(socket, compressor, {"op": 0, "t": "RESUMED", "s": len(self._events), "d": {}})

    # The HTTP API

    async def _api(self, request: web.Request) -> web.Response:
        path, method = request.match_info["path"], request.method
        if path.startswith("interactions/"):  # answered by the interaction's token, not the bot's
            return await self._callback(path.split("/")[1], await request.json())
        if request.headers.get("Authorization") != f"Bot {TOKEN}":
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        if path == "users/@me":
            return _json(user(BOT_ID, "ember", bot=True))
        if path == "oauth2/applications/@me":
            return _json({"id": APP_ID, "name": "Ember", "description": "", "icon": None, "bot_public": True,
                          "bot_require_code_grant": False, "owner": user(ANA_OWNER, "owner"), "verify_key": "0" * 64,
                          "flags": 0, "rpc_origins": [], "team": None})
        with self._lock:
            if self.rate_limits.get(method):
                self.rate_limits[method] -= 1
                self.limited += 1
                return _json({"message": "You are being rate limited.", "retry_after": 0.2,
                                          "global": False}, status=429,
                             headers={"Retry-After": "1", "Via": "1.1 google", "X-RateLimit-Scope": "user"})
        parts = path.split("/")
        if parts[0] == "channels" and len(parts) >= 3 and parts[2] == "messages":
            return await self._messages(request, parts[1], parts[3] if len(parts) > 3 else None)
        return _json({"message": "404: Not Found", "code": 0}, status=404)

    async def _messages(self, request: web.Request, channel_id: str, message_id: str | None) -> web.Response:
        file = None
        if request.content_type == "multipart/form-data":  # a message with files: payload_json and files[n]
            form = await request.post()
            body = json.loads(str(form.get("payload_json") or "{}"))
            upload = form.get("files[0]")
            file = (upload.filename, upload.file.read()) if isinstance(upload, web.FileField) else None
        else:
            body = await request.json() if request.can_read_body else {}
        with self._lock:
            if message_id is None:
                reference = str((body.get("message_reference") or {}).get("message_id") or "") or None
                shown = Shown(snowflake(), channel_id, body.get("content") or "", body.get("components") or [],
                              reference, file=file)
                self.shown[shown.message_id] = shown
                return _json(self._message(shown))
            shown = self.shown.get(message_id)
            if shown is None or shown.deleted:
                return _json({"message": "Unknown Message", "code": 10008}, status=404)
            if request.method == "DELETE":
                shown.deleted = True
                return web.Response(status=204)
            shown.content = body.get("content", shown.content)
            shown.components = body.get("components", shown.components)
            shown.edits += 1
            return _json(self._message(shown))

    async def _callback(self, interaction_id: str, body: dict[str, Any]) -> web.Response:
        """An interaction's answer: 4 a message (ephemeral: only the presser sees it), 7 the pressed one edited."""
        data, kind = body.get("data") or {}, body.get("type")
        with self._lock:
            if kind == 4:
                self.ephemeral.append(data.get("content", ""))
                message = self._message(Shown(snowflake(), "", data.get("content", ""), [], None))
            else:
                card = next(m for m in reversed(self.shown.values()) if m.components)
                card.content, card.components = data.get("content", card.content), data.get("components") or []
                card.edits += 1
                message = self._message(card)
        return _json({"interaction": {"id": interaction_id, "type": 3,
                                                  "response_message_id": message["id"],
                                                  "response_message_ephemeral": kind == 4},
                                  "resource": {"type": kind, "message": message}})

    def _message(self, shown: Shown) -> dict[str, Any]:
        return {"id": shown.message_id, "channel_id": shown.channel_id, "author": user(BOT_ID, "ember", bot=True),
                "content": shown.content, "timestamp": _now(), "edited_timestamp": None, "tts": False,
                "mention_everyone": False, "mentions": [], "mention_roles": [], "attachments": [], "embeds": [],
                "pinned": False, "type": 0, "flags": 0, "components": shown.components}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/gateway", self._gateway)
        app.router.add_route("*", "/api/v10/{path:.*}", self._api)
        return app


async def _send(socket: web.WebSocketResponse, compressor: Any, payload: dict[str, Any]) -> None:
    """One payload of the zlib stream: compressed, flushed to a frame ending in 00 00 ff ff."""
    if not socket.closed:
        await socket.send_bytes(compressor.compress(json.dumps(payload).encode()) + compressor.flush(zlib.Z_SYNC_FLUSH))


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """As Discord answers: `application/json` exactly (discord.py reads JSON only then)."""
    return web.Response(body=json.dumps(data).encode(), status=status, headers=headers,
                        content_type="application/json")


def _now() -> str:
    return datetime.now(UTC).isoformat()


@contextmanager
def serving_discord() -> Iterator[FakeDiscord]:
    fake = FakeDiscord()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-discord", daemon=True)
    thread.start()

    async def serve() -> web.AppRunner:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=10)
    fake._loop, fake.origin = loop, f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
