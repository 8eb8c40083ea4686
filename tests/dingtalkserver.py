"""DingTalk of the tests' own, on 127.0.0.1: a conversation's session webhook
(`/robot/sendBySession?session=…`, DingTalk's `{"errcode", "errmsg"}` answers, 130101 "send too
fast" when a test asks), the OpenAPI's access token, robot messages (oToMessages/batchSend,
groupMessages/send; 429 when a test asks, 401 for a wrong token; markdown, or a picture or document
named by the media_id the older API's media/upload gave) and files (messageFiles/download, then the
file's one-time address); and the other side of the callbacks: a message as DingTalk posts it,
signed with the app secret."""

from __future__ import annotations

import asyncio
import base64
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

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.loopback import LoopbackServer, started

APP_KEY = "dingtestappkey0001"
APP_SECRET = "dingtalk-test-secret-0123456789abcdef"
_ids = itertools.count(1)


@dataclass
class FakeDingTalk:
    origin: str = ""
    # (chat id, how: "webhook" or "openapi", markdown text) of every message shown, in order
    shown: list[tuple[str, str, str]] = field(default_factory=list)
    # "webhook" / "openapi" -> the codes of the refusals to answer its next calls with
    refusals: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    files: dict[str, bytes] = field(default_factory=dict)  # downloadCode -> the file's bytes
    # (chat id, msgKey, (name, bytes)) of every picture or document a robot message sent
    sent_files: list[tuple[str, str, tuple[str, bytes]]] = field(default_factory=list)
    _uploads: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # media_id -> name, bytes
    # Stream mode: the frames to put on the app's WebSocket (each robot message is sent again on
    # every new connection until acknowledged), the acknowledgements by message id, the connections.
    frames: list[dict[str, Any]] = field(default_factory=list)
    acks: dict[str, dict[str, Any]] = field(default_factory=dict)
    connections: int = 0
    _sessions: dict[str, str] = field(default_factory=dict)  # session -> chat id
    _tokens: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def texts(self, chat_id: str) -> list[str]:
        with self._lock:
            return [text for chat, _, text in self.shown if chat == chat_id]

    def ways(self, chat_id: str) -> list[str]:
        with self._lock:
            return [how for chat, how, _ in self.shown if chat == chat_id]

    def message(self, text: str, *, sender: str, group: str | None = None, nick: str = "Ana",
                expires_in_s: float = 5_400) -> dict[str, Any]:
        """A callback's body as DingTalk posts it, with a fresh session webhook for its conversation."""
        chat_id = f"group:{group}" if group else f"user:{sender}"
        session = f"s{next(_ids)}"
        with self._lock:
            self._sessions[session] = chat_id
        return {"msgtype": "text", "text": {"content": text}, "msgId": f"msg{next(_ids)}", "createAt": 0,
                "conversationType": "2" if group else "1", "conversationId": group or f"cid-{sender}",
                "senderStaffId": sender, "senderId": f"$:{sender}", "senderNick": nick, "robotCode": APP_KEY,
                "isInAtList": bool(group), "chatbotUserId": "$:bot",
                "sessionWebhook": f"{self.origin}/robot/sendBySession?session={session}",
                "sessionWebhookExpiredTime": int((time.time() + expires_in_s) * 1000)}

    def file_message(self, data: bytes, *, sender: str, kind: str = "picture", file_name: str | None = None
                     ) -> dict[str, Any]:
        """A picture or file message, its bytes downloadable by its downloadCode."""
        code = f"dc{next(_ids)}"
        self.files[code] = data
        message = self.message("", sender=sender)
        del message["text"]
        content: dict[str, Any] = {"downloadCode": code, **({"fileName": file_name} if file_name else {})}
        return {**message, "msgtype": kind, "content": content}

    async def _download(self, request: Request) -> Response:
        if request.headers.get("x-acs-dingtalk-access-token") not in self._tokens:
            return JSONResponse({"code": "InvalidAuthentication", "message": "不合法的access_token"}, status_code=401)
        body = await request.json()
        if body.get("downloadCode") not in self.files or body.get("robotCode") != APP_KEY:
            return JSONResponse({"code": "invalidParameter", "message": "downloadCode无效"}, status_code=400)
        return JSONResponse({"downloadUrl": f"{self.origin}/files/{body['downloadCode']}"})

    async def _file(self, request: Request) -> Response:
        data = self.files.get(request.path_params["code"])
        return Response(data, media_type="application/octet-stream") if data is not None else Response(status_code=404)

    async def _webhook(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            chat_id = self._sessions.get(request.query_params.get("session", ""))
            if chat_id is None:
                return JSONResponse({"errcode": 300001, "errmsg": "session不存在"})
            if self.refusals["webhook"]:
                code = self.refusals["webhook"].pop(0)
                return JSONResponse({"errcode": code, "errmsg": "send too fast"})
            self.shown.append((chat_id, "webhook", body["markdown"]["text"]))
        return JSONResponse({"errcode": 0, "errmsg": "ok"})

    async def _token(self, request: Request) -> Response:
        body = await request.json()
        if body.get("appKey") != APP_KEY or body.get("appSecret") != APP_SECRET:
            return JSONResponse({"code": "invalidClientIdOrSecret", "message": "无效的clientId或者clientSecret"},
                                status_code=400)
        token = f"tok{next(_ids)}"
        with self._lock:
            self._tokens.add(token)
        return JSONResponse({"accessToken": token, "expireIn": 7200})

    async def _robot(self, request: Request) -> Response:
        if request.headers.get("x-acs-dingtalk-access-token") not in self._tokens:
            return JSONResponse({"code": "InvalidAuthentication", "message": "不合法的access_token"}, status_code=401)
        body = await request.json()
        chat_id = f"user:{body['userIds'][0]}" if "userIds" in body else f"group:{body['openConversationId']}"
        with self._lock:
            if self.refusals["openapi"]:
                self.refusals["openapi"].pop(0)
                return JSONResponse({"code": "Throttling", "message": "请求过于频繁"}, status_code=429,
                                    headers={"Retry-After": "1"})
            param, key = json.loads(body["msgParam"]), body.get("msgKey")
            if key == "sampleMarkdown":
                self.shown.append((chat_id, "openapi", param["text"]))
            else:
                upload = self._uploads.get(param.get("photoURL") or param.get("mediaId") or "")
                if key not in ("sampleImageMsg", "sampleFile") or upload is None:
                    return JSONResponse({"code": "invalidParameter", "message": "msgParam无效"}, status_code=400)
                self.sent_files.append((chat_id, key, upload))
        return JSONResponse({"processQueryKey": f"q{next(_ids)}"})

    async def _upload(self, request: Request) -> Response:
        """The older API's media/upload: its errcode envelope, its access_token in the query."""
        if request.query_params.get("access_token") not in self._tokens:
            return JSONResponse({"errcode": 40014, "errmsg": "不合法的access_token"})
        async with request.form() as form:
            media = form.get("media")
            if media is None or isinstance(media, str) or request.query_params.get("type") not in ("image", "file"):
                return JSONResponse({"errcode": 40004, "errmsg": "不合法的媒体文件类型"})
            data = await media.read()
        media_id = f"@lAD{next(_ids)}"
        with self._lock:
            self._uploads[media_id] = (media.filename or "", data)
        return JSONResponse({"errcode": 0, "errmsg": "ok", "type": request.query_params["type"], "media_id": media_id,
                             "created_at": int(time.time() * 1000)})

    def stream(self, message: dict[str, Any]) -> str:
        """A robot message for the Stream connection; its frame's message id."""
        return self._frame("CALLBACK", "/v1.0/im/bot/messages/get", json.dumps(message))

    def system(self, topic: str) -> str:
        """A SYSTEM frame: "ping", or "disconnect" (the app should connect again)."""
        return self._frame("SYSTEM", topic, json.dumps({"opaque": f"o{next(_ids)}"}))

    def _frame(self, kind: str, topic: str, data: str) -> str:
        message_id = f"frame{next(_ids)}"
        with self._lock:
            self.frames.append({"specVersion": "1.0", "type": kind, "data": data, "headers": {
                "appId": APP_KEY, "connectionId": "c1", "contentType": "application/json", "messageId": message_id,
                "time": str(int(time.time() * 1000)), "topic": topic}})
        return message_id

    async def _open(self, request: Request) -> Response:
        body = await request.json()
        if body.get("clientId") != APP_KEY or body.get("clientSecret") != APP_SECRET:
            return JSONResponse({"code": "invalidClientIdOrSecret", "message": "无效的clientId或者clientSecret"},
                                status_code=400)
        return JSONResponse({"endpoint": f"{self.origin.replace('http', 'ws')}/stream", "ticket": f"t{next(_ids)}"})

    async def _socket(self, socket: WebSocket) -> None:
        """Sends each frame not yet acknowledged (a robot message again on a new connection), reads acks."""
        await socket.accept()
        with self._lock:
            self.connections += 1
            queue = [f for f in self.frames if f["type"] == "CALLBACK" and f["headers"]["messageId"] not in self.acks]
            sent = {f["headers"]["messageId"] for f in self.frames}  # the others went on an earlier connection

        async def read() -> None:
            while True:
                ack = json.loads(await socket.receive_text())
                with self._lock:
                    self.acks[ack["headers"]["messageId"]] = ack

        reader = asyncio.ensure_future(read())
        try:
            while not reader.done():
                with self._lock:
                    queue += [f for f in self.frames if f["headers"]["messageId"] not in sent]
                for frame in queue:
                    sent.add(frame["headers"]["messageId"])
                    await socket.send_text(json.dumps(frame))
                    if frame["headers"]["topic"] == "disconnect":
                        await socket.close()
                        return
                queue = []
                await asyncio.sleep(0.02)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            reader.cancel()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1.0/gateway/connections/open", self._open, methods=["POST"]),
            WebSocketRoute("/stream", self._socket),
            Route("/robot/sendBySession", self._webhook, methods=["POST"]),
            Route("/v1.0/oauth2/accessToken", self._token, methods=["POST"]),
            Route("/media/upload", self._upload, methods=["POST"]),
            Route("/v1.0/robot/oToMessages/batchSend", self._robot, methods=["POST"]),
            Route("/v1.0/robot/groupMessages/send", self._robot, methods=["POST"]),
            Route("/v1.0/robot/messageFiles/download", self._download, methods=["POST"]),
            Route("/files/{code}", self._file, methods=["GET"]),
        ])


@contextmanager
def serving_dingtalk() -> Iterator[FakeDingTalk]:
    fake = FakeDingTalk()
    with started(LoopbackServer(fake.app(), "fake-dingtalk")) as server:
        fake.origin = server.origin
        yield fake


def signed(body: bytes, *, secret: str = APP_SECRET, at_ms: float | None = None) -> dict[str, str]:
    """The headers DingTalk sends with a callback: its timestamp (ms) and sign."""
    timestamp = str(int(time.time() * 1000 if at_ms is None else at_ms))
    mac = hmac.new(secret.encode(), f"{timestamp}\n{secret}".encode(), hashlib.sha256).digest()
    return {"timestamp": timestamp, "sign": base64.b64encode(mac).decode(), "Content-Type": "application/json"}
