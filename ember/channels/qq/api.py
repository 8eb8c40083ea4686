"""The QQ bot OpenAPI as the channel uses it: the app access token, and replies of text or a picture.

The token is fetched from `token_url` with the app id and secret, and kept until a
minute before it expires (in that last minute QQ hands out the next one); a 401, or a
code QQ answers for a missing, wrong or expired token, fetches it again, once. A reply
is one POST to /v2/users/{openid}/messages or /v2/groups/{group_openid}/messages. A
429, QQ's rate-limit codes, a 5xx or a lost connection is tried again with backoff and
the same msg_seq: if the first try did land, QQ refuses the retry as a duplicate
(40054005), and the reply counts as sent. Any other refusal is DeliveryRefused, with
QQ's message. Neither the secret nor the token is ever logged or put in an error.

A picture is uploaded first (POST …/files with `file_type` 1 and the bytes as base64 `file_data`),
then sent as a reply of `msg_type` 7 naming the `file_info` QQ gave. QQ sends PNG and JPEG pictures;
its other file types (video, SILK voice, files) are not open to bots or not what Ember has.

Source: tencent-connect/bot-docs, docs/develop/api-v2/dev-prepare/interface-framework/api-use.md,
server-inter/message/send-receive/send.md and openapi/error/error.md; tencent-connect/botgo,
token/token_source.go and openapi/v1/openapi.go (11244: the token expired or does not exist).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential

from ember.core.attachments import Attachment, AttachmentContent
from ember.core.channels import DeliveryRefused

RENEW_BEFORE_S = 60.0
ATTEMPTS = 4
BACKOFF_S = 0.5  # then 1 s, 2 s
MAX_BACKOFF_S = 8.0
DUPLICATE = 40054005  # 消息被去重: this msg_id + msg_seq was sent already
TOKEN_CODES = frozenset({11241, 11243, 11244})  # no token, a wrong one, an expired one
# 20028, 22009 and 1100100 are QQ's "too many messages"; the 112xx are system errors QQ says to retry.
RETRIED_CODES = frozenset({20028, 22009, 1100100, 11242, 11252, 11263, 11281})
CHAT_PATHS = {"c2c": "/v2/users/{}/messages", "group": "/v2/groups/{}/messages"}
PICTURE_TYPES = frozenset({"image/png", "image/jpeg"})
PICTURE, MEDIA = 1, 7  # an upload's file_type for a picture; the msg_type of a reply that shows an upload


def can_send(file: Attachment) -> bool:
    return file.media_type in PICTURE_TYPES

log = logging.getLogger(__name__)


class QQUnavailable(Exception):
    """This attempt failed in a way worth another: the answer stays owed if every attempt does."""


class TokenRefused(Exception):
    """QQ refused the app id and secret: nothing can be sent until they are fixed."""


class _Token(BaseModel):
    access_token: str = Field(min_length=1)
    expires_in: int  # QQ sends the seconds as a string ("7200"); lax validation reads either


class _Problem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: int | None = None
    err_code: int | None = None
    message: str = ""


def _problem(response: httpx.Response) -> tuple[int | None, str]:
    """QQ's error code and message in a refusal (`{"code", "message", "err_code", "trace_id"}`)."""
    try:
        problem = _Problem.model_validate_json(response.content)
    except ValidationError:
        return None, response.text[:200]
    return problem.code or problem.err_code, problem.message


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def chat_path(chat_id: str) -> str:
    """The messages path of a chat id: `c2c:<user_openid>` or `group:<group_openid>`."""
    kind, _, openid = chat_id.partition(":")
    if kind not in CHAT_PATHS or not openid:
        raise DeliveryRefused(f"{chat_id[:80]!r} is not a QQ chat (c2c:OPENID or group:OPENID)")
    return CHAT_PATHS[kind].format(quote(openid, safe=""))


