"""DingTalk as the channel uses it: callbacks' signatures, and markdown messages sent.

A callback carries `timestamp` (ms) and `sign`: Base64 of HMAC-SHA256 over "timestamp\\nsecret"
with the app secret, refused when more than an hour off. An answer goes through the message's
`sessionWebhook` while it is fresh (DingTalk gives one per conversation, for about 90 minutes);
else, as after a restart, through the OpenAPI robot messages (`/v1.0/robot/oToMessages/batchSend`
for a person, `/v1.0/robot/groupMessages/send` for a group) with the app's access token, fetched
with its key and secret and kept until a minute before it expires. A 429 (or DingTalk's "too fast"
codes) is RateLimited; another refusal DeliveryRefused with DingTalk's message. Neither the secret
nor the token is ever logged or put in an error.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import httpx

from ember.channels.attachments import capped
from ember.channels.chat.editing import RateLimited
from ember.core.channels import DeliveryRefused

MAX_SKEW_MS = 3_600_000
TOO_FAST = frozenset({130101, 660026})  # 发送太快; the robot's per-minute quota
RENEW_BEFORE_S = 60.0


def signature(timestamp: str, secret: str) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}\n{secret}".encode(), hashlib.sha256).digest()
    return base64.b64encode(mac).decode()


def signed_now(timestamp: str | None, sign: str | None, secret: str, now_ms: float) -> bool:
    if not timestamp or not sign or not timestamp.isdigit() or abs(now_ms - int(timestamp)) > MAX_SKEW_MS:
        return False
    return hmac.compare_digest(sign.encode(), signature(timestamp, secret).encode())


class DingTalkApi:
    def __init__(self, http: httpx.AsyncClient, base_url: str, app_key: str, secret: str, robot: str) -> None:
        self._http = http
        self._base = base_url.rstrip("/")
        self._app_key = app_key
        self._secret = secret
        self._robot = robot
        self._token: tuple[str, float] | None = None  # (token, when to renew it)

    async def token(self) -> str:
        if self._token is None or time.monotonic() >= self._token[1]:
            response = await self._http.post(f"{self._base}/v1.0/oauth2/accessToken",
                                             json={"appKey": self._app_key, "appSecret": self._secret})
            body = _json(response)
            if response.status_code != 200 or not body.get("accessToken"):
                raise DeliveryRefused("DingTalk refused the app key and secret "
                                      f"({body.get('code') or response.status_code})")
            lasts = float(str(body.get("expireIn", 7200)))
            self._token = (str(body["accessToken"]), time.monotonic() + lasts - RENEW_BEFORE_S)
        return self._token[0]

    async def download(self, download_code: str, max_bytes: int) -> bytes:
        """A file a message carries, by its downloadCode: its one-time address, then its bytes.
        httpx.HTTPError when it cannot be fetched; ValueError when it is over `max_bytes`."""
        response = await self._http.post(f"{self._base}/v1.0/robot/messageFiles/download",
                                          json={"downloadCode": download_code, "robotCode": self._robot},
                                          headers={"x-acs-dingtalk-access-token": await self.token()})
        response.raise_for_status()
        url = _json(response).get("downloadUrl")
        if not isinstance(url, str):
            raise httpx.HTTPError("DingTalk gave no download address")
        async with self._http.stream("GET", url) as file:
            file.raise_for_status()
            return await capped(file, max_bytes)

    async def by_webhook(self, webhook: str, markdown: str) -> None:
        response = await self._http.post(webhook, json={"msgtype": "markdown",
                                                        "markdown": {"title": "Ember", "text": markdown}})
        _check(response, _json(response).get("errcode"), _json(response).get("errmsg"))

    async def by_openapi(self, chat_id: str, markdown: str) -> None:
        """`chat_id`: "user:<staff id>" or "group:<openConversationId>"."""
        kind, _, target = chat_id.partition(":")
        body = {"robotCode": self._robot, "msgKey": "sampleMarkdown",
                "msgParam": json.dumps({"title": "Ember", "text": markdown}, ensure_ascii=False)}
        if kind == "user":
            path, body = "/v1.0/robot/oToMessages/batchSend", {**body, "userIds": [target]}
        else:
            path, body = "/v1.0/robot/groupMessages/send", {**body, "openConversationId": target}
        response = await self._http.post(self._base + path, json=body,
                                         headers={"x-acs-dingtalk-access-token": await self.token()})
        _check(response, None if response.status_code == 200 else _json(response).get("code"),
               _json(response).get("message"))


def _json(response: httpx.Response) -> dict[str, object]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _check(response: httpx.Response, code: object, message: object) -> None:
    if response.status_code == 429 or code in TOO_FAST:
        raise RateLimited(float(response.headers.get("Retry-After", "1")))
    if response.status_code >= 500:
        response.raise_for_status()  # worth another try: the answer stays owed
    if response.status_code != 200 or code not in (None, 0):
        raise DeliveryRefused(f"DingTalk refused the message: {message or code or response.status_code}")
