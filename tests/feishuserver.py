"""Feishu of the tests' own, on 127.0.0.1: the Open API's tenant access token, the bot's info, and
messages as interactive cards (sent to a chat, replied to a message, updated in place, recalled),
images and files uploaded and sent,
with Feishu's `{"code", "msg", "data"}` answers, 429 with `x-ogw-ratelimit-reset` when a test asks,
and 99991663 for a wrong token; and the other side of event subscription: a message or a card's
button press as Feishu posts it, encrypted with the Encrypt Key (AES-256-CBC) and signed, or as it
pushes it on the long connection: pbbp2 frames, each sent again on a new connection until it is
acknowledged, pings answered by pongs that carry the client settings."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.loopback import LoopbackServer, started

APP_ID, APP_SECRET = "cli_test0123456789", "feishu-test-secret-0123456789"
VERIFICATION_TOKEN, ENCRYPT_KEY = "feishu-verification-token", "feishu-encrypt-key-0123"
BOT = "ou_bot000000000000"
SERVICE_ID = 77
# What the endpoint and each pong tell the client: no pause before connecting again, a ping a second.
CLIENT_CONFIG = {"ReconnectCount": -1, "ReconnectInterval": 1, "ReconnectNonce": 0, "PingInterval": 1}
_ids = itertools.count(1)


@dataclass
class Card:
    message_id: str
    chat_id: str
    text: str  # its markdown
    buttons: list[dict[str, Any]]
    reply_to: str | None
    updates: int = 0
    recalled: bool = False
    kind: str = "interactive"  # or image, file, audio: then `file` is what was uploaded for it
    file: tuple[str, bytes] | None = None


@dataclass
class FakeFeishu:
    origin: str = ""
    cards: dict[str, Card] = field(default_factory=dict)  # by message id, in the order sent
    # "send" / "update" -> how many of its next calls get a 429
    rate_limits: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    limited: int = 0  # 429s answered
    uploads: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # image_key / file_key -> (name, bytes)
    _chat_of: dict[str, str] = field(default_factory=dict)  # a person's message id -> its chat
    file_types: list[str] = field(default_factory=list)  # the file_type of each file uploaded
    _token: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # The long connection: the data frames pushed (message id, bytes), the client's answers to them
    # (message id -> its JSON), pings heard, connections opened, and whether to drop the current one.
    frames: list[tuple[str, bytes]] = field(default_factory=list)
    acks: dict[str, dict[str, Any]] = field(default_factory=dict)
    pings: int = 0
    connections: int = 0
    dropping: bool = False

    def visible(self, chat_id: str) -> list[Card]:
        with self._lock:
            return [c for c in self.cards.values() if c.chat_id == chat_id and not c.recalled]

    def texts(self, chat_id: str) -> list[str]:
        return [c.text for c in self.visible(chat_id)]

    # The events Feishu posts

    def message(self, text: str, *, sender: str, chat_id: str, group: bool = False, mention_bot: bool = False,
                message_id: str | None = None) -> dict[str, Any]:
        mentions = [{"key": "@_user_1", "id": {"open_id": BOT}, "name": "Ember"}] if mention_bot else []
        shown = f"@_user_1 {text}" if mention_bot else text
        message_id = message_id or f"om_{next(_ids)}"
        self._chat_of[message_id] = chat_id
        return self._event("im.message.receive_v1", {
            "sender": {"sender_id": {"open_id": sender}, "sender_type": "user"},
            "message": {"message_id": message_id, "chat_id": chat_id,
                        "chat_type": "group" if group else "p2p", "message_type": "text",
                        "content": json.dumps({"text": shown}), "mentions": mentions}})

    def press(self, card: Card, decision: str, *, by: str) -> dict[str, Any]:
        value = next(b["value"] for b in card.buttons if b["value"]["decision"] == decision)
        return self._event("card.action.trigger", {
            "operator": {"open_id": by}, "action": {"tag": "button", "value": value},
            "context": {"open_message_id": card.message_id, "open_chat_id": card.chat_id}})

    def _event(self, kind: str, event: dict[str, Any]) -> dict[str, Any]:
        return {"schema": "2.0", "header": {"event_id": f"ev_{next(_ids)}", "event_type": kind,
                                            "create_time": str(int(time.time() * 1000)), "token": VERIFICATION_TOKEN,
                                            "app_id": APP_ID, "tenant_key": "tenant"}, "event": event}

    def push(self, event: dict[str, Any], *, parts: int = 1) -> str:
        """`event` on the long connection, split in `parts` frames; the message id it is acknowledged by."""
        message_id, payload = f"msg_{next(_ids)}", json.dumps(event).encode()
        size = -(-len(payload) // parts)
        with self._lock:
            for seq in range(parts):
                headers = {"type": "event", "message_id": message_id, "sum": str(parts), "seq": str(seq),
                           "trace_id": f"trace_{message_id}"}
                self.frames.append((message_id, frame_bytes(DATA, headers, payload[seq * size:(seq + 1) * size])))
        return message_id

    async def _endpoint(self, request: Request) -> Response:
        body = await request.json()
        if body.get("AppID") != APP_ID or body.get("AppSecret") != APP_SECRET:
            return JSONResponse({"code": 10014, "msg": "app secret invalid"})
        with self._lock:
            device = f"d{self.connections + 1}"
        return JSONResponse({"code": 0, "msg": "ok", "data": {
            "URL": f"{self.origin.replace('http', 'ws')}/ws?device_id={device}&service_id={SERVICE_ID}",
            "ClientConfig": CLIENT_CONFIG}})

    async def _socket(self, socket: WebSocket) -> None:
        """Sends each frame of an event not yet acknowledged, answers pings, reads acknowledgements."""
        await socket.accept()
        with self._lock:
            self.connections += 1
            self.dropping = False
            sent: set[bytes] = {data for message_id, data in self.frames if message_id in self.acks}

        async def read() -> None:
            while True:
                frame = frame_fields(await socket.receive_bytes())
                if frame["method"] == CONTROL and frame["headers"].get("type") == "ping":
                    with self._lock:
                        self.pings += 1
                    await socket.send_bytes(frame_bytes(CONTROL, {"type": "pong"}, json.dumps(CLIENT_CONFIG).encode()))
                elif frame["method"] == DATA:
                    with self._lock:
                        self.acks[frame["headers"]["message_id"]] = json.loads(frame["payload"])

        reader = asyncio.ensure_future(read())
        try:
            while not reader.done() and not self.dropping:
                with self._lock:
                    unsent = [data for _, data in self.frames if data not in sent]
                for data in unsent:
                    sent.add(data)
                    await socket.send_bytes(data)
                await asyncio.sleep(0.02)
            await socket.close()
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            reader.cancel()

    # The Open API

    async def _token_route(self, request: Request) -> Response:
        body = await request.json()
        if body.get("app_id") != APP_ID or body.get("app_secret") != APP_SECRET:
            return JSONResponse({"code": 10014, "msg": "app secret invalid"})
        self._token = f"t-{next(_ids)}"
        return JSONResponse({"code": 0, "msg": "ok", "tenant_access_token": self._token, "expire": 7200})

    def _authorized(self, request: Request) -> bool:
        return bool(self._token) and request.headers.get("Authorization") == f"Bearer {self._token}"

    async def _bot_info(self, request: Request) -> Response:
        return JSONResponse({"code": 0, "msg": "ok", "bot": {"open_id": BOT, "app_name": "Ember"}})

    async def _messages(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"code": 99991663, "msg": "Invalid access token"}, status_code=400)
        with self._lock:
            kind = "update" if request.method == "PATCH" else "send" if request.method == "POST" else "recall"
            if self.rate_limits[kind]:
                self.rate_limits[kind] -= 1
                self.limited += 1
                return JSONResponse({"code": 99991400, "msg": "request trigger frequency limit"}, status_code=429,
                                    headers={"x-ogw-ratelimit-reset": "1"})
        body = await request.json() if request.method != "DELETE" else {}
        message_id = request.path_params.get("message_id")
        with self._lock:
            if request.method == "DELETE":
                self.cards[message_id].recalled = True
                return JSONResponse({"code": 0, "msg": "success", "data": {}})
            if request.method == "PATCH":
                shown = self.cards.get(message_id)
                if shown is None or shown.recalled:
                    return JSONResponse({"code": 230011, "msg": "The message was withdrawn."}, status_code=400)
                shown.text, shown.buttons = _card(body["content"])
                shown.updates += 1
                return JSONResponse({"code": 0, "msg": "success", "data": {}})
            chat_id = body.get("receive_id") or next((c.chat_id for c in self.cards.values()), "")
            if message_id is not None:  # a reply: in the chat of the message it answers
                chat_id = self._chat_of.get(message_id, chat_id)
            kind = body.get("msg_type", "interactive")
            if kind == "interactive":
                text, buttons, file = *_card(body["content"]), None
            else:
                content = json.loads(body["content"])
                text, buttons, file = "", [], self.uploads[content.get("image_key") or content["file_key"]]
            shown = Card(f"om_bot{next(_ids)}", chat_id, text, buttons, message_id, kind=kind, file=file)
            self.cards[shown.message_id] = shown
            return JSONResponse({"code": 0, "msg": "success", "data": {"message_id": shown.message_id,
                                                                       "chat_id": chat_id}})

    async def _upload(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"code": 99991663, "msg": "Invalid access token"}, status_code=400)
        image = request.url.path.endswith("/images")
        async with request.form() as form:
            upload = form.get("image" if image else "file")
            if upload is None or isinstance(upload, str):
                return JSONResponse({"code": 234001, "msg": "Invalid request param."}, status_code=400)
            data = await upload.read()
            if not image:
                self.file_types.append(str(form.get("file_type")))
        key = f"{'img' if image else 'file'}_v2_{next(_ids)}"
        self.uploads[key] = (upload.filename or "", data)
        return JSONResponse({"code": 0, "msg": "success", "data": {"image_key" if image else "file_key": key}})

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/callback/ws/endpoint", self._endpoint, methods=["POST"]),
            WebSocketRoute("/ws", self._socket),
            Route("/open-apis/auth/v3/tenant_access_token/internal", self._token_route, methods=["POST"]),
            Route("/open-apis/bot/v3/info", self._bot_info, methods=["GET"]),
            Route("/open-apis/im/v1/images", self._upload, methods=["POST"]),
            Route("/open-apis/im/v1/files", self._upload, methods=["POST"]),
            Route("/open-apis/im/v1/messages", self._messages, methods=["POST"]),
            Route("/open-apis/im/v1/messages/{message_id}/reply", self._messages, methods=["POST"]),
            Route("/open-apis/im/v1/messages/{message_id}", self._messages, methods=["PATCH", "DELETE"]),
        ])


def _card(content: str) -> tuple[str, list[dict[str, Any]]]:
    elements = json.loads(content)["elements"]
    text = "".join(e["content"] for e in elements if e["tag"] == "markdown")
    buttons = [b for e in elements if e["tag"] == "action" for b in e["actions"]]
    return text, buttons


# The long connection's frames, written and read by hand from the pbbp2.proto Feishu's SDKs declare
# (Frame: 1 SeqID, 2 LogID, 3 service, 4 method varints; 5 headers {1 key, 2 value}; 8 payload), so
# that they check the frames Ember builds with the protobuf runtime rather than share its code.
CONTROL, DATA = 0, 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def frame_bytes(method: int, headers: dict[str, str], payload: bytes = b"") -> bytes:
    pairs = b"".join(_field(5, _field(1, k.encode()) + _field(2, v.encode())) for k, v in headers.items())
    return _field(1, 0) + _field(2, 0) + _field(3, SERVICE_ID) + _field(4, method) + pairs + _field(8, payload)


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    at = 0

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while at < len(data):
        key = varint()
        if key & 7 == 0:
            yield key >> 3, varint()
        else:
            assert key & 7 == 2, f"wire type {key & 7} is not in pbbp2"
            size = varint()
            yield key >> 3, data[at:at + size]
            at += size


def frame_fields(data: bytes) -> dict[str, Any]:
    frame: dict[str, Any] = {"headers": {}, "payload": b""}
    for number, value in _fields(data):
        if number == 5:
            pair = dict(_fields(value))  # type: ignore[arg-type]
            frame["headers"][pair[1].decode()] = pair[2].decode()
        else:
            frame[{1: "SeqID", 2: "LogID", 3: "service", 4: "method", 8: "payload"}.get(number, str(number))] = value
    return frame


def encrypted(event: dict[str, Any], key: str = ENCRYPT_KEY) -> bytes:
    """The body Feishu posts for `event` with an Encrypt Key set."""
    padder = padding.PKCS7(128).padder()
    plain = padder.update(json.dumps(event).encode()) + padder.finalize()
    iv = os.urandom(16)
    encryptor = Cipher(algorithms.AES(hashlib.sha256(key.encode()).digest()), modes.CBC(iv)).encryptor()
    return json.dumps({"encrypt": base64.b64encode(iv + encryptor.update(plain) + encryptor.finalize()).decode()
                       }).encode()


def signed(body: bytes, key: str = ENCRYPT_KEY) -> dict[str, str]:
    timestamp, nonce = str(int(time.time())), f"n{next(_ids)}"
    return {"X-Lark-Request-Timestamp": timestamp, "X-Lark-Request-Nonce": nonce,
            "X-Lark-Signature": hashlib.sha256((timestamp + nonce + key).encode() + body).hexdigest(),
            "Content-Type": "application/json"}


@contextmanager
def serving_feishu() -> Iterator[FakeFeishu]:
    fake = FakeFeishu()
    with started(LoopbackServer(fake.app(), "Feishu")) as server:
        fake.origin = server.origin
        yield fake
