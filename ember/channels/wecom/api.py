"""The platforms' send API: an access token, cached and renewed, and messages sent with it.

WeCom: `GET /cgi-bin/gettoken?corpid=…&corpsecret=…`, then
`POST /cgi-bin/message/send?access_token=…` with `{"touser", "msgtype": "text", "agentid", "text": {"content"}}`.
Official Account: `GET /cgi-bin/token?grant_type=client_credential&appid=…&secret=…`, then
`POST /cgi-bin/message/custom/send?access_token=…` (a customer-service message, within 48 h of the person's
last message). Every answer is JSON with `errcode` (0, or absent, is success) and `errmsg`.

Files, on both: `POST /cgi-bin/media/upload?type=image|file` (multipart `media`) gives a `media_id` that a
message of that `msgtype` sends; `GET /cgi-bin/media/get?media_id=…` gives a person's picture back (its
bytes; JSON with an errcode when there are none). WeCom sends JPEG and PNG as pictures and anything else
as a file; an Official Account sends pictures only.

A token is kept until shortly before its `expires_in`, and fetched again once when a call says it is
expired or invalid (the platforms may end one early). Busy answers (-1, rate and quota limits) and 5xx
are retried with backoff; any other errcode refuses the message for good (DeliveryRefused). The secret and
the token travel in URLs: every text this module raises or logs has them replaced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ember.channels.attachments import capped
from ember.core.attachments import Attachment, AttachmentContent
from ember.core.channels import DeliveryRefused
from ember.core.redact import REDACTED

log = logging.getLogger(__name__)

# Expired (42001), invalid (40014), and the Official Account's "invalid credential, access_token is invalid
# or not latest" (40001; on WeCom 40001 is a wrong secret, which a new token fetch reports as well).
TOKEN_REFUSED = frozenset({40001, 40014, 42001})
# System busy (-1), API call limit (45009), WeCom's concurrency limit (45033), and the Official Account's
# customer-service message limit (45047, lifted when the person writes again).
BUSY = frozenset({-1, 45009, 45033, 45047})
ATTEMPTS = 5
BACKOFF_S = 0.5  # then 1, 2, 4 s
RENEW_EARLY_S = 300.0
TIMEOUT_S = 15.0
_KEPT_TOKENS = 3  # the latest tokens, hidden from every text with the secret


class PlatformUnavailable(Exception):
    """The API was unreachable, kept answering busy or 5xx, or gave no token: the message stays owed."""


class CredentialsRefused(PlatformUnavailable):
    """The token endpoint refused the app's id and secret (a configuration problem, not a busy moment)."""


class _Busy(PlatformUnavailable):
    """Worth another try after a while."""


@dataclass(frozen=True, slots=True)
class Endpoints:
    """One platform's token and send calls."""

    platform: str  # as messages name it: "WeCom", "the Official Account"
    token_path: str
    credentials: Mapping[str, str]  # the token call's query, the secret among it
    send_path: str
    extra: Mapping[str, Any]  # what every message body carries besides touser, msgtype and text
    picture_types: frozenset[str]  # the media types it sends as a picture
    sends_files: bool  # whether it sends other files, as files


def wecom_endpoints(corp_id: str, secret: str, agent_id: int) -> Endpoints:
    return Endpoints("WeCom", "/cgi-bin/gettoken", {"corpid": corp_id, "corpsecret": secret},
                     "/cgi-bin/message/send", {"agentid": agent_id}, frozenset({"image/jpeg", "image/png"}), True)


def official_endpoints(app_id: str, secret: str) -> Endpoints:
    return Endpoints("the Official Account", "/cgi-bin/token",
                     {"grant_type": "client_credential", "appid": app_id, "secret": secret},
                     "/cgi-bin/message/custom/send", {}, frozenset({"image/jpeg", "image/png", "image/gif"}), False)


@dataclass(frozen=True, slots=True)
class _Token:
    value: str
    renew_at: float  # on the api's clock


