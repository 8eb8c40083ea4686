"""The WeCom and WeChat Official Account APIs of the tests' own, on 127.0.0.1, and the platforms' side
of a callback.

The API: `GET /cgi-bin/gettoken` (corpid, corpsecret) and `GET /cgi-bin/token` (grant_type=client_credential,
appid, secret) issue access tokens (`{"errcode": 0, "errmsg": "ok", "access_token", "expires_in": 7200}`);
`POST /cgi-bin/message/send` (WeCom: touser, msgtype text, agentid, text.content) and
`/cgi-bin/message/custom/send` (Official Account) keep the message. Errors come in the platforms' envelope:
40013 / 40001 for a wrong id or secret, 40014 for an unknown token, 42001 for one that expired
(`expire_tokens`), 40056 for a wrong agentid, 45002 for text over 2048 bytes (WeCom would cut it; the fake
refuses, so a test notices), and whatever errcodes a test queues with `refuse_next` (45009, a rate limit…).
Files: `POST /cgi-bin/media/upload?type=image|file` (multipart `media`) gives a media_id that an image or
file message sends (an Official Account takes images only); `GET /cgi-bin/media/get` gives back what a
test put in `media` (a person's picture), or 40007 for an unknown media_id.

The platform's side: `wecom_push` / `wechat_push` build a message push as the platform sends it (signed,
and encrypted with MessageCrypto where the mode says so), the `*_url_check`s the console's URL check, and
`read_reply` opens a passive reply as the platform would.

The smart bot's side: `bot_text` / `bot_refresh` write its JSON messages, `bot_push` seals one as the platform
does (receive id ""), `read_bot_reply` opens a sealed JSON reply, and `POST /cgi-bin/aibot/response` keeps
what a response_url was sent (`FakeWeixin.responses`; each response_code takes one message).
"""

from __future__ import annotations

import itertools
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.wecom.crypto import MessageCrypto, cdata, parse_message, signature, url_signature
from tests.loopback import LoopbackServer

CORP_ID = "ww1436e0e65a779aee"
AGENT_ID = 1000002
CORP_SECRET = "wecom-app-secret-of-the-tests-0123456789"
APP_ID = "wx2c2769f8efd9abc2"
APP_SECRET = "wechat-app-secret-of-the-tests-9876543210"
ACCOUNT = "gh_0123456789ab"  # the Official Account's original id: its pushes' ToUserName
TOKEN = "hJqcu3uJ9Tn2gXPmxx2w9kkCkCE2EPYo"
AES_KEY = "6qkdMrq68nTKduznJYO1A37W2oEgpkMUvkttRToqhUt"
MAX_TEXT_BYTES = 2048
SEND_PATHS = {"wecom": "/cgi-bin/message/send", "wechat": "/cgi-bin/message/custom/send"}


@dataclass(frozen=True)
class Sent:
    platform: str  # "wecom" | "wechat"
    to_user: str
    content: str
    agent_id: int | None
    file: tuple[str, bytes] | None = None  # an image or file message's upload: its name and bytes


@dataclass(frozen=True)
class Push:
    """A callback request: its query and its XML body."""

    params: dict[str, str]
    body: str


