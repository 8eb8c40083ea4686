"""Feishu's long connection (长连接): events on a WebSocket Ember opens, no public URL needed.

Ember asks for an address (`POST /callback/ws/endpoint` with the app id and secret) and reads
protobuf frames (`pbbp2.Frame`) on the WebSocket it names. A data frame of type `event` carries an
event as Feishu would post it, unencrypted, possibly split in `sum` parts; it is answered by the
same frame with `{"code": 200}` (and a card press's answer, base64, in `data`) once the event is
kept, so Feishu sends again one never acknowledged. Ember pings every `PingInterval` seconds; a
pong may bring a new `ClientConfig`. A dropped connection is opened again after the pauses that
config asks for.

lark-oapi's own client blocks the event loop (requests, a loop of its own); the protocol is small
enough to speak directly, with the protobuf runtime for the frames.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlparse

import aiohttp
import httpx
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from ember.channels.chat.inbound import remember
from ember.core.errors import ConfigError

ENDPOINT_PATH = "/callback/ws/endpoint"
CONTROL, DATA = 0, 1  # a frame's method
MAX_PAUSE_S = 600.0

log = logging.getLogger(__name__)

Handled = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _frame_type() -> type[message.Message]:
    """pbbp2.Frame, as Feishu's SDKs declare it (proto2), built at run time instead of by protoc."""
    proto = descriptor_pb2.FieldDescriptorProto
    required, optional, repeated = proto.LABEL_REQUIRED, proto.LABEL_OPTIONAL, proto.LABEL_REPEATED
    file = descriptor_pb2.FileDescriptorProto(name="pbbp2.proto", package="pbbp2", syntax="proto2")
    header = file.message_type.add(name="Header")
    for number, name in ((1, "key"), (2, "value")):
        header.field.add(name=name, number=number, type=proto.TYPE_STRING, label=required)
    frame = file.message_type.add(name="Frame")
    for number, name, kind, label in (
            (1, "SeqID", proto.TYPE_UINT64, required), (2, "LogID", proto.TYPE_UINT64, required),
            (3, "service", proto.TYPE_INT32, required), (4, "method", proto.TYPE_INT32, required),
            (5, "headers", proto.TYPE_MESSAGE, repeated), (6, "payload_encoding", proto.TYPE_STRING, optional),
            (7, "payload_type", proto.TYPE_STRING, optional), (8, "payload", proto.TYPE_BYTES, optional),
            (9, "LogIDNew", proto.TYPE_STRING, optional)):
        frame.field.add(name=name, number=number, type=kind, label=label,
                        type_name=".pbbp2.Header" if kind == proto.TYPE_MESSAGE else None)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("pbbp2.Frame"))


Frame = _frame_type()


async def endpoint(http: httpx.AsyncClient, base_url: str, app_id: str, secret: str) -> tuple[str, Any]:
    """The WebSocket address Feishu gives this app, and the client settings it asks for."""
    response = await http.post(f"{base_url.rstrip('/')}{ENDPOINT_PATH}", headers={"locale": "en"},
                               json={"AppID": app_id, "AppSecret": secret})
    try:
        body = response.json()
    except ValueError:
        body = {}
    data = body.get("data") or {}
    if response.status_code != 200 or body.get("code") != 0 or not data.get("URL"):
        raise ConfigError(f"Feishu opened no long connection for app {app_id} "
                          f"({body.get('msg') or response.status_code}): check [feishu] app_id and app_secret, "
                          "and that the app receives events by long connection")
    return str(data["URL"]), data.get("ClientConfig")


def headers_of(frame: Any) -> dict[str, str]:
    return {header.key: header.value for header in frame.headers}


