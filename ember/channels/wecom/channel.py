"""The `wecom` and `wechat` channels: a WeCom (企业微信) self-built app and a WeChat Official Account.

Both platforms push each message as a signed XML POST to /channels/NAME and wait 5 s for the answer;
without one they drop the connection and push the same MsgId again, three times. A text message is
kept in the store before anything is answered, so a retry finds it and runs no second turn; a retry
is answered empty at once.

The POST then waits up to `passive_reply_s` for the turn's first message (its answer, or an approval
request). If that comes in time and in one piece, it is the POST's response (a passive reply);
otherwise the POST answers empty and `deliver` sends the message through the send API. Exactly one of
the two: a waiting POST is an entry in `_windows`, and the POST closing it and `deliver` claiming it
each look and act without an await in between.

Answers are cut into messages of at most 2048 UTF-8 bytes (the platforms' limit for text). The parts
sent are recorded, so an answer re-sent after a restart sends none twice. There are no buttons: an
approval request is text naming a short id, answered by `/approve ID`, `/always ID` or `/deny ID` from
the turn's person or an approver; such a command is no turn.

A picture is fetched by its MediaId and kept with the message; a voice message is read by the
transcript an Official Account adds where its speech recognition is on. Other messages get a short
note; events (a follow, a menu click) are answered empty. An answer's files follow its text, each a
message of its own (from part 1000 on), named at the end of the text where the platform cannot send
them (an Official Account sends pictures only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ember.channels.attachments import not_taken
from ember.channels.chat.commands import ApprovalCommands, command, hint
from ember.channels.chat.editing import FILE_PARTS, digest
from ember.channels.chat.inbound import AllowList, refusal, remember
from ember.channels.chat.plain import plain_text
from ember.channels.chat.platform import required, show_answers_only
from ember.channels.chat.services import ChatServices
from ember.channels.chat.split import split_message
from ember.channels.gateway.http import ApiError, read_body
from ember.channels.wecom.api import (
    CredentialsRefused,
    PlatformUnavailable,
    WeixinApi,
    official_endpoints,
    wecom_endpoints,
)
from ember.channels.wecom.callback import CallbackEndpoint, Callbacks, OfficialCallbacks, WeComCallbacks
from ember.channels.wecom.config import WeChatOfficialSpec, WeComSpec
from ember.channels.wecom.crypto import MAX_XML_CHARS, text_reply
from ember.core.attachments import AttachmentContent, AttachmentRefused
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.errors import ConfigError
from ember.core.events import InboundEvent, OutboundEvent

MAX_MESSAGE_BYTES = 2048
ONLY_TEXT = "Sorry, I can only read text messages."
NOT_READ = "Sorry, I can only read text, pictures and voice messages the platform has transcribed."

log = logging.getLogger(__name__)


def byte_pieces(text: str, limit: int) -> list[str]:
    """`text` cut where `split_message` would cut it, in pieces of at most `limit` UTF-8 bytes."""
    return _pieces(text, limit, limit)


def _pieces(text: str, limit: int, chars: int) -> list[str]:
    pieces: list[str] = []
    for piece in split_message(text, chars):
        size = len(piece.encode())
        # Too many bytes (CJK, emoji): cut again, with fewer characters in the same proportion.
        pieces += [piece] if size <= limit else _pieces(piece, limit, max(1, len(piece) * limit // size))
    return pieces


@dataclass(frozen=True, slots=True)
class Platform:
    """What one app's channel talks through, and whom it talks to."""

    callbacks: Callbacks
    api: WeixinApi
    allowed_users: frozenset[str]  # empty: everyone the platform lets write to the app
    approvers: frozenset[str]
    passive_reply_s: float


