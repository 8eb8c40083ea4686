"""The `dingtalk` channel: a DingTalk (钉钉) app robot, called back over HTTP or in Stream mode.

DingTalk posts each message for the robot to `/channels/dingtalk/events`, signed with the app
secret (api.py): a call whose signature is missing, wrong or over an hour old is refused 401. In
Stream mode the same messages come on a WebSocket Ember opens (stream.py), each acknowledged once kept.
The message is kept in the store before DingTalk gets its 200, so a crash loses none, and one
posted again (same msgId) runs no second turn. A direct chat is a session; so is a group, where
DingTalk sends only the messages that @-mention the robot.

DingTalk cannot edit a robot's message: an answer is sent whole, in parts at DingTalk's limit,
each recorded as it is sent, so an answer sent again after a crash sends only what is missing. It
goes through the conversation's session webhook while that is fresh, else through the OpenAPI.
Its pictures and documents follow it as messages of their own (from part 1000 on), uploaded and
sent through the OpenAPI; files of other kinds are named at the end of its text.
DingTalk's robot messages have no buttons Ember could be told of: an approval request is text,
answered with /approve, /always or /deny and its short id, by the turn's person or an approver.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.attachments import not_taken
from ember.channels.chat.commands import ApprovalCommands, command, hint
from ember.channels.chat.editing import FILE_PARTS, RateLimited, digest
from ember.channels.chat.inbound import AllowList, refusal
from ember.channels.chat.platform import required, show_answers_only
from ember.channels.chat.services import ChatServices
from ember.channels.chat.split import split_message
from ember.channels.dingtalk.api import DingTalkApi, can_send, signed_now
from ember.channels.dingtalk.config import SECRET_ENV, DingTalkSpec
from ember.channels.dingtalk.stream import StreamLink
from ember.channels.gateway.http import ApiError, read_body
from ember.core.attachments import AttachmentContent, AttachmentRefused
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.errors import ModelError
from ember.core.events import InboundEvent, OutboundEvent
from ember.runtime.tasks import cancel_task

CHANNEL = "dingtalk"
EVENTS_PATH = "/channels/dingtalk/events"
MAX_MESSAGE_CHARS = 5_000  # a markdown message's text; DingTalk cuts longer ones
WEBHOOK_MARGIN_MS = 60_000  # a session webhook this close to its expiry is not used
MAX_WAITS = 5  # 429s waited out for one message before it stays owed
# The messages that carry a file, and the extension of a file DingTalk names not. (A voice message
# comes with DingTalk's own transcript, its `recognition`: that is its text.)
_FILE_KINDS = {"picture": "jpg", "file": "bin"}

log = logging.getLogger(__name__)


async def probe(spec: DingTalkSpec) -> str:
    """Whether the app key and secret work (an access token is fetched; nothing is sent)."""
    secret = required(spec.key(), f"[dingtalk] needs the app secret: app_secret = \"…\" or {SECRET_ENV}")
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        await DingTalkApi(http, spec.api_base_url, spec.app_key, secret, spec.robot).token()
    return f"app {spec.app_key} got an access token"


class DingTalkChannel:
    name = CHANNEL
    capabilities = ChannelCapabilities(approvals=True, max_message_chars=MAX_MESSAGE_CHARS, confirms_delivery=True)

    def __init__(self, spec: DingTalkSpec, services: ChatServices, *, http: httpx.AsyncClient | None = None) -> None:
        self._secret = required(spec.key(), f"[dingtalk] needs the app secret: app_secret = \"…\" or {SECRET_ENV}")
        self._http = http or httpx.AsyncClient(trust_env=False, timeout=10)
        self._api = DingTalkApi(self._http, spec.api_base_url, spec.app_key, self._secret, spec.robot,
                                oapi_base_url=spec.oapi_base_url)
        self._services = services
        self._gate: AllowList[str] = AllowList(CHANNEL, spec.allowed_users)
        self._approvers = frozenset(spec.approvers)
        self._commands = ApprovalCommands(CHANNEL, services, self._approvers)
        self._webhooks: dict[str, tuple[str, int]] = {}  # chat id -> (session webhook, its expiry in ms)
        self._stream = (StreamLink(self._http, spec.api_base_url, spec.app_key, self._secret, self._received)
                        if spec.mode == "stream" else None)
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._stream is not None:
            await self._stream.opened()  # a key DingTalk refuses stops `ember serve`, saying which
            self._reader = asyncio.create_task(self._stream.run(), name="ember-dingtalk-stream")

    async def stop(self) -> None:
        await cancel_task(self._reader)
        await self._http.aclose()

    def routes(self) -> list[Route]:
        return [] if self._stream is not None else [Route(EVENTS_PATH, self.events, methods=["POST"])]

    # In

    async def events(self, request: Request) -> Response:
        body = await read_body(request, 1_048_576)
        if not signed_now(request.headers.get("timestamp"), request.headers.get("sign"), self._secret,
                          time.time() * 1000):
            raise ApiError(401, "not DingTalk: the signature is missing, wrong or more than an hour old",
                           code="invalid_signature")
        try:
            message = json.loads(body)
        except ValueError:
            raise ApiError(400, "not a DingTalk message: the body is not JSON", code="invalid_message") from None
        if isinstance(message, dict):
            await self._received(message)
        return JSONResponse({"msgtype": "empty"})

    async def _received(self, message: dict[str, Any]) -> None:
        sender = str(message.get("senderStaffId") or message.get("senderId") or "")
        group = str(message.get("conversationType")) == "2"
        chat_id = f"group:{message.get('conversationId')}" if group else f"user:{sender}"
        if isinstance(webhook := message.get("sessionWebhook"), str):
            self._webhooks[chat_id] = (webhook, int(message.get("sessionWebhookExpiredTime") or 0))
        text = _text_of(message)
        typed = command(text)
        if not sender or not (self._gate.admits(sender) or (typed and sender in self._approvers)):
            if sender and self._gate.first_refusal(sender):
                await self._courtesy(chat_id, refusal("DingTalk staff id", sender))
            return
        if typed is not None:
            await self._courtesy(chat_id, await self._commands.answer(sender, *typed))
            return
        try:
            files = await self._files_of(message)
            text = await self._services.files.heard(text, files)
        except (AttachmentRefused, ValueError, httpx.HTTPError, ModelError) as exc:  # said; nothing is kept
            told = exc if isinstance(exc, AttachmentRefused | ModelError) else f"it could not be fetched ({exc})"
            await self._courtesy(chat_id, not_taken(told))
            return
        if not text and not files:
            return
        event = InboundEvent(channel=CHANNEL, chat_id=chat_id, sender_id=sender, text=text,
                             message_id=str(message.get("msgId") or ""), sender_name=message.get("senderNick") or None,
                             stream=False, can_approve=True,
                             attachments=await self._services.files.keep(f"{CHANNEL}:{chat_id}", files))
        if event.message_id and await self._services.inbox.accept(event):
            await self._services.bus.publish_inbound(event)

    async def _files_of(self, message: dict[str, Any]) -> list[AttachmentContent]:
        """A picture or file message's file, fetched by its downloadCode and checked."""
        kind, content = message.get("msgtype"), message.get("content")
        if kind not in _FILE_KINDS or not isinstance(content, dict) or not content.get("downloadCode"):
            return []
        name = str(content.get("fileName") or f"{kind}-{message.get('msgId')}.{_FILE_KINDS[kind]}")
        shelf = self._services.files
        data = await self._api.download(str(content["downloadCode"]), shelf.max_bytes)
        return [shelf.checked(data, declared=None, name=name)]

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        await show_answers_only(event, ask=self._ask, answer=self._answer, sends_files=True)

    async def _ask(self, event: OutboundEvent) -> None:
        how = hint(await self._commands.short_id(event))
        await self._send(event.chat_id, split_message(event.text, MAX_MESSAGE_CHARS - len(how))[0] + how)

    async def _answer(self, event: OutboundEvent) -> None:
        """The answer, in parts; the parts a run before sent are not sent again."""
        messages = self._services.messages
        if event.delivery_id is not None and await messages.finished(CHANNEL, event.turn_id) == event.delivery_id:
            return  # shown already (a re-send after a restart)
        text, files = await self._services.files.outgoing(event, can_send)
        pieces = split_message(text, MAX_MESSAGE_CHARS)
        digests = {part: digest(text) for part, text in enumerate(pieces) if text.strip()}
        digests |= {part: file.digest[:16] for part, file in enumerate(files, start=FILE_PARTS)}
        shown = await messages.digests(CHANNEL, event.turn_id)
        for part in digests:
            if shown.get(part) != digests[part]:
                if part < FILE_PARTS:
                    await self._send(event.chat_id, pieces[part])
                else:
                    await self._paced(partial(self._api.send_file, event.chat_id, files[part - FILE_PARTS]))
                await messages.record(CHANNEL, event.chat_id, event.turn_id, part, str(part))
                await messages.finish(CHANNEL, event.turn_id, None, {part: digests[part]})
        await messages.finish(CHANNEL, event.turn_id, event.delivery_id, digests)

    async def _send(self, chat_id: str, markdown: str) -> None:
        webhook, expires_ms = self._webhooks.get(chat_id, ("", 0))
        if webhook and expires_ms - WEBHOOK_MARGIN_MS > time.time() * 1000:
            await self._paced(partial(self._api.by_webhook, webhook, markdown))
        else:  # none known (a restart), or about to expire
            await self._paced(partial(self._api.by_openapi, chat_id, markdown))

    async def _paced(self, send: Callable[[], Awaitable[None]]) -> None:
        for _ in range(MAX_WAITS):
            try:
                return await send()
            except RateLimited as limited:
                await asyncio.sleep(limited.retry_after_s)
        raise RateLimited(1.0)  # still limited: the answer stays owed, and is sent again later

    async def _courtesy(self, chat_id: str, text: str) -> None:
        """A refusal, or how an approval command went: its failure must not stop the channel."""
        try:
            await self._send(chat_id, text)
        except (RateLimited, DeliveryRefused, httpx.HTTPError) as exc:
            log.info("dingtalk: could not answer in %s: %s", chat_id, exc)


def _text_of(message: dict[str, Any]) -> str:
    """What the person wrote: a text message's content, or what DingTalk heard of a voice message."""
    if message.get("msgtype") == "text" and isinstance(text := message.get("text"), dict):
        return str(text.get("content", "")).strip()
    if message.get("msgtype") == "audio" and isinstance(content := message.get("content"), dict):
        return str(content.get("recognition", "")).strip()
    return ""
