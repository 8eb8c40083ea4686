"""The Feishu / Lark Open API as the channel uses it, over httpx: a tenant access token, cached
until shortly before it expires; messages sent, replied to, updated and recalled as interactive
cards; a message's files; and the event subscription's signature and encryption.

An event posted with an Encrypt Key set is `{"encrypt": …}`: AES-256-CBC under the SHA-256 of the
key, the IV its first 16 bytes; its `X-Lark-Signature` is the SHA-256 of the request's timestamp,
nonce, the key and the body.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any

import httpx
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ember.channels.attachments import capped
from ember.channels.chat.editing import MessageGone, RateLimited
from ember.core.attachments import OFFICE_TYPES, PDF_TYPE, AttachmentContent
from ember.core.channels import DeliveryRefused
from ember.core.errors import ConfigError

TOKEN_MARGIN_S = 300.0  # a token this close to its expiry is renewed
RATE_LIMITED = 99991400  # "request trigger frequency limit"
GONE = (230011, 231003)  # the message was recalled, or is not found
MAX_ERROR_CHARS = 300
# The file_type Feishu files an upload under (Word, Excel, PowerPoint in OFFICE_TYPES' order); else "stream".
_FILE_TYPES = {PDF_TYPE: "pdf", **dict(zip(OFFICE_TYPES, ("doc", "xls", "ppt"), strict=True))}


def signature(timestamp: str, nonce: str, key: str, body: bytes) -> str:
    return hashlib.sha256((timestamp + nonce + key).encode() + body).hexdigest()


def signed(headers: httpx.Headers | dict[str, str], key: str, body: bytes) -> bool:
    given = headers.get("X-Lark-Signature") or ""
    expected = signature(headers.get("X-Lark-Request-Timestamp") or "", headers.get("X-Lark-Request-Nonce") or "",
                         key, body)
    return hmac.compare_digest(given, expected)


def decrypted(encrypted: str, key: str) -> bytes:
    """ValueError when it is not an event encrypted with `key`."""
    try:
        raw = base64.b64decode(encrypted, validate=True)
        decryptor = Cipher(algorithms.AES(hashlib.sha256(key.encode()).digest()), modes.CBC(raw[:16])).decryptor()
        padded = decryptor.update(raw[16:]) + decryptor.finalize()
        unpadder = padding.PKCS7(128).unpadder()
        return unpadder.update(padded) + unpadder.finalize()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the event cannot be decrypted with the encrypt key: {exc}") from None


def card(markdown: str, buttons: list[dict[str, Any]] | None = None) -> str:
    """An interactive card showing `markdown`, updatable for everyone in the chat, with buttons."""
    elements: list[dict[str, Any]] = [{"tag": "markdown", "content": markdown or " "}]
    if buttons:
        elements.append({"tag": "action", "actions": buttons})
    return json.dumps({"config": {"wide_screen_mode": True, "update_multi": True}, "elements": elements},
                      ensure_ascii=False)


class FeishuApi:
    def __init__(self, http: httpx.AsyncClient, base_url: str, app_id: str, app_secret: str) -> None:
        self._http = http
        self._base = base_url.rstrip("/") + "/open-apis"
        self._app_id = app_id
        self._app_secret = app_secret
        self._token = ""
        self._token_expires = 0.0

    async def token(self) -> str:
        if self._token and time.monotonic() < self._token_expires - TOKEN_MARGIN_S:
            return self._token
        response = await self._http.post(f"{self._base}/auth/v3/tenant_access_token/internal",
                                         json={"app_id": self._app_id, "app_secret": self._app_secret})
        body = _json(response)
        if body.get("code") != 0 or not body.get("tenant_access_token"):
            why = body.get("msg") or response.status_code
            raise ConfigError(f"Feishu refused app {self._app_id}'s credentials ({why}): check [feishu] app_id and "
                              "app_secret")
        self._token = str(body["tenant_access_token"])
        self._token_expires = time.monotonic() + float(body.get("expire") or 7200)
        return self._token

    async def send_card(self, chat_id: str, content: str, *, reply_to: str | None = None) -> str:
        """A new card in the chat, as a reply to `reply_to` where there is one; its message id."""
        return await self.send(chat_id, "interactive", content, reply_to=reply_to)

    async def send_file(self, chat_id: str, file: AttachmentContent, *, reply_to: str | None = None) -> str:
        """A picture as an image message, an Ogg recording as a voice message, else a file; uploaded first."""
        name = file.name or "file"
        if file.is_image:
            data = await self._call("POST", "/im/v1/images", data={"image_type": "message"},
                                    files={"image": (name, file.data, file.media_type)})
            kind, content = "image", {"image_key": data["image_key"]}
        else:
            voice = file.media_type == "audio/ogg"
            data = await self._call("POST", "/im/v1/files", files={"file": (name, file.data, file.media_type)},
                                    data={"file_type": "opus" if voice else _FILE_TYPES.get(file.media_type, "stream"),
                                          "file_name": name})
            kind, content = ("audio" if voice else "file"), {"file_key": data["file_key"]}
        return await self.send(chat_id, kind, json.dumps(content), reply_to=reply_to)

    async def send(self, chat_id: str, kind: str, content: str, *, reply_to: str | None = None) -> str:
        body = {"msg_type": kind, "content": content}
        if reply_to:
            data = await self._call("POST", f"/im/v1/messages/{reply_to}/reply", json=body)
        else:
            data = await self._call("POST", "/im/v1/messages", params={"receive_id_type": "chat_id"},
                                    json={**body, "receive_id": chat_id})
        return str(data["message_id"])

    async def update_card(self, message_id: str, content: str) -> None:
        await self._call("PATCH", f"/im/v1/messages/{message_id}", json={"content": content})

    async def recall(self, message_id: str) -> None:
        await self._call("DELETE", f"/im/v1/messages/{message_id}")

    async def resource(self, message_id: str, key: str, kind: str, limit: int) -> bytes:
        """A file or image a message carries (`kind`: "image" or "file"), at most `limit` bytes."""
        headers = {"Authorization": f"Bearer {await self.token()}"}
        async with self._http.stream("GET", f"{self._base}/im/v1/messages/{message_id}/resources/{key}",
                                     params={"type": kind}, headers=headers) as response:
            if response.status_code != 200:
                raise httpx.HTTPStatusError(f"Feishu answered {response.status_code} for the file",
                                            request=response.request, response=response)
            return await capped(response, limit)

    async def _call(self, method: str, path: str, **request: Any) -> dict[str, Any]:
        """The call's `data`; RateLimited, MessageGone or DeliveryRefused as the chat kit has them."""
        response = await self._http.request(method, self._base + path,
                                            headers={"Authorization": f"Bearer {await self.token()}"}, **request)
        body = _json(response)
        code = body.get("code")
        if response.status_code == 429 or code == RATE_LIMITED:
            raise RateLimited(float(response.headers.get("x-ogw-ratelimit-reset") or 1))
        if code in GONE:
            raise MessageGone(str(body.get("msg")))
        if response.status_code >= 500:
            response.raise_for_status()  # the platform's trouble: the answer stays owed, sent again later
        if code != 0:
            raise DeliveryRefused(f"Feishu refused ({code}): {str(body.get('msg'))[:MAX_ERROR_CHARS]}")
        return body.get("data") or {}


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        response.raise_for_status()
        raise httpx.HTTPError(f"Feishu answered {response.status_code} without JSON")
    return body