class _WeixinChannel(CallbackEndpoint):
    _callbacks: Callbacks
    name: str
    path: str
    id_label: str  # what the platform calls a person's id, for the refusal
    everyone: str  # who may write when allowed_users is empty
    empty_answer: str  # the response that answers a push with nothing
    # Any text of this many characters fits one message (UTF-8 takes at most 4 bytes a character);
    # answers are cut by their bytes, so most messages carry more.
    capabilities = ChannelCapabilities(max_message_chars=MAX_MESSAGE_BYTES // 4, approvals=True, confirms_delivery=True)

    def __init__(self, platform: Platform, services: ChatServices) -> None:
        self._callbacks = platform.callbacks
        self._api = platform.api
        self._gate: AllowList[str] = AllowList(self.name, platform.allowed_users)
        self._passive_reply_s = platform.passive_reply_s
        self._bus = services.bus
        self._inbox = services.inbox
        self._messages = services.messages
        self._files = services.files
        self._commands = ApprovalCommands(self.name, services, platform.approvers)
        # (chat id, message id) -> the text its POST answers with; None: it answers empty.
        self._windows: dict[tuple[str, str], asyncio.Future[str | None]] = {}
        self._answered: dict[str, None] = {}  # commands and other one-off pushes, by message id

    async def start(self) -> None:
        try:
            await self._api.check()  # a wrong id or secret fails the start; nothing is sent
        except CredentialsRefused as exc:
            raise ConfigError(f"[{self.name}] {exc}") from None
        except PlatformUnavailable as exc:
            log.warning("%s: %s; answers wait until it can be reached", self.name, exc)
        if self._gate.everyone:
            log.warning("[%s] allowed_users is empty: %s may talk to the agent", self.name, self.everyone)

    async def stop(self) -> None:
        for window in self._windows.values():
            if not window.done():
                window.set_result(None)  # answered empty: the answer stays owed, sent after the restart
        await self._api.aclose()

    # In

    async def receive(self, request: Request) -> Response:
        deadline = asyncio.get_running_loop().time() + self._passive_reply_s
        callback = self._callbacks.open(request.query_params, await read_body(request, MAX_XML_CHARS))
        fields = callback.fields
        reply = await self._handle(fields, deadline)
        if reply is None:
            return PlainTextResponse(self.empty_answer)
        xml = text_reply(fields.get("FromUserName", ""), fields.get("ToUserName", ""), reply,
                         create_time=int(time.time()))
        return Response(self._callbacks.seal(callback, xml), media_type="application/xml")

    async def _handle(self, fields: Mapping[str, str], deadline: float) -> str | None:
        """The passive reply to a push, or None: answered empty."""
        sender, kind = fields.get("FromUserName", ""), fields.get("MsgType", "")
        if not sender or not kind:
            raise ApiError(400, "the message has no FromUserName or MsgType", code="invalid_callback")
        self._check_recipient(fields)
        if kind == "event":
            return None  # a follow, a menu click, entering the app: nothing to answer
        if not self._gate.admits(sender):
            return refusal(self.id_label, sender) if self._gate.first_refusal(sender) else None
        message_id = fields.get("MsgId") or f"{sender}:{fields.get('CreateTime', '')}"
        text = fields.get({"text": "Content", "voice": "Recognition"}.get(kind, ""), "").strip()
        typed = command(text)
        if typed or not (text or kind == "image"):
            if not self._first_time(message_id):
                return None  # a retry: answered already
            if typed is None:
                return NOT_READ if kind != "text" else None
            return await self._commands.answer(sender, *typed)
        try:
            files = [await self._picture(fields)] if kind == "image" else []
        except (AttachmentRefused, DeliveryRefused, PlatformUnavailable, ValueError, httpx.HTTPError) as exc:
            return not_taken(exc) if self._first_time(message_id) else None  # said once; nothing is kept
        event = InboundEvent(channel=self.name, chat_id=sender, sender_id=sender, text=text, message_id=message_id,
                             stream=False, can_approve=True,
                             attachments=await self._files.keep(f"{self.name}:{sender}", files))
        return await self._turn(event, deadline)

    async def _picture(self, fields: Mapping[str, str]) -> AttachmentContent:
        data = await self._api.media(fields.get("MediaId", ""), self._files.max_bytes)
        return self._files.checked(data, declared=None, name=f"picture-{fields.get('MsgId') or 'sent'}")

    def _check_recipient(self, fields: Mapping[str, str]) -> None:
        """Refuse a message meant for another app sharing this one's keys."""

    def _first_time(self, message_id: str) -> bool:
        if message_id in self._answered:
            return False
        remember(self._answered, message_id, None)
        return True

    async def _turn(self, event: InboundEvent, deadline: float) -> str | None:
        """Keep and publish the message; its turn's first message, if it comes before `deadline`."""
        if not await self._inbox.accept(event):
            return None  # a retry of a kept message: its turn runs, and answers, once
        assert event.message_id is not None
        key = (event.chat_id, event.message_id)
        window = self._windows[key] = asyncio.get_running_loop().create_future()
        try:
            await self._bus.publish_inbound(event)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(window)
        finally:
            del self._windows[key]  # closed: from here on `deliver` sends through the API
        return window.result() if window.done() else None

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        await show_answers_only(event, ask=self._ask, answer=self._answer, sends_files=True)

    async def _answer(self, event: OutboundEvent) -> None:
        delivery = event.delivery_id
        finished = await self._messages.finished(self.name, event.turn_id) if delivery is not None else None
        if delivery is not None and finished == delivery:
            return  # shown already: a re-send after a restart
        text, files = await self._files.outgoing(event, self._api.can_send)
        # A text message shows its characters as they are: Markdown markers would show too.
        pieces = byte_pieces(plain_text(text), MAX_MESSAGE_BYTES) if text.strip() else []
        if self._claim(event, pieces[0] if len(pieces) == 1 else None):
            sent: dict[int, str] = {0: f"passive:{event.reply_to}"}
            if delivery is not None:
                await self._messages.record(self.name, event.chat_id, event.turn_id, 0, sent[0])
        else:  # the parts a cut-off send of this answer got out (an earlier answer's parts are sent over)
            sent = await self._messages.parts(self.name, event.turn_id) if delivery is not None and finished is None \
                else {}
        shown = {part: digest(piece) for part, piece in enumerate(pieces)}
        shown |= {part: file.digest[:16] for part, file in enumerate(files, start=FILE_PARTS)}
        for part in shown:
            if part in sent:
                continue
            message_id = await (self._api.send_text(event.chat_id, pieces[part]) if part < FILE_PARTS
                                else self._api.send_file(event.chat_id, files[part - FILE_PARTS]))
            if delivery is not None:
                await self._messages.record(self.name, event.chat_id, event.turn_id, part,
                                            message_id or f"{delivery}:{part}")
        if delivery is not None:
            await self._messages.finish(self.name, event.turn_id, delivery, shown)

    async def _ask(self, event: OutboundEvent) -> None:
        note = hint(await self._commands.short_id(event))
        text = byte_pieces(event.text, MAX_MESSAGE_BYTES - len(note.encode()))[0] + note
        if not self._claim(event, text):
            await self._api.send_text(event.chat_id, text)

    def _claim(self, event: OutboundEvent, text: str | None) -> bool:
        """Hand `text` to the POST still waiting for this turn's first message, if there is one (None: it
        answers empty now). True when `text` is that POST's passive reply, so nothing is to be sent."""
        window = self._windows.get((event.chat_id, event.reply_to or ""))
        if window is None or window.done():
            return False
        window.set_result(text)
        return text is not None


class WeComChannel(_WeixinChannel):
    """A WeCom self-built app (企业微信自建应用), its "receive messages" API pointed at /channels/wecom."""

    name = "wecom"
    path = "/channels/wecom"
    id_label = "WeCom UserID"
    everyone = "every member of the corp who can see the app"
    empty_answer = ""  # an empty 200: answered, nothing to show

    def __init__(self, spec: WeComSpec, services: ChatServices, *,
                 http: httpx.AsyncClient | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        secret = required(spec.key(), "[wecom] needs the app's secret: secret = \"…\" or EMBER_WECOM_SECRET")
        self._agent_id = str(spec.agent_id)
        callbacks = WeComCallbacks(spec.token.get_secret_value(), spec.encoding_aes_key.get_secret_value(),
                                   spec.corp_id)
        api = WeixinApi(spec.api_base_url, wecom_endpoints(spec.corp_id, secret, spec.agent_id), secret, http=http,
                        clock=clock)
        super().__init__(Platform(callbacks, api, frozenset(spec.allowed_users), frozenset(spec.approvers),
                                  spec.passive_reply_s), services)

    def _check_recipient(self, fields: Mapping[str, str]) -> None:
        agent_id = fields.get("AgentID")
        if agent_id and agent_id != self._agent_id:
            raise ApiError(403, f"the message is for agent {agent_id[:16]}, not this app ({self._agent_id})",
                           code="wrong_agent")


class WeChatOfficialChannel(_WeixinChannel):
    """A WeChat Official Account (微信公众号), its server configuration pointed at /channels/wechat."""

    name = "wechat"
    path = "/channels/wechat"
    id_label = "OpenID"
    everyone = "everyone who follows the account"
    empty_answer = "success"  # what the platform asks for when there is no passive reply

    def __init__(self, spec: WeChatOfficialSpec, services: ChatServices, *,
                 http: httpx.AsyncClient | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        secret = required(spec.key(), "[wechat] needs the account's AppSecret: secret = \"…\" or EMBER_WECHAT_SECRET")
        key = spec.encoding_aes_key.get_secret_value() if spec.encoding_aes_key is not None else None
        callbacks = OfficialCallbacks(spec.token.get_secret_value(), key, spec.app_id)
        api = WeixinApi(spec.api_base_url, official_endpoints(spec.app_id, secret), secret, http=http, clock=clock)
        super().__init__(Platform(callbacks, api, frozenset(spec.allowed_users), frozenset(spec.approvers),
                                  spec.passive_reply_s), services)


async def probe(spec: WeComSpec | WeChatOfficialSpec) -> str:
    """Whether the id and secret work (a token is fetched; nothing is sent): a line to show, or ConfigError."""
    secret = required(spec.key(), "the secret is not set")
    endpoints = wecom_endpoints(spec.corp_id, secret, spec.agent_id) if isinstance(spec, WeComSpec) \
        else official_endpoints(spec.app_id, secret)
    api = WeixinApi(spec.api_base_url, endpoints, secret)
    try:
        await api.check()
    except PlatformUnavailable as exc:
        raise ConfigError(str(exc)) from None
    finally:
        await api.aclose()
    return f"{api.platform} issued an access token"