class LongConnection:
    def __init__(self, http: httpx.AsyncClient, base_url: str, app_id: str, secret: str, handled: Handled) -> None:
        self._http = http
        self._base = base_url
        self._app_id = app_id
        self._secret = secret
        self._handled = handled
        self._config = {"PingInterval": 120, "ReconnectInterval": 120, "ReconnectNonce": 30}
        self._parts: dict[str, list[bytes | None]] = {}  # message id -> the parts of a split event so far

    async def opened(self) -> str:
        url, config = await endpoint(self._http, self._base, self._app_id, self._secret)
        self._configure(config)
        return url

    async def run(self) -> None:
        """Read frames until cancelled, connecting again after each drop."""
        while True:
            try:
                url = await self.opened()
                service = int(parse_qs(urlparse(url).query).get("service_id", ["0"])[0])
                async with aiohttp.ClientSession() as session, session.ws_connect(url) as socket:
                    pinging = asyncio.create_task(self._ping(socket, service))
                    try:
                        await self._read(socket)
                    finally:
                        pinging.cancel()
                pause = random.uniform(0, self._config["ReconnectNonce"])  # dropped: not all apps at once
            except (aiohttp.ClientError, httpx.HTTPError, ConfigError, OSError, TimeoutError, ValueError) as exc:
                pause = min(float(self._config["ReconnectInterval"]), MAX_PAUSE_S)
                log.warning("feishu: the long connection failed (%s); trying again in %.0f s", exc, pause)
            await asyncio.sleep(pause)

    async def _ping(self, socket: aiohttp.ClientWebSocketResponse, service: int) -> None:
        ping = Frame(SeqID=0, LogID=0, service=service, method=CONTROL)
        ping.headers.add(key="type", value="ping")
        while not socket.closed:
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                await socket.send_bytes(ping.SerializeToString())
            await asyncio.sleep(max(1, int(self._config["PingInterval"])))

    async def _read(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        async for received in socket:
            if received.type != aiohttp.WSMsgType.BINARY:
                continue
            frame = Frame()
            try:
                frame.ParseFromString(received.data)
            except message.DecodeError:
                log.warning("feishu: a long-connection frame that is not a pbbp2 frame was ignored")
                continue
            headers = headers_of(frame)
            if frame.method == CONTROL and headers.get("type") == "pong" and frame.payload:
                with contextlib.suppress(ValueError):
                    self._configure(json.loads(frame.payload))
            elif frame.method == DATA and headers.get("type") == "event" \
                    and (answer := await self._answer(frame, headers)) is not None:
                await socket.send_bytes(answer.SerializeToString())

    async def _answer(self, frame: Any, headers: dict[str, str]) -> Any | None:
        """The acknowledgement of a data frame: None while parts of its event are still to come."""
        payload = self._joined(headers, frame.payload)
        if payload is None:
            return None
        reply: dict[str, Any] = {"code": 200}
        try:
            event = json.loads(payload)
            if not isinstance(event, dict):
                raise ValueError("not a JSON object")
            if result := await self._handled(event):
                reply["data"] = base64.b64encode(json.dumps(result).encode()).decode()
        except Exception:  # acknowledged as failed: Feishu sends it again
            log.warning("feishu: a long-connection event could not be taken", exc_info=True)
            reply = {"code": 500}
        answer = Frame()
        answer.CopyFrom(frame)
        answer.payload = json.dumps(reply).encode()
        return answer

    def _joined(self, headers: dict[str, str], payload: bytes) -> bytes | None:
        count, seq = int(headers.get("sum") or 1), int(headers.get("seq") or 0)
        if count <= 1:
            return payload
        message_id = headers.get("message_id", "")
        parts = self._parts.get(message_id) or [None] * count
        if len(parts) != count or not 0 <= seq < count:
            return None
        parts[seq] = payload
        if any(part is None for part in parts):
            remember(self._parts, message_id, parts)
            return None
        self._parts.pop(message_id, None)
        return b"".join(part or b"" for part in parts)

    def _configure(self, config: Any) -> None:
        if isinstance(config, dict):
            self._config.update({key: config[key] for key in self._config if isinstance(config.get(key), int)})
