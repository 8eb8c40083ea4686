"""DingTalk's Stream mode: the robot's messages on a WebSocket Ember opens, no public URL needed.

Ember asks the OpenAPI for a connection (`/v1.0/gateway/connections/open`, with the app key and
secret and the robot-message topic), then reads frames on the WebSocket it names. A robot message
(a CALLBACK frame on `/v1.0/im/bot/messages/get`) carries the same message an HTTP callback does;
it is acknowledged once kept, so DingTalk sends one again that was never acknowledged (a crash),
and the store runs no second turn for it. A `ping` is answered with its data; a `disconnect` (or a
dropped connection) opens a new connection, after a growing pause when it keeps failing.

dingtalk-stream, DingTalk's SDK for this, posts with a blocking client on the event loop and
swallows cancellation; the protocol is small enough to speak directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote_plus

import aiohttp
import httpx

from ember.core.errors import ConfigError

TOPIC = "/v1.0/im/bot/messages/get"
MAX_BACKOFF_S = 60.0
HEARTBEAT_S = 30.0

log = logging.getLogger(__name__)

Received = Callable[[dict[str, Any]], Awaitable[None]]


class StreamLink:
    def __init__(self, http: httpx.AsyncClient, base_url: str, app_key: str, secret: str, received: Received) -> None:
        self._http = http
        self._base = base_url.rstrip("/")
        self._app_key = app_key
        self._secret = secret
        self._received = received

    async def opened(self) -> str:
        """The WebSocket address (with its one-time ticket) DingTalk gives for this app's robot messages."""
        response = await self._http.post(f"{self._base}/v1.0/gateway/connections/open", json={
            "clientId": self._app_key, "clientSecret": self._secret, "ua": "ember",
            "subscriptions": [{"type": "CALLBACK", "topic": TOPIC}]})
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.status_code != 200 or not body.get("endpoint") or not body.get("ticket"):
            raise ConfigError(f"DingTalk opened no Stream connection for app {self._app_key} "
                              f"({body.get('code') or response.status_code}): check [dingtalk] app_key and app_secret")
        return f"{body['endpoint']}?ticket={quote_plus(str(body['ticket']))}"

    async def run(self) -> None:
        """Read frames until cancelled, connecting again after each drop."""
        backoff = 1.0
        while True:
            try:
                url = await self.opened()
                async with aiohttp.ClientSession() as session, \
                        session.ws_connect(url, heartbeat=HEARTBEAT_S) as socket:
                    backoff = 1.0
                    await self._read(socket)
            except (aiohttp.ClientError, httpx.HTTPError, ConfigError, OSError, TimeoutError) as exc:
                log.warning("dingtalk: the Stream connection failed (%s); trying again in %.0f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _read(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        async for frame in socket:
            if frame.type != aiohttp.WSMsgType.TEXT:
                continue
            try:
                message = json.loads(frame.data)
                headers, kind = message.get("headers") or {}, message.get("type")
            except (ValueError, AttributeError):
                log.warning("dingtalk: a Stream frame that is not a JSON object was ignored")
                continue
            if kind == "SYSTEM" and headers.get("topic") == "disconnect":
                return  # DingTalk moves the connection: open a new one
            if kind == "CALLBACK" and headers.get("topic") == TOPIC:
                try:
                    robot_message = json.loads(message.get("data") or "{}")
                    if isinstance(robot_message, dict):
                        await self._received(robot_message)
                except Exception:  # not acknowledged: DingTalk sends it again
                    log.warning("dingtalk: a Stream message could not be taken", exc_info=True)
                    continue
                reply = json.dumps({"response": None})
            else:  # a ping is answered with its own data; anything else is acknowledged and let be
                reply = message.get("data") or "{}"
            await socket.send_str(json.dumps({"code": 200, "message": "OK", "data": reply, "headers": {
                "contentType": "application/json", "messageId": headers.get("messageId")}}))