@dataclass
class FakeWeixin:
    sent: list[Sent] = field(default_factory=list)
    token_calls: int = 0
    send_calls: int = 0
    # errcodes to answer the next sends with, before looking at them
    refusals: list[int] = field(default_factory=list)
    responses: list[dict[str, object]] = field(default_factory=list)  # what response_urls were sent
    media: dict[str, tuple[bytes, str]] = field(default_factory=dict)  # media_id -> bytes, content type
    _tokens: dict[str, str] = field(default_factory=dict)  # platform -> its valid token
    _expired: set[str] = field(default_factory=set)
    _uploads: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # media_id -> name, bytes
    _numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # The test's side

    def texts(self, to_user: str) -> list[str]:
        with self._lock:
            return [s.content for s in self.sent if s.to_user == to_user]

    def expire_tokens(self) -> None:
        """The tokens issued end before their time (the platforms may do that): 42001 until fetched again."""
        with self._lock:
            self._expired.update(self._tokens.values())
            self._tokens.clear()

    def refuse_next(self, *errcodes: int) -> None:
        with self._lock:
            self.refusals.extend(errcodes)

    # The API

    async def _gettoken(self, request: Request) -> JSONResponse:
        query = request.query_params
        if query.get("corpid") != CORP_ID:
            return _error(40013, "invalid corpid")
        if query.get("corpsecret") != CORP_SECRET:
            return _error(40001, "invalid credential")
        return self._issue("wecom")

    async def _token(self, request: Request) -> JSONResponse:
        query = request.query_params
        if query.get("grant_type") != "client_credential":
            return _error(40002, "invalid grant_type")
        if query.get("appid") != APP_ID:
            return _error(40013, "invalid appid")
        if query.get("secret") != APP_SECRET:
            return _error(40001, "invalid credential, access_token is invalid or not latest")
        return self._issue("wechat")

    def _issue(self, platform: str) -> JSONResponse:
        with self._lock:
            self.token_calls += 1
            token = self._tokens.setdefault(platform, f"{platform}-ACCESS-{next(self._numbers)}-{secrets.token_hex(8)}")
        return JSONResponse({"errcode": 0, "errmsg": "ok", "access_token": token, "expires_in": 7200})

    async def _send(self, request: Request) -> JSONResponse:
        platform = "wecom" if request.url.path == SEND_PATHS["wecom"] else "wechat"
        token = request.query_params.get("access_token", "")
        body = json.loads(await request.body())
        with self._lock:
            self.send_calls += 1
            if token in self._expired:
                return _error(42001, "access_token expired")
            if token != self._tokens.get(platform):
                return _error(40014, "invalid access_token")
            if self.refusals:
                code = self.refusals.pop(0)
                return _error(code, "api freq out of limit" if code == 45009 else f"refused ({code})")
            kind = body.get("msgtype")
            wrong_kind = kind not in ("text", "image", "file") or (platform, kind) == ("wechat", "file")
            if wrong_kind or not body.get("touser"):
                return _error(40008, "invalid message type")
            agent_id = body.get("agentid")
            if platform == "wecom" and agent_id != AGENT_ID:
                return _error(40056, "invalid agentid")
            content = body.get("text", {}).get("content", "")
            file = self._uploads.get(body.get(kind, {}).get("media_id", "")) if kind != "text" else None
            if kind != "text" and file is None:
                return _error(40007, "invalid media_id")
            if kind == "text" and (not content or len(content.encode()) > MAX_TEXT_BYTES):
                return _error(45002, "content size out of limit")
            self.sent.append(Sent(platform, body["touser"], content, agent_id, file))
            number = next(self._numbers)
        if platform == "wecom":
            return JSONResponse({"errcode": 0, "errmsg": "ok", "invaliduser": "", "invalidparty": "",
                                 "invalidtag": "", "msgid": f"msg{number}"})
        return JSONResponse({"errcode": 0, "errmsg": "ok"})

    async def _respond(self, request: Request) -> JSONResponse:
        code = request.query_params.get("response_code", "")
        body = json.loads(await request.body())
        with self._lock:
            if not code or any(r["response_code"] == code for r in self.responses):
                return _error(60140, "invalid response_code")  # unknown, or used already
            self.responses.append({"response_code": code, **body})
        return JSONResponse({"errcode": 0, "errmsg": "ok"})

    async def _upload(self, request: Request) -> JSONResponse:
        if not self._valid(request):
            return _error(40014, "invalid access_token")
        async with request.form() as form:
            media = form.get("media")
            if media is None or isinstance(media, str) or request.query_params.get("type") not in ("image", "file"):
                return _error(40004, "invalid media type")
            data = await media.read()
        media_id = f"up{next(self._numbers)}"
        with self._lock:
            self._uploads[media_id] = (media.filename or "", data)
        return JSONResponse({"errcode": 0, "errmsg": "ok", "type": request.query_params["type"], "media_id": media_id,
                             "created_at": str(int(time.time()))})

    async def _media(self, request: Request) -> Response:
        if not self._valid(request):
            return _error(40014, "invalid access_token")
        found = self.media.get(request.query_params.get("media_id", ""))
        if found is None:
            return _error(40007, "invalid media_id")
        return Response(found[0], media_type=found[1],
                        headers={"Content-disposition": 'attachment; filename="picture.jpg"'})

    def _valid(self, request: Request) -> bool:
        with self._lock:
            return request.query_params.get("access_token") in self._tokens.values()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/cgi-bin/media/upload", self._upload, methods=["POST"]),
            Route("/cgi-bin/media/get", self._media, methods=["GET"]),
            Route("/cgi-bin/aibot/response", self._respond, methods=["POST"]),
            Route("/cgi-bin/gettoken", self._gettoken, methods=["GET"]),
            Route("/cgi-bin/token", self._token, methods=["GET"]),
            Route(SEND_PATHS["wecom"], self._send, methods=["POST"]),
            Route(SEND_PATHS["wechat"], self._send, methods=["POST"]),
        ])


