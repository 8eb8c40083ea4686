"""The `wecom_bot` channel: a WeCom smart bot (企业微信智能机器人) in API mode, its callback URL at
/channels/wecom-bot.

The platform (documents 100719, 101031, 101033 and 101138 of developer.work.weixin.qq.com) POSTs each
message as `{"encrypt": …}`, signed in the query like the self-built app's callbacks and sealed for the
receive id "". The plaintext is JSON: msgid, aibotid, chatid (group chats), chattype, from.userid,
response_url and msgtype (text, mixed, image, voice, file, event, stream). The passive reply is sealed JSON
too; to a text it opens a stream, `{"msgtype": "stream", "stream": {"id", "finish", "content"}}`, and the
platform then keeps POSTing `{"msgtype": "stream", "stream": {"id"}}` (a refresh), each answered with the
stream's whole content so far, until one says `finish: true`, or for at most 6 minutes after the message.

A text is kept in the store before the stream opens, so a retried msgid runs no second turn; the stream's
id is derived from the msgid, so a retry is answered with the same stream as it stands. A refresh shows the
deltas `deliver` was handed (and any approval request, with its `/approve N` hint); once the committed
answer is in, the next refresh shows exactly that text with finish=true, and `deliver` returns only then.
If no refresh took it before `stream_window_s` (ours, below the platform's 6 minutes), the stream ends
with a note and the answer goes once through the message's response_url (valid an hour, good for one
message). Approval commands, refusals and notes are finished streams of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from ember.channels.chat.commands import ApprovalCommands, command, hint
from ember.channels.chat.editing import digest
from ember.channels.chat.inbound import AllowList, refusal, remember
from ember.channels.chat.services import ChatServices
from ember.channels.gateway.http import ApiError, read_body
from ember.channels.wecom.callback import BotCallbacks, CallbackEndpoint
from ember.channels.wecom.channel import ONLY_TEXT, byte_pieces
from ember.channels.wecom.config import WeComBotSpec
from ember.channels.wecom.crypto import MAX_XML_CHARS
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind

MAX_STREAM_BYTES = 20_480  # a stream's content, in UTF-8 (document 101031)
REFRESH_GRACE_S = 5.0  # after the window, how long an answer waits for a refresh already on its way
CUT = "\n\n[…]"
LATER = "\n\n(This is taking a while: the answer follows in a separate message.)"
TOO_LATE = "\n\n(This took too long to show here; the answer is kept in our conversation.)"
_MENTION = re.compile(r"@\S+\s*")  # a group message starts with the bot's @name
TIMEOUT_S = 15.0

log = logging.getLogger(__name__)


class _Text(BaseModel):
    content: str = ""


class _Item(BaseModel):
    msgtype: str = ""
    text: _Text | None = None


class _Mixed(BaseModel):
    msg_item: list[_Item] = Field(default_factory=list)


class _Sender(BaseModel):
    userid: str = ""


class _StreamRef(BaseModel):
    id: str = ""


class BotMessage(BaseModel):
    """A decrypted push: a message, a stream refresh or an event (fields the channel does not read are ignored)."""

    model_config = ConfigDict(extra="ignore")

    msgid: str = ""
    chatid: str = ""  # group chats only
    chattype: str = "single"
    sender: _Sender = Field(default_factory=_Sender, alias="from")
    response_url: str = ""
    msgtype: str
    text: _Text | None = None
    mixed: _Mixed | None = None  # text and pictures; its text parts are read
    stream: _StreamRef | None = None

    @property
    def chat_id(self) -> str:
        return self.chatid or self.sender.userid

    def typed(self) -> str | None:
        """What the person wrote, without the bot's @name in a group; None for a message without text."""
        if self.msgtype == "text" and self.text is not None:
            text = self.text.content
        elif self.msgtype == "mixed" and self.mixed is not None:
            text = " ".join(item.text.content for item in self.mixed.msg_item if item.text is not None)
        else:
            return None
        return (_MENTION.sub("", text.strip(), count=1) if self.chattype == "group" else text).strip()


@dataclass(slots=True)
class _Stream:
    """One message's stream, from its opening reply until the platform has its answer."""

    chat_id: str
    deadline: float  # on the channel's clock: refreshes after it end the stream
    response_url: str  # "" when unknown or used
    text: str = ""  # what it shows so far: the deltas, and approval requests
    final: str | None = None  # the committed answer, for the next refresh
    closed: bool = False  # a refresh was answered with finish=true
    final_shown: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set when closed


