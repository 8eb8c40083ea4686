"""The `feishu` channel: a Feishu (飞书) or Lark app's bot, by event subscription or long connection.

Feishu POSTs each event to `/channels/feishu/events`: with an Encrypt Key set, encrypted and
signed (api.py), and refused 401 when the signature is wrong; every event must carry the
Verification Token. The URL check (`url_verification`) is answered with its challenge. A message
is kept in the store before Feishu gets its 200, so a crash loses none, and one Feishu sends again
(same message_id) runs no second turn. A direct chat is a session; so is a group, where only
messages that @-mention the bot are answered unless `group_replies = "all"`. With `mode =
"websocket"` the same events come on the long connection Ember opens (longconn.py), plain, and
each is acknowledged once kept.

The answer is a card that replies to the message and is updated in place as the answer streams
(channels/chat/editing.py), at most every `edit_interval_ms`, waiting out Feishu's rate limits. An
approval is a card with buttons; Feishu sends the press (`card.action.trigger`) to the same URL,
and only the turn's person (or an approver) can press.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.attachments import not_taken
from ember.channels.chat.commands import NOT_YOURS, decided, outcome_note
from ember.channels.chat.editing import EditStream, MessageGone, RateLimited
from ember.channels.chat.inbound import AllowList, refusal, remember
from ember.channels.chat.platform import required, show_streamed
from ember.channels.chat.services import ChatServices
from ember.channels.chat.split import split_message
from ember.channels.feishu.api import FeishuApi, card, decrypted, signed
from ember.channels.feishu.config import SECRET_ENV, FeishuSpec
from ember.channels.feishu.longconn import LongConnection, endpoint
from ember.channels.gateway.http import ApiError, read_body
from ember.core.attachments import AttachmentContent, AttachmentRefused
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.errors import ModelError
from ember.core.events import InboundEvent, OutboundEvent
from ember.core.tools import Decision
from ember.runtime.tasks import cancel_task

CHANNEL = "feishu"
EVENTS_PATH = "/channels/feishu/events"
MAX_MESSAGE_CHARS = 8_000  # a card's markdown; longer answers go on in more cards
DECISIONS = {"once": Decision.APPROVE_ONCE, "session": Decision.APPROVE_SESSION, "deny": Decision.DENY}
DECIDED = {Decision.APPROVE_ONCE: "Allowed once", Decision.APPROVE_SESSION: "Allowed for this chat",
           Decision.DENY: "Denied"}
_MENTION = re.compile(r"@_user_\d+\s*")
# The messages that carry a file: the key that names it, the resource type, a name for one unnamed.
_FILES = {"image": ("image_key", "image", "image.png"), "file": ("file_key", "file", "file"),
          "audio": ("file_key", "file", "voice.ogg")}

log = logging.getLogger(__name__)


async def probe(spec: FeishuSpec) -> str:
    """Whether the app id and secret work (a tenant access token is fetched, and in websocket mode a
    long-connection address; nothing is sent)."""
    secret = required(spec.secret(), f"[feishu] needs the app secret: app_secret = \"…\" or {SECRET_ENV}")
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        await FeishuApi(http, spec.api_base_url, spec.app_id, secret).token()
        if spec.mode == "websocket":
            await endpoint(http, spec.api_base_url, spec.app_id, secret)
            return f"app {spec.app_id} got a tenant access token and a long-connection address"
    return f"app {spec.app_id} got a tenant access token"


class FeishuPlatform:
    """Send, update and recall cards, as EditStream needs them."""

    def __init__(self, api: FeishuApi) -> None:
        self._api = api

    async def send(self, chat_id: str, text: str, *, reply_to: str | None = None) -> str:
        return await self._api.send_card(chat_id, card(text), reply_to=reply_to)

    async def edit(self, chat_id: str, message_id: str, text: str) -> None:
        await self._api.update_card(message_id, card(text))

    async def delete(self, chat_id: str, message_id: str) -> None:
        with contextlib.suppress(MessageGone):  # recalled already: nothing of it is shown twice
            await self._api.recall(message_id)

    async def send_file(self, chat_id: str, file: AttachmentContent, *, reply_to: str | None = None) -> str:
        return await self._api.send_file(chat_id, file, reply_to=reply_to)


class FeishuChannel:
    name = CHANNEL
    capabilities = ChannelCapabilities(streams=True, edits=True, buttons=True, approvals=True,
                                       max_message_chars=MAX_MESSAGE_CHARS, confirms_delivery=True)

    def __init__(self, spec: FeishuSpec, services: ChatServices, *, http: httpx.AsyncClient | None = None) -> None:
        secret = required(spec.secret(), f"[feishu] needs the app secret: app_secret = \"…\" or {SECRET_ENV}")
        self._spec = spec
        self._token = spec.verification_token.get_secret_value() if spec.verification_token else ""
        self._key = spec.encryption()
        self._http = http or httpx.AsyncClient(trust_env=False, timeout=15)
        self._api = FeishuApi(self._http, spec.api_base_url, spec.app_id, secret)
        self._services = services
        self._stream = EditStream(FeishuPlatform(self._api), services.messages, CHANNEL,
                                  interval_s=spec.edit_interval_ms / 1000, limit=MAX_MESSAGE_CHARS,
                                  files=services.files)
        self._gate: AllowList[str] = AllowList(CHANNEL, spec.allowed_users)
        self._seen: dict[str, None] = {}  # event ids of this run: Feishu's retries
        self._asked: dict[str, str] = {}  # approval id -> its card's question, shown again with the answer
        self.bot_open_id = ""
        self._link = (LongConnection(self._http, spec.api_base_url, spec.app_id, secret, self._handled)
                      if spec.mode == "websocket" else None)
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._api.token()  # bad credentials stop `ember serve`, saying which
        if self._link is not None:
            await self._link.opened()  # and so does an app that cannot open a long connection
        try:
            info = (await self._http.get(f"{self._spec.api_base_url.rstrip('/')}/open-apis/bot/v3/info",
                                         headers={"Authorization": f"Bearer {await self._api.token()}"})).json()
            self.bot_open_id = str((info.get("bot") or {}).get("open_id") or "")
        except (httpx.HTTPError, ValueError) as exc:  # then every group message counts as a mention
            log.warning("feishu: could not read the bot's open_id (%s)", exc)
        if self._link is not None:
            self._reader = asyncio.create_task(self._link.run(), name="ember-feishu-long-connection")

    async def stop(self) -> None:
        await cancel_task(self._reader)
        await self._stream.close()
        await self._http.aclose()

    def routes(self) -> list[Route]:
        return [] if self._link is not None else [Route(EVENTS_PATH, self.events, methods=["POST"])]

    # In

    async def events(self, request: Request) -> Response:
        body = await read_body(request, 1_048_576)
        payload = self._opened(body)
        if payload.get("type") == "url_verification":
            if payload.get("token") != self._token:
                raise ApiError(401, "not this app's Feishu: wrong verification token", code="invalid_token")
            return JSONResponse({"challenge": payload.get("challenge")})
        if self._key and not signed(request.headers, self._key, body):
            raise ApiError(401, "not Feishu: the signature is missing or wrong", code="invalid_signature")
        header = payload.get("header") if isinstance(payload.get("header"), dict) else {}
        if header.get("token") != self._token:
            raise ApiError(401, "not this app's Feishu: wrong verification token", code="invalid_token")
        return JSONResponse(await self._handled(payload))

    async def _handled(self, payload: dict[str, Any]) -> dict[str, Any]:
        """An event, posted and checked or from the long connection: Feishu's answer to it."""
        header = payload.get("header") if isinstance(payload.get("header"), dict) else {}
        event = payload.get("event") if isinstance(payload.get("event"), dict) else {}
        kind, event_id = header.get("event_type"), str(header.get("event_id") or "")
        if kind == "card.action.trigger":
            return {"toast": {"type": "info", "content": await self._pressed(event)}}
        if kind == "im.message.receive_v1" and event_id not in self._seen:
            await self._received(event)
            remember(self._seen, event_id, None)
        return {}

    def _opened(self, body: bytes) -> dict[str, Any]:
        """The event, decrypted where the app has an Encrypt Key (it must then come encrypted)."""
        try:
            payload = json.loads(body)
            if self._key:
                if not isinstance(payload, dict) or not isinstance(payload.get("encrypt"), str):
                    raise ValueError("the event is not encrypted, and [feishu] encrypt_key is set")
                payload = json.loads(decrypted(payload["encrypt"], self._key))
        except ValueError as exc:
            raise ApiError(400, f"not a Feishu event: {exc}", code="invalid_event") from None
        if not isinstance(payload, dict):
            raise ApiError(400, "not a Feishu event: not a JSON object", code="invalid_event")
        return payload

    async def _received(self, event: dict[str, Any]) -> None:
        sender = event.get("sender") or {}
        message = event.get("message") or {}
        user = str((sender.get("sender_id") or {}).get("open_id") or "")
        if sender.get("sender_type") != "user" or not user or not message.get("chat_id"):
            return  # a bot's own messages, and what is not a person's message
        chat_id, message_id = str(message["chat_id"]), str(message.get("message_id") or "")
        mentioned = {str((m.get("id") or {}).get("open_id")) for m in message.get("mentions") or []}
        if message.get("chat_type") == "group" and self._spec.group_replies == "mention" and self.bot_open_id \
                and self.bot_open_id not in mentioned:
            return
        if not self._gate.admits(user):
            if self._gate.first_refusal(user):
                await self._courtesy(chat_id, refusal("Feishu open_id", user), message_id)
            return
        try:
            files = await self._files_of(message)
            text = await self._services.files.heard(_text_of(message), files)
        except (AttachmentRefused, ValueError, httpx.HTTPError, ModelError) as exc:  # said; nothing is kept
            told = exc if isinstance(exc, AttachmentRefused | ModelError) else f"it could not be fetched ({exc})"
            await self._courtesy(chat_id, not_taken(told), message_id)
            return
        if not text and not files:
            return
        inbound = InboundEvent(channel=CHANNEL, chat_id=chat_id, sender_id=user, text=text, message_id=message_id,
                               stream=True, can_approve=True,
                               attachments=await self._services.files.keep(f"{CHANNEL}:{chat_id}", files))
        if message_id and await self._services.inbox.accept(inbound):
            await self._services.bus.publish_inbound(inbound)

    async def _files_of(self, message: dict[str, Any]) -> list[AttachmentContent]:
        kind = message.get("message_type")
        if kind not in _FILES:
            return []
        key_name, resource, default_name = _FILES[kind]
        content = json.loads(message.get("content") or "{}")
        shelf = self._services.files
        data = await self._api.resource(str(message.get("message_id")), str(content.get(key_name)), resource,
                                        shelf.max_bytes)
        return [shelf.checked(data, declared=None, name=str(content.get("file_name") or default_name))]

    async def _pressed(self, event: dict[str, Any]) -> str:
        """A button of an approval card: resolved if the presser may; the toast Feishu shows them."""
        value = (event.get("action") or {}).get("value") or {}
        user = str((event.get("operator") or {}).get("open_id") or "")
        approval_id, code = str(value.get("approval") or ""), str(value.get("decision") or "")
        if code not in DECISIONS:
            return NOT_YOURS
        decision = DECISIONS[code]
        outcome = await decided(self._services, CHANNEL, self._spec.approvers, approval_id, decision, user)
        if outcome is None:
            return NOT_YOURS
        note = outcome_note(outcome, f"{DECIDED[decision]}.")
        if card_id := str((event.get("context") or {}).get("open_message_id") or ""):
            question = self._asked.get(approval_id, "")
            with contextlib.suppress(RateLimited, DeliveryRefused, MessageGone, httpx.HTTPError):
                await self._api.update_card(card_id, card(f"{question}\n\n**{note}**".strip()))
        return note

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        await show_streamed(event, self._stream, ask=self._ask)

    async def _ask(self, event: OutboundEvent) -> None:
        assert event.approval is not None
        buttons = [{"tag": "button", "text": {"tag": "plain_text", "content": label}, "type": style,
                    "value": {"approval": event.approval.id, "decision": code}}
                   for code, label, style in (("once", "Allow once", "primary"),
                                              ("session", "Always in this chat", "default"),
                                              ("deny", "Deny", "danger"))]
        question = split_message(event.text, MAX_MESSAGE_CHARS)[0]
        remember(self._asked, event.approval.id, question)
        content = card(question, buttons)
        while True:
            try:
                await self._api.send_card(event.chat_id, content, reply_to=event.reply_to)
                return
            except RateLimited as limited:
                await asyncio.sleep(limited.retry_after_s)

    async def _courtesy(self, chat_id: str, text: str, reply_to: str | None) -> None:
        """A refusal: its failure must not stop the channel."""
        try:
            await self._api.send_card(chat_id, card(text), reply_to=reply_to or None)
        except (RateLimited, DeliveryRefused, MessageGone, httpx.HTTPError) as exc:
            log.info("feishu: could not answer in %s: %s", chat_id, exc)


def _text_of(message: dict[str, Any]) -> str:
    """What the person wrote: a text message's text (mentions dropped), or a rich post's words."""
    try:
        content = json.loads(message.get("content") or "{}")
    except ValueError:
        return ""
    if message.get("message_type") == "text":
        return _MENTION.sub("", str(content.get("text", ""))).strip()
    if message.get("message_type") == "post":
        post = content.get("content") if "content" in content else next(iter(content.values()), {}).get("content")
        words = [str(item.get("text", "")) for line in post or [] for item in line if isinstance(item, dict)]
        return " ".join(word for word in (str(content.get("title") or ""), *words) if word).strip()
    return ""