def _error(code: int, message: str) -> JSONResponse:
    return JSONResponse({"errcode": code, "errmsg": f"{message}, hint: [fake{code}]"})


@contextmanager
def serving_weixin() -> Iterator[tuple[FakeWeixin, str]]:
    """The fake APIs, and the api_base_url that points a channel at them."""
    fake = FakeWeixin()
    server = LoopbackServer(fake.app(), "fake-weixin")
    server.start()
    try:
        yield fake, server.origin
    finally:
        server.stop()


# The platform's side of a callback


def message_xml(to_user: str, from_user: str, content: str, msg_id: str, *, msg_type: str = "text",
                agent_id: int | None = None) -> str:
    """A message as the platforms write it, before it is encrypted: an image's `content` is its MediaId,
    a voice message's its transcript (Recognition)."""
    picture = f"<PicUrl>{cdata('https://example.invalid/p.jpg')}</PicUrl><MediaId>{cdata(content)}</MediaId>"
    voice = f"<MediaId>{cdata('v1')}</MediaId><Format>amr</Format><Recognition>{cdata(content)}</Recognition>"
    payload = {"text": f"<Content>{cdata(content)}</Content>", "voice": voice}.get(msg_type, picture)
    event = f"<Event>{cdata(content)}</Event>" if msg_type == "event" else ""
    return (f"<xml><ToUserName>{cdata(to_user)}</ToUserName><FromUserName>{cdata(from_user)}</FromUserName>"
            f"<CreateTime>{int(time.time())}</CreateTime><MsgType>{cdata(msg_type)}</MsgType>"
            + (event or payload) + (f"<MsgId>{msg_id}</MsgId>" if msg_type != "event" else "")
            + (f"<AgentID>{agent_id}</AgentID>" if agent_id is not None else "") + "</xml>")


def wecom_push(user: str, content: str, msg_id: str, *, msg_type: str = "text", agent_id: int = AGENT_ID) -> Push:
    sealed = MessageCrypto(TOKEN, AES_KEY, CORP_ID).encrypt(
        message_xml(CORP_ID, user, content, msg_id, msg_type=msg_type, agent_id=agent_id))
    body = (f"<xml><ToUserName>{cdata(CORP_ID)}</ToUserName><Encrypt>{cdata(sealed.encrypted)}</Encrypt>"
            f"<AgentID>{cdata(str(agent_id))}</AgentID></xml>")
    return Push({"msg_signature": sealed.signature, "timestamp": sealed.timestamp, "nonce": sealed.nonce}, body)


