"""A QQ bot OpenAPI of the tests' own, on 127.0.0.1, and the callbacks QQ would post.

The API side has what Ember's channel calls: POST /app/getAppAccessToken (expires_in a
string, as QQ sends it; a wrong secret answered with a code and no token), and the
replies POST /v2/users/{openid}/messages and /v2/groups/{group_openid}/messages, each
checking `Authorization: QQBot <token>` (401 with code 11244 once a test expires the
tokens). A reply must name a message the chat sent (msg_id) and a msg_seq not used
for it before: a repeat is refused 400 with 40054005, "消息被去重，请检查请求msgseq",
as QQ does; a sixth reply to one message is refused; 429s and 5xx come when a test
asks for them. A picture is uploaded to POST /v2/users/{openid}/files (file_type 1, base64
file_data) for a file_info that a reply of msg_type 7 shows; what a person sends is served
from GET /media/{name} (`hosted`), as QQ's multimedia server serves it.

The callback side writes the events QQ posts (C2C_MESSAGE_CREATE, GROUP_AT_MESSAGE_CREATE,
the op 13 callback-URL check), signed with the bot secret the way QQ signs them.
"""

from __future__ import annotations

import base64
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
from starlette.routing import Route

from ember.channels.qq.signing import HEADER_SIGNATURE, HEADER_TIMESTAMP, QQSigner
from tests.loopback import LoopbackServer

APP_ID = "102000001"
SECRET = "fake-qq-bot-secret-0123"
BOT_ID = "5000000001"  # how QQ writes the bot in an @-mention
MAX_CONTENT_CHARS = 2_000
MAX_REPLIES = 5


@dataclass(frozen=True)
class Reply:
    """A message the bot sent, as QQ took it."""

    chat: str  # "c2c:<user_openid>" or "group:<group_openid>"
    content: str
    msg_id: str | None
    msg_seq: int | None
    token: str
    picture: bytes | None = None  # a msg_type 7 reply's upload


@dataclass(frozen=True)
class Refusal:
    chat: str
    status: int
    code: int | None
    msg_seq: int | None