def stream_id_of(message_id: str) -> str:
    """The stream a message's replies open: the same for every retry of it, and after a restart."""
    return "ember-" + hashlib.sha256(message_id.encode()).hexdigest()[:32]


def stream_reply(stream_id: str, content: str, *, finish: bool) -> dict[str, Any]:
    return {"msgtype": "stream", "stream": {"id": stream_id, "finish": finish, "content": _fit(content)}}


def _fit(text: str) -> str:
    if len(text.encode()) <= MAX_STREAM_BYTES:
        return text
    return byte_pieces(text, MAX_STREAM_BYTES - len(CUT.encode()))[0] + CUT


class WeComBotChannel(CallbackEndpoint):
    _callbacks: BotCallbacks
    name = "wecom_bot"
    path = "/channels/wecom-bot"
    capabilities = ChannelCapabilities(streams=True, approvals=True, max_message_chars=MAX_STREAM_BYTES // 4,
                                       confirms_delivery=True)

    def __init__(self, spec: WeComBotSpec, services: ChatServices, *,
                 http: httpx.AsyncClient | None = None, clock: Callable[[], float] = time.time) -> None:
        self._callbacks = BotCallbacks(spec.token.get_secret_value(), spec.encoding_aes_key.get_secret_value())
        self._gate: AllowList[str] = AllowList(self.name, spec.allowed_users)
        self._window_s = spec.stream_window_s
        self._bus = services.bus
        self._inbox = services.inbox
        self._messages = services.messages
        self._commands = ApprovalCommands(self.name, services, frozenset(spec.approvers))
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(trust_env=False, timeout=TIMEOUT_S)
        self._clock = clock  # wall time: a restarted stream's deadline comes from its receipt
        self._streams: dict[str, _Stream] = {}
        self._finished: dict[str, None] = {}  # streams shown in full: a late refresh gets nothing more
        self._replies: dict[str, str] = {}  # message id -> the finished stream a one-off message got

    async def start(self) -> None:
        if self._gate.everyone:
            log.warning("[wecom_bot] allowed_users is empty: everyone who can chat with the bot may talk to the agent")

    async def stop(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    # In

    async def receive(self, request: Request) -> Response:
        plaintext, nonce = self._callbacks.open(request.query_params, await read_body(request, MAX_XML_CHARS))
        try:
            message = BotMessage.model_validate_json(plaintext)
        except ValidationError:
            raise ApiError(400, "the message is not a smart bot's JSON", code="invalid_callback") from None
        reply = await self._handle(message)
        if reply is None:
            return Response(b"")  # an empty 200: answered with nothing (the docs' "回复空包")
        return Response(self._callbacks.seal(nonce, json.dumps(reply, ensure_ascii=False)),
                        media_type="application/json")

    async def _handle(self, message: BotMessage) -> dict[str, Any] | None:
        if message.msgtype == "stream":
            return self._refresh(message.stream.id if message.stream else "")
        if message.msgtype == "event":
            return None  # entering the chat, a card's button, feedback: nothing to answer
        sender = message.sender.userid
        if not sender or not message.msgid:
            raise ApiError(400, "the message has no msgid or from.userid", code="invalid_callback")
        if not self._gate.admits(sender):
            return self._refuse(sender, message.msgid) if self._gate.first_refusal(sender) else None
        text = message.typed()
        typed = command(text) if text else None
        if text is None or typed is not None:
            return await self._one_off(message.msgid, sender, typed)
        if not text:
            return None
        return await self._turn(message, text)

    def _refuse(self, sender: str, message_id: str) -> dict[str, Any]:
        return stream_reply(stream_id_of(message_id), refusal("WeCom UserID", sender), finish=True)

    async def _one_off(self, message_id: str, sender: str, typed: tuple[str, str] | None) -> dict[str, Any]:
        """A finished stream answering a command or a message without text; a retry gets the same."""
        reply = self._replies.get(message_id)
        if reply is None:
            reply = ONLY_TEXT if typed is None else await self._commands.answer(sender, *typed)
            remember(self._replies, message_id, reply)
        return stream_reply(stream_id_of(message_id), reply, finish=True)

    async def _turn(self, message: BotMessage, text: str) -> dict[str, Any] | None:
        """Keep and publish the message; the reply opening its stream."""
        stream_id = stream_id_of(message.msgid)
        event = InboundEvent(channel=self.name, chat_id=message.chat_id, sender_id=message.sender.userid,
                             text=text, message_id=message.msgid, stream=True, can_approve=True)
        if not await self._inbox.accept(event):
            return self._refresh(stream_id)  # a retry of a kept message: its stream as it stands
        self._open(stream_id, _Stream(event.chat_id, self._clock() + self._window_s, message.response_url))
        await self._bus.publish_inbound(event)
        return stream_reply(stream_id, "", finish=False)

    def _refresh(self, stream_id: str) -> dict[str, Any] | None:
        """The stream's content so far; finish=true with the answer once it is in, or past the deadline.

        Looks and acts without an await, so the answer `deliver` waits with is shown by exactly one refresh.
        """
        stream = self._streams.get(stream_id)
        if stream is None:
            # Shown in full already (nothing more to say), or opened before a restart: its recovered turn
            # may still answer, so the platform is told to keep asking.
            return None if stream_id in self._finished else stream_reply(stream_id, "", finish=False)
        if stream.closed:
            return None
        if stream.final is not None:
            content, stream.final_shown = stream.final, True
        elif self._clock() >= stream.deadline:
            content = stream.text + (LATER if stream.response_url else TOO_LATE)
        else:
            return stream_reply(stream_id, stream.text, finish=False)
        stream.closed = True
        stream.done.set()
        return stream_reply(stream_id, content, finish=True)

    def _open(self, stream_id: str, stream: _Stream) -> None:
        remember(self._streams, stream_id, stream)

    def _forget(self, stream_id: str) -> None:
        self._streams.pop(stream_id, None)
        remember(self._finished, stream_id, None)

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        if event.kind is OutboundKind.DELTA:
            self._show(event, event.text)
        elif event.kind is OutboundKind.APPROVAL_REQUEST:
            note = hint(await self._commands.short_id(event))
            if not self._show(event, "\n\n" + event.text + note):
                log.warning("wecom_bot: the stream of turn %s has ended; its approval request cannot be shown "
                            "(it times out and is denied)", event.turn_id)
        elif event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
            await self._answer(event)

    def _show(self, event: OutboundEvent, text: str) -> bool:
        stream = self._streams.get(stream_id_of(event.reply_to or ""))
        if stream is None or stream.closed or stream.final is not None:
            return False
        stream.text = (stream.text + text).lstrip("\n")
        return True

    async def _answer(self, event: OutboundEvent) -> None:
        """Hand the committed answer to the stream's next refresh and wait for it, or else send it through
        the response_url; DeliveryRefused when neither can show it (it stays in the session's history)."""
        delivery = event.delivery_id
        if delivery is not None and await self._messages.finished(self.name, event.turn_id) == delivery:
            return  # shown already: a re-send after a restart
        stream_id = stream_id_of(event.reply_to or "")
        stream = self._streams.get(stream_id) or await self._reopen(event, stream_id)
        if stream is None:
            raise DeliveryRefused("WeCom no longer asks for this message's stream and no response_url is known")
        if not stream.closed:
            stream.final = event.text
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, stream.deadline - self._clock()) + REFRESH_GRACE_S):
                    await stream.done.wait()
            stream.closed = True  # a refresh after this gets nothing: the answer goes another way
        self._forget(stream_id)
        if not stream.final_shown:
            await self._send_later(stream, event.text)
        if delivery is not None:
            await self._messages.finish(self.name, event.turn_id, delivery, {0: digest(event.text)})

    async def _reopen(self, event: OutboundEvent, stream_id: str) -> _Stream | None:
        """After a restart: the stream of a kept message, while the platform may still be asking for it."""
        if event.reply_to is None:
            return None
        receipt = await self._inbox.receipt(self.name, event.chat_id, event.reply_to)
        if receipt is None or self._clock() >= receipt.received_at + self._window_s:
            return None
        stream = _Stream(event.chat_id, receipt.received_at + self._window_s, response_url="")
        self._open(stream_id, stream)
        return stream

    async def _send_later(self, stream: _Stream, text: str) -> None:
        url, stream.response_url = stream.response_url, ""  # a response_url takes one message
        if not url:
            raise DeliveryRefused("the stream ended before the answer, and no response_url is known")
        body = {"msgtype": "markdown", "markdown": {"content": _fit(text)}}
        try:
            response = await self._http.post(url, json=body)
            answer = response.json()
        except (httpx.HTTPError, ValueError) as exc:  # not tried again: the url may have been used up
            raise DeliveryRefused(f"WeCom's response_url failed: {type(exc).__name__}") from None
        code = answer.get("errcode", 0) if isinstance(answer, dict) else -2
        if response.status_code != 200 or code != 0:
            message = str(answer.get("errmsg", "") if isinstance(answer, dict) else "")[:300]
            raise DeliveryRefused(f"WeCom's response_url refused the answer: HTTP {response.status_code}, "
                                  f"errcode {code}: {message}")