def wechat_push(openid: str, content: str, msg_id: str, *, safe: bool = True, msg_type: str = "text") -> Push:
    plain = message_xml(ACCOUNT, openid, content, msg_id, msg_type=msg_type)
    timestamp, nonce = str(int(time.time())), secrets.token_hex(5)
    params = {"signature": url_signature(TOKEN, timestamp, nonce), "timestamp": timestamp, "nonce": nonce,
              "openid": openid}
    if not safe:
        return Push(params, plain)
    sealed = MessageCrypto(TOKEN, AES_KEY, APP_ID).encrypt(plain, nonce=nonce, timestamp=timestamp)
    body = f"<xml><ToUserName>{cdata(ACCOUNT)}</ToUserName><Encrypt>{cdata(sealed.encrypted)}</Encrypt></xml>"
    return Push({**params, "encrypt_type": "aes", "msg_signature": sealed.signature}, body)


def wecom_url_check(echo: str) -> dict[str, str]:
    sealed = MessageCrypto(TOKEN, AES_KEY, CORP_ID).encrypt(echo)
    return {"msg_signature": sealed.signature, "timestamp": sealed.timestamp, "nonce": sealed.nonce,
            "echostr": sealed.encrypted}


def wechat_url_check(echo: str) -> dict[str, str]:
    timestamp, nonce = str(int(time.time())), secrets.token_hex(5)
    return {"signature": url_signature(TOKEN, timestamp, nonce), "timestamp": timestamp, "nonce": nonce,
            "echostr": echo}


def read_reply(body: str, receive_id: str) -> dict[str, str]:
    """A passive reply's message fields, opened (its signature checked) when sealed; {} for an empty answer."""
    if body in ("", "success"):
        return {}
    fields = parse_message(body)
    if "Encrypt" not in fields:
        return fields
    crypto = MessageCrypto(TOKEN, AES_KEY, receive_id)
    return parse_message(crypto.decrypt_message(fields["MsgSignature"], fields["TimeStamp"], fields["Nonce"], body))


# The smart bot's side of a callback

BOT_ID = "aib0123456789abcdef"


def bot_text(user: str, content: str, msg_id: str, *, chat_id: str | None = None,
             response_url: str = "") -> dict[str, object]:
    """A text message as the platform writes it (document 100719), before it is encrypted."""
    message: dict[str, object] = {"msgid": msg_id, "aibotid": BOT_ID, "chattype": "group" if chat_id else "single",
                                  "from": {"userid": user}, "msgtype": "text", "text": {"content": content}}
    if chat_id:
        message["chatid"] = chat_id
    if response_url:
        message["response_url"] = response_url
    return message


def bot_refresh(user: str, stream_id: str, msg_id: str) -> dict[str, object]:
    """A stream refresh: the platform asking for more of a stream (its own msgid, the stream's id)."""
    return {"msgid": msg_id, "aibotid": BOT_ID, "chattype": "single", "from": {"userid": user},
            "msgtype": "stream", "stream": {"id": stream_id}}


def bot_push(message: dict[str, object]) -> Push:
    sealed = MessageCrypto(TOKEN, AES_KEY, "").encrypt(json.dumps(message, ensure_ascii=False))
    return Push({"msg_signature": sealed.signature, "timestamp": sealed.timestamp, "nonce": sealed.nonce},
                json.dumps({"encrypt": sealed.encrypted}))


def bot_url_check(echo: str) -> dict[str, str]:
    sealed = MessageCrypto(TOKEN, AES_KEY, "").encrypt(echo)
    return {"msg_signature": sealed.signature, "timestamp": sealed.timestamp, "nonce": sealed.nonce,
            "echostr": sealed.encrypted}


def read_bot_reply(body: str, nonce: str) -> dict[str, object]:
    """A sealed JSON reply's message, its signature and nonce checked as the platform would; {} for an empty one."""
    if body == "":
        return {}
    envelope = json.loads(body)
    assert set(envelope) == {"encrypt", "msgsignature", "timestamp", "nonce"}, envelope
    assert envelope["nonce"] == nonce
    assert envelope["msgsignature"] == signature(TOKEN, envelope["timestamp"], nonce, envelope["encrypt"])
    message: dict[str, object] = json.loads(MessageCrypto(TOKEN, AES_KEY, "").decrypt(envelope["encrypt"]))
    return message