class WeixinApi:
    def __init__(self, base_url: str, endpoints: Endpoints, secret: str, *, http: httpx.AsyncClient | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._base_url = base_url.rstrip("/")
        self._endpoints = endpoints
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(trust_env=False, timeout=TIMEOUT_S)
        self._clock = clock
        self._token: _Token | None = None
        self._fetching = asyncio.Lock()  # concurrent sends wait for one token fetch
        self._secret = secret
        self._tokens: deque[str] = deque(maxlen=_KEPT_TOKENS)

    @property
    def platform(self) -> str:
        return self._endpoints.platform

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def check(self) -> None:
        """Fetch a token (nothing is sent): CredentialsRefused for a wrong id or secret."""
        await self._access_token()

    async def send_text(self, to_user: str, content: str) -> str:
        """Send `content` to one person; the platform's message id ("" where it gives none)."""
        return await self._send(to_user, "text", {"content": content})

    def can_send(self, file: Attachment) -> bool:
        return file.media_type in self._endpoints.picture_types or self._endpoints.sends_files

    async def send_file(self, to_user: str, file: AttachmentContent) -> str:
        """Upload `file` and send it to one person: a picture as one, anything else (where `can_send`) as a file."""
        kind = "image" if file.media_type in self._endpoints.picture_types else "file"
        upload = {"media": (file.name or f"{kind}.{file.media_type.rsplit('/', 1)[-1]}", file.data, file.media_type)}
        answer = await self._authorized(lambda token: self._call("POST", "/cgi-bin/media/upload",
                                                                 {"access_token": token, "type": kind}, files=upload))
        if _errcode(answer) != 0 or not answer.get("media_id"):
            raise DeliveryRefused(f"{self.platform} refused the file: {self._problem(answer)}")
        return await self._send(to_user, kind, {"media_id": str(answer["media_id"])})

    async def media(self, media_id: str, limit: int) -> bytes:
        """A person's picture by its MediaId: ValueError past `limit` bytes, DeliveryRefused when there is none."""
        answer = await self._authorized(lambda token: self._download(token, media_id, limit))
        if _errcode(answer) != 0:
            raise DeliveryRefused(f"{self.platform} gave no picture: {self._problem(answer)}")
        return bytes(answer["data"])

    async def _send(self, to_user: str, msgtype: str, content: Mapping[str, str]) -> str:
        body = {"touser": to_user, "msgtype": msgtype, **self._endpoints.extra, msgtype: content}
        answer = await self._authorized(
            lambda token: self._call("POST", self._endpoints.send_path, {"access_token": token}, body))
        if _errcode(answer) != 0:
            raise DeliveryRefused(f"{self.platform} refused the message: {self._problem(answer)}")
        return str(answer.get("msgid") or "")

    async def _authorized(self, call: Callable[[str], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """`call` with the token, and once more with a new one if the platform refused it."""
        token = await self._access_token()
        answer = await call(token)
        if _errcode(answer) in TOKEN_REFUSED:
            log.info("%s refused its access token (errcode %s); fetching a new one", self.platform, _errcode(answer))
            answer = await call(await self._access_token(stale=token))
        if _errcode(answer) in TOKEN_REFUSED:
            raise PlatformUnavailable(f"{self.platform} refused a fresh access token: {self._problem(answer)}")
        return answer

    async def _download(self, token: str, media_id: str, limit: int) -> dict[str, Any]:
        """`{"errcode": 0, "data": bytes}`, or the platform's JSON error."""
        params = {"access_token": token, "media_id": media_id}
        try:
            async with self._http.stream("GET", f"{self._base_url}/cgi-bin/media/get", params=params) as response:
                kind = response.headers.get("content-type", "")
                if response.status_code == 200 and not kind.startswith(("application/json", "text/")):
                    return {"errcode": 0, "data": await capped(response, limit)}
                body = await response.aread()
        except httpx.TransportError as exc:
            raise PlatformUnavailable(f"{self.platform} could not be reached: {self.hide(str(exc))}") from None
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise PlatformUnavailable(f"{self.platform} answered HTTP {response.status_code} without a picture")
        return answer

    def hide(self, text: str) -> str:
        """`text` without the secret or any token it may quote (a URL, an echoed request)."""
        for secret in (self._secret, *self._tokens):
            text = text.replace(secret, REDACTED)
        return text

    async def _access_token(self, *, stale: str | None = None) -> str:
        """The cached token, unless it is `stale` (refused just now) or about to expire."""
        async with self._fetching:
            token = self._token
            if token is not None and token.value != stale and self._clock() < token.renew_at:
                return token.value
            answer = await self._call("GET", self._endpoints.token_path, self._endpoints.credentials)
            value = answer.get("access_token")
            if _errcode(answer) != 0 or not isinstance(value, str) or not value:
                raise CredentialsRefused(f"{self.platform} gave no access token (check the id and the secret): "
                                         f"{self._problem(answer)}")
            expires_in = _number(answer.get("expires_in"), 7200.0)
            self._tokens.append(value)
            self._token = _Token(value, self._clock() + max(expires_in - RENEW_EARLY_S, expires_in / 2))
            return value

    async def _call(self, method: str, path: str, query: Mapping[str, str], body: Mapping[str, Any] | None = None,
                    *, files: Mapping[str, tuple[str, bytes, str]] | None = None) -> dict[str, Any]:
        retrying = AsyncRetrying(retry=retry_if_exception_type(_Busy), stop=stop_after_attempt(ATTEMPTS),
                                 wait=wait_exponential(multiplier=BACKOFF_S, max=8 * BACKOFF_S), reraise=True,
                                 before_sleep=lambda state: log.info("%s is busy (%s); trying again", self.platform,
                                                                     state.outcome and state.outcome.exception()))
        async for attempt in retrying:
            with attempt:
                return await self._once(method, path, query, body, files)
        raise AssertionError("tenacity re-raises the last failure")

    async def _once(self, method: str, path: str, query: Mapping[str, str], body: Mapping[str, Any] | None,
                    files: Mapping[str, tuple[str, bytes, str]] | None) -> dict[str, Any]:
        try:
            response = await self._http.request(method, self._base_url + path, params=dict(query), json=body,
                                                files=files)
        except httpx.TransportError as exc:  # a send whose answer was lost may show twice: there is no idempotency key
            raise _Busy(f"{self.platform} could not be reached: {self.hide(str(exc)) or type(exc).__name__}") from None
        if response.status_code >= 500:
            raise _Busy(f"{self.platform} answered HTTP {response.status_code}")
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code != 200 or not isinstance(answer, dict):
            raise PlatformUnavailable(f"{self.platform} answered HTTP {response.status_code} without its JSON envelope")
        if _errcode(answer) in BUSY:
            raise _Busy(f"{self.platform} is busy: {self._problem(answer)}")
        return answer

    def _problem(self, answer: Mapping[str, Any]) -> str:
        return self.hide(f"errcode {answer.get('errcode')}: {str(answer.get('errmsg') or '')[:300]}")


def _errcode(answer: Mapping[str, Any]) -> int:
    code = answer.get("errcode", 0)
    try:
        return int(code)
    except (TypeError, ValueError):
        return -2  # not a number: refused, with the envelope quoted


def _number(value: Any, default: float) -> float:
    try:
        return float(value) if value is not None else default
    except (TypeError, ValueError):
        return default