class AccessToken:
    """The app access token, fetched when there is none or it is about to expire."""

    def __init__(self, http: httpx.AsyncClient, url: str, app_id: str, secret: str,
                 clock: Callable[[], float]) -> None:
        self._http = http
        self._url = url
        self._app_id = app_id
        self._secret = secret
        self._clock = clock
        self._value: str | None = None
        self._renew_at = 0.0
        self._lock = asyncio.Lock()  # one fetch at a time: the sends waiting on it share its token

    async def get(self) -> str:
        async with self._lock:
            if self._value is None or self._clock() >= self._renew_at:
                await self._fetch()
            assert self._value is not None
            return self._value

    async def renew(self, refused: str) -> str:
        """A token in place of `refused`: fetched, unless another send has fetched one already."""
        async with self._lock:
            if self._value is None or self._value == refused:
                await self._fetch()
            assert self._value is not None
            return self._value

    async def _fetch(self) -> None:
        self._value = None
        try:
            response = await self._http.post(self._url, json={"appId": self._app_id, "clientSecret": self._secret})
        except httpx.TransportError as exc:
            raise QQUnavailable(f"could not reach {_origin(self._url)} for a token: {type(exc).__name__}") from None
        if response.status_code == 429 or response.status_code >= 500:
            raise QQUnavailable(f"{_origin(self._url)} answered {response.status_code} for a token")
        try:
            token = _Token.model_validate_json(response.content)
        except ValidationError:
            code, message = _problem(response)
            raise TokenRefused(f"QQ refused the token for app {self._app_id} ({response.status_code}"
                               f"{f', code {code}' if code else ''}): {message or 'no reason given'}; check "
                               "[qq] app_id and the secret (EMBER_QQ_SECRET)") from None
        self._value = token.access_token
        self._renew_at = self._clock() + max(token.expires_in - RENEW_BEFORE_S, 0.0)


class QQApi:
    def __init__(self, http: httpx.AsyncClient, api_base_url: str, token: AccessToken) -> None:
        self._http = http
        self._base = api_base_url.rstrip("/")
        self._token = token

    async def reply(self, chat_id: str, content: str, *, msg_id: str | None, msg_seq: int) -> str:
        """Send `content` to the chat as reply `msg_seq` to the message `msg_id` (None: a message of
        the bot's own, which QQ no longer allows); the id QQ gives it, "" if none (a retry that had landed)."""
        return await self._send(chat_id, {"content": content, "msg_type": 0}, msg_id, msg_seq)

    async def reply_picture(self, chat_id: str, file: AttachmentContent, *, msg_id: str | None, msg_seq: int) -> str:
        """Upload a picture (`can_send`) and send it as reply `msg_seq`, as `reply` sends text."""
        url = self._base + chat_path(chat_id).removesuffix("/messages") + "/files"
        uploaded = await self._retried(url, {"file_type": PICTURE, "srv_send_msg": False,
                                             "file_data": base64.b64encode(file.data).decode()})
        if not uploaded.get("file_info"):
            raise DeliveryRefused("QQ took the picture but gave no file_info to send it with")
        return await self._send(chat_id, {"msg_type": MEDIA,
                                          "media": {"file_info": uploaded["file_info"]}}, msg_id, msg_seq)

    async def _send(self, chat_id: str, body: dict[str, Any], msg_id: str | None, msg_seq: int) -> str:
        if msg_id is not None:
            body |= {"msg_id": msg_id, "msg_seq": msg_seq}
        return str((await self._retried(self._base + chat_path(chat_id), body)).get("id") or "")

    async def _retried(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        retrying = AsyncRetrying(stop=stop_after_attempt(ATTEMPTS),
                                 wait=wait_exponential(multiplier=BACKOFF_S, max=MAX_BACKOFF_S),
                                 retry=retry_if_exception_type(QQUnavailable), before_sleep=_retrying, reraise=True)
        async for attempt in retrying:
            with attempt:
                return await self._post(url, body, retried=attempt.retry_state.attempt_number > 1)
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _post(self, url: str, body: dict[str, Any], *, retried: bool) -> dict[str, Any]:
        """QQ's answer; {} for a retry QQ refused as a duplicate of the try that had landed."""
        token = await self._token.get()
        renewed = False
        while True:
            try:
                response = await self._http.post(url, json=body, headers={"Authorization": f"QQBot {token}"})
            except httpx.TransportError as exc:
                raise QQUnavailable(f"could not reach {_origin(url)}: {type(exc).__name__}") from None
            if response.is_success:
                try:
                    answer = response.json()
                except ValueError:
                    answer = None
                return answer if isinstance(answer, dict) else {}
            code, message = _problem(response)
            if not renewed and (response.status_code == 401 or code in TOKEN_CODES):
                token, renewed = await self._token.renew(token), True
                continue
            problem = (f"QQ answered {response.status_code}{f', code {code}' if code else ''}: "
                       f"{message or response.reason_phrase}")
            if code == DUPLICATE and retried:
                log.info("qq: %s; the reply had landed before the retry", problem)
                return {}
            if response.status_code == 429 or response.status_code >= 500 or code in RETRIED_CODES:
                raise QQUnavailable(problem)
            raise DeliveryRefused(problem)


def _retrying(state: RetryCallState) -> None:
    failure = state.outcome.exception() if state.outcome else None
    log.info("qq: %s; trying again (attempt %d of %d)", failure, state.attempt_number + 1, ATTEMPTS)
