"""DingTalk as the channel uses it: callbacks' signatures, and markdown messages sent.

A callback carries `timestamp` (ms) and `sign`: Base64 of HMAC-SHA256 over "timestamp\\nsecret"
with the app secret, refused when more than an hour off. An answer goes through the message's
`sessionWebhook` while it is fresh (DingTalk gives one per conversation, for about 90 minutes);
else, as after a restart, through the OpenAPI robot messages (`/v1.0/robot/oToMessages/batchSend`
for a person, `/v1.0/robot/groupMessages/send` for a group) with the app's access token, fetched
with its key and secret and kept until a minute before it expires. A 429 (or DingTalk's "too fast"
codes) is RateLimited; another refusal DeliveryRefused with DingTalk's message. Neither the secret
nor the token is ever logged or put in an error.

An answer's file is uploaded to the older API (`POST oapi…/media/upload?type=image|file`, multipart
`media`) for a media id, then sent through the same robot messages: `sampleImageMsg` for a picture,
`sampleFile` for a document of the kinds DingTalk takes.
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
from ember.core.attachments import Attachment, AttachmentContent
from ember.core.channels import DeliveryRefused

MAX_SKEW_MS = 3_600_000
TOO_FAST = frozenset({130101, 660026})  # 发送太快; the robot's per-minute quota
RENEW_BEFORE_S = 60.0
PICTURE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif"})
FILE_KINDS = frozenset({"pdf", "doc", "docx", "xls", "xlsx", "ppt", "pptx", "zip", "rar"})  # sampleFile's fileType


def can_send(file: Attachment) -> bool:
    return file.media_type in PICTURE_TYPES or _kind(file) in FILE_KINDS


def _kind(file: Attachment) -> str:
    return (file.name or "").rpartition(".")[2].lower()


def signature(timestamp: str, secret: str) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}\n{secret}".encode(), hashlib.sha256).digest()
    return base64.b64encode(mac).decode()


def signed_now(timestamp: str | None, sign: str | None, secret: str, now_ms: float) -> bool:
    if not timestamp or not sign or not timestamp.isdigit() or abs(now_ms - int(timestamp)) > MAX_SKEW_MS:
        return False
    return hmac.compare_digest(sign.encode(), signature(timestamp, secret).encode())


class DingTalkApi:
    def __init__(self, http: httpx.AsyncClient, base_url: str, app_key: str, secret: str, robot: str, *,
                 oapi_base_url: str = "https://oapi.dingtalk.com") -> None:
        self._http = http
        self._base = base_url.rstrip("/")
        self._oapi = oapi_base_url.rstrip("/")
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
        await self._robot_message(chat_id, "sampleMarkdown", {"title": "Ember", "text": markdown})

    async def send_file(self, chat_id: str, file: AttachmentContent) -> None:
        """Upload `file` (one that `can_send`) and send it: a picture as one, else as a document."""
        picture = file.media_type in PICTURE_TYPES
        response = await self._http.post(
            f"{self._oapi}/media/upload", params={"access_token": await self.token(),
                                                  "type": "image" if picture else "file"},
            files={"media": (file.name or f"picture.{file.media_type.rsplit('/', 1)[-1]}", file.data,
                             file.media_type)})
        answer = _json(response)
        _check(response, answer.get("errcode"), answer.get("errmsg"))
        if not answer.get("media_id"):
            raise DeliveryRefused("DingTalk took the file but gave no media_id")
        media = str(answer["media_id"])
        if picture:
            await self._robot_message(chat_id, "sampleImageMsg", {"photoURL": media})
        else:
            await self._robot_message(chat_id, "sampleFile", {"mediaId": media, "fileName": file.name or "file",
                                                              "fileType": _kind(file)})

    async def _robot_message(self, chat_id: str, key: str, param: dict[str, str]) -> None:
        kind, _, target = chat_id.partition(":")
        body = {"robotCode": self._robot, "msgKey": key, "msgParam": json.dumps(param, ensure_ascii=False)}
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