@dataclass
class FakeQQ:
    secret: str = SECRET
    origin: str = ""
    token_fetches: int = 0
    replies: list[Reply] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    # How to answer the next reply posts, in order: an HTTP status (429, 5xx), or None as usual
    failures: list[int | None] = field(default_factory=list)
    hosted: dict[str, bytes] = field(default_factory=dict)  # what a person's attachments' URLs serve, by name
    _uploads: dict[str, bytes] = field(default_factory=dict)  # file_info -> the picture
    _valid_tokens: set[str] = field(default_factory=set)
    _messages: dict[str, str] = field(default_factory=dict)  # a person's message id -> its chat
    _seqs: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def token_url(self) -> str:
        return f"{self.origin}/app/getAppAccessToken"

    # The callbacks QQ posts

    def direct(self, user_openid: str, content: str, *, attachments: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """A C2C_MESSAGE_CREATE event: the person wrote to the bot."""
        message_id = self._message(f"c2c:{user_openid}")
        return self._event("C2C_MESSAGE_CREATE", {
            "id": message_id, "author": {"user_openid": user_openid}, "content": content,
            "timestamp": "2024-11-06T13:37:18+08:00", "attachments": list(attachments)})

    def picture(self, name: str, data: bytes) -> dict[str, Any]:
        """A picture as a message's `attachments` list it, its bytes served at the URL it names."""
        self.hosted[name] = data
        return {"content_type": "image/png", "filename": name, "height": 4, "width": 4, "size": len(data),
                "url": f"{self.origin}/media/{name}"}

    def group(self, group_openid: str, member_openid: str, content: str) -> dict[str, Any]:
        """A GROUP_AT_MESSAGE_CREATE event: the person @-mentioned the bot in the group."""
        message_id = self._message(f"group:{group_openid}")
        return self._event("GROUP_AT_MESSAGE_CREATE", {
            "id": message_id, "author": {"member_openid": member_openid}, "content": f"<@!{BOT_ID}> {content}",
            "group_openid": group_openid, "timestamp": "2024-11-06T13:37:18+08:00"})

    def signed(self, payload: dict[str, Any] | bytes, *, secret: str | None = None) -> tuple[bytes, dict[str, str]]:
        """The body and headers of the POST QQ makes to the callback URL."""
        body = payload if isinstance(payload, bytes) else json.dumps(payload, ensure_ascii=False).encode()
        timestamp = str(int(time.time()))
        return body, {HEADER_SIGNATURE: QQSigner(secret or self.secret).sign(timestamp, body),
                      HEADER_TIMESTAMP: timestamp, "Content-Type": "application/json",
                      "User-Agent": "QQBot-Callback", "X-Bot-Appid": APP_ID}

    def _message(self, chat: str) -> str:
        with self._lock:
            message_id = f"ROBOT1.0_test{next(self._ids)}!!"
            self._messages[message_id] = chat
            return message_id

    def _event(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"op": 0, "id": f"{kind}:{data['id']}", "d": data, "t": kind}

    # The test's side

    def texts(self, chat: str) -> list[str]:
        with self._lock:
            return [reply.content for reply in self.replies if reply.chat == chat]

    def replies_to(self, msg_id: str) -> list[Reply]:
        with self._lock:
            return [reply for reply in self.replies if reply.msg_id == msg_id]

    def expire_tokens(self) -> None:
        with self._lock:
            self._valid_tokens.clear()

    # The OpenAPI

    async def _token(self, request: Request) -> JSONResponse:
        asked = json.loads(await request.body())
        with self._lock:
            if asked.get("appId") != APP_ID or asked.get("clientSecret") != self.secret:
                return JSONResponse({"code": 100016, "message": "invalid appid or secret"})
            self.token_fetches += 1
            token = f"token-{self.token_fetches}"
            self._valid_tokens.add(token)
            return JSONResponse({"access_token": token, "expires_in": "7200"})

    async def _reply(self, request: Request) -> JSONResponse:
        kind = "c2c" if "openid" in request.path_params else "group"
        chat = f"{kind}:{request.path_params.get('openid') or request.path_params['group_openid']}"
        body = json.loads(await request.body())
        token = request.headers.get("Authorization", "").removeprefix("QQBot ")
        with self._lock:
            seq = body.get("msg_seq", 1) if body.get("msg_id") else None
            if token not in self._valid_tokens:
                return self._refuse(chat, seq, 401, 11244, "token not exist or expire")
            status = self.failures.pop(0) if self.failures else None
            if status is not None:
                return self._refuse(chat, seq, status, 22009 if status == 429 else None,
                                    "msg limit exceed" if status == 429 else "internal error")
            content, msg_id = body.get("content"), body.get("msg_id")
            picture = self._uploads.get((body.get("media") or {}).get("file_info", "")) \
                if body.get("msg_type") == 7 else None
            if body.get("msg_type") == 7 and picture is None:
                return self._refuse(chat, seq, 400, 40034028, "file_info is invalid")
            if picture is None and (body.get("msg_type") != 0 or not isinstance(content, str) or not content.strip()):
                return self._refuse(chat, seq, 400, 50006, "message is empty")
            content = content or ""
            if len(content) > MAX_CONTENT_CHARS:  # the limit and wording as QQ has been seen to answer
                return self._refuse(chat, seq, 400, 40054007,
                                    f"content length {len(content)} exceeds max length {MAX_CONTENT_CHARS}")
            if msg_id is None or self._messages.get(msg_id) != chat:  # QQ no longer sends the bot's own messages
                return self._refuse(chat, seq, 400, 40034024, "请求参数msg_id无效或越权")
            if seq in self._seqs[msg_id]:
                return self._refuse(chat, seq, 400, 40054005, "消息被去重，请检查请求msgseq")
            if len(self._seqs[msg_id]) >= MAX_REPLIES:  # QQ documents the limit, not its code
                return self._refuse(chat, seq, 400, None, "a message takes at most five replies")
            self._seqs[msg_id].add(seq)
            self.replies.append(Reply(chat, content, msg_id, seq, token, picture))
            return JSONResponse({"id": f"ROBOT1.0_reply{next(self._ids)}", "timestamp": int(time.time())})

    def _refuse(self, chat: str, seq: int | None, status: int, code: int | None, message: str) -> JSONResponse:
        self.refusals.append(Refusal(chat, status, code, seq))
        body: dict[str, Any] = {"message": message, "trace_id": "fake-trace"}
        if code is not None:
            body |= {"code": code, "err_code": code}
        return JSONResponse(body, status_code=status)

    async def _upload(self, request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        with self._lock:
            if request.headers.get("Authorization", "").removeprefix("QQBot ") not in self._valid_tokens:
                return JSONResponse({"code": 11244, "message": "token not exist or expire"}, status_code=401)
            if body.get("file_type") != 1 or not body.get("file_data"):
                return JSONResponse({"code": 850012, "message": "file type not supported"}, status_code=400)
            file_info = f"info{next(self._ids)}"
            self._uploads[file_info] = base64.b64decode(body["file_data"])
        return JSONResponse({"file_uuid": file_info.upper(), "file_info": file_info, "ttl": 3600})

    async def _hosted(self, request: Request) -> Response:
        data = self.hosted.get(request.path_params["name"])
        return Response(data, media_type="image/png") if data is not None else Response(status_code=404)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v2/users/{openid}/files", self._upload, methods=["POST"]),
            Route("/v2/groups/{group_openid}/files", self._upload, methods=["POST"]),
            Route("/media/{name}", self._hosted, methods=["GET"]),
            Route("/app/getAppAccessToken", self._token, methods=["POST"]),
            Route("/v2/users/{openid}/messages", self._reply, methods=["POST"]),
            Route("/v2/groups/{group_openid}/messages", self._reply, methods=["POST"]),
        ])


@contextmanager
def serving_qq() -> Iterator[FakeQQ]:
    """The fake OpenAPI, serving; its `origin` is the api_base_url that points a bot at it."""
    fake = FakeQQ()
    server = LoopbackServer(fake.app(), "fake-qq")
    server.start()
    fake.origin = server.origin
    try:
        yield fake
    finally:
        server.stop()
