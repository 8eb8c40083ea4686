"""The `telegram` channel, on python-telegram-bot's `Bot`.

Updates come by long polling (getUpdates) or, in webhook mode, as POSTs to
`/channels/telegram` carrying the configured secret token. Each message is
kept in the store before its update is confirmed (the next getUpdates offset,
or the webhook's 200), so a crash loses none; a replayed update has the same
chat and message id and never runs a second turn. Answers stream by editing
one draft (channels/chat/editing.py); an approval is a card with buttons that
only the turn's person (or a configured approver) can press.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from datetime import timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from telegram import Bot, InlineKeyboardButton, InlineKeyboardMarkup, InputFile, ReplyParameters, Update
from telegram.constants import ChatAction, ParseMode
from telegram.error import BadRequest, Forbidden, InvalidToken, RetryAfter, TelegramError

from ember.channels.attachments import not_taken
from ember.channels.chat.commands import NOT_YOURS, decided, outcome_note
from ember.channels.chat.editing import EditStream, MessageGone, RateLimited
from ember.channels.chat.inbound import AllowList, refusal
from ember.channels.chat.platform import required, show_streamed
from ember.channels.chat.services import ChatServices
from ember.channels.chat.split import split_message
from ember.channels.gateway.http import ApiError, read_body
from ember.channels.telegram.config import TelegramSpec
from ember.channels.telegram.files import file_base_url, message_files
from ember.channels.telegram.markup import telegram_html
from ember.core.attachments import AttachmentContent, AttachmentRefused
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.errors import ConfigError, ModelError
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.redact import REDACTED
from ember.core.tools import Decision
from ember.runtime.approvals import Resolution

CHANNEL = "telegram"
TOKEN_REFUSED = "Telegram refused the bot token (401 Unauthorized): check [telegram] token or EMBER_TELEGRAM_TOKEN"
WEBHOOK_PATH = "/channels/telegram"
MAX_MESSAGE_CHARS = 4_096
TYPING_EVERY_S = 4.5  # Telegram shows "typing…" for 5 s
# callback_data is at most 64 bytes: "ap:" + a 32-character approval id + ":" + a short code.
DECISIONS = {"once": Decision.APPROVE_ONCE, "session": Decision.APPROVE_SESSION, "deny": Decision.DENY}
DECIDED = {Decision.APPROVE_ONCE: "Allowed once", Decision.APPROVE_SESSION: "Allowed for this session",
           Decision.DENY: "Denied"}

log = logging.getLogger(__name__)


def _replying(reply_to: str | None) -> ReplyParameters | None:
    return ReplyParameters(int(reply_to), allow_sending_without_reply=True) if reply_to and reply_to.isdigit() else None


def _seconds(value: int | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


async def probe(spec: TelegramSpec) -> str:
    """Whether the token works (getMe; nothing is sent): the bot's name, or TelegramError."""
    token = spec.key()
    if not token:
        raise ConfigError("[telegram] needs the bot's token: token = \"…\" or EMBER_TELEGRAM_TOKEN")
    try:
        async with Bot(token, base_url=spec.api_base_url) as bot:
            me = await bot.get_me()
    except InvalidToken:
        raise ConfigError(TOKEN_REFUSED) from None
    return f"@{me.username}"


class TelegramPlatform:
    """Send, edit and delete through the Bot API, as EditStream needs them."""

    def __init__(self, bot: Bot) -> None:
        self._bot = bot

    async def send(self, chat_id: str, text: str, *, reply_to: str | None = None,
                   buttons: InlineKeyboardMarkup | None = None) -> str:
        message = await self._call(lambda html: self._bot.send_message(
            int(chat_id), html if html is not None else text, parse_mode=ParseMode.HTML if html is not None else None,
            reply_parameters=_replying(reply_to), reply_markup=buttons), text)
        return str(message.message_id)

    async def send_file(self, chat_id: str, file: AttachmentContent, *, reply_to: str | None = None) -> str:
        """A picture as a photo, an Ogg recording as a voice note, other audio as audio, else a document."""
        send = (self._bot.send_photo if file.media_type in ("image/png", "image/jpeg")
                else self._bot.send_voice if file.media_type == "audio/ogg"
                else self._bot.send_audio if file.is_audio else self._bot.send_document)
        upload = InputFile(file.data, filename=file.name or "file")
        message = await self._call(lambda _: send(int(chat_id), upload, reply_parameters=_replying(reply_to)), "")
        return str(message.message_id)

    async def edit(self, chat_id: str, message_id: str, text: str,
                   buttons: InlineKeyboardMarkup | None = None) -> None:
        await self._call(lambda html: self._bot.edit_message_text(
            html if html is not None else text, chat_id=int(chat_id), message_id=int(message_id),
            parse_mode=ParseMode.HTML if html is not None else None, reply_markup=buttons), text)

    async def delete(self, chat_id: str, message_id: str) -> None:
        # Gone already, or too old to delete: nothing of it is shown twice either way.
        with contextlib.suppress(BadRequest):
            await self._bot.delete_message(int(chat_id), int(message_id))

    async def _call(self, request: Any, text: str) -> Any:
        """`request(html)` with the text as HTML; plain text if Telegram cannot parse the HTML."""
        html: str | None = telegram_html(text)
        while True:
            try:
                return await request(html)
            except RetryAfter as exc:
                raise RateLimited(_seconds(exc.retry_after)) from None
            except Forbidden as exc:  # blocked by the person, or removed from the group: for good
                raise DeliveryRefused(f"Telegram refused: {exc.message}") from None
            except BadRequest as exc:
                problem = exc.message.lower()
                if "not modified" in problem:
                    return None
                if "message to edit not found" in problem:
                    raise MessageGone(exc.message) from None
                if "parse" in problem and html is not None:
                    html = None  # the formatting was refused: the same text, plain
                    continue
                raise DeliveryRefused(f"Telegram refused: {exc.message}") from None


class TelegramChannel:
    name = CHANNEL
    capabilities = ChannelCapabilities(streams=True, edits=True, buttons=True, approvals=True,
                                       max_message_chars=MAX_MESSAGE_CHARS,
                                       confirms_delivery=True)

    def __init__(self, spec: TelegramSpec, services: ChatServices, *,
                 public_url: str | None = None, bot: Bot | None = None) -> None:
        token = required(spec.key(), "[telegram] needs the bot's token: token = \"…\" or EMBER_TELEGRAM_TOKEN")
        self._spec = spec
        self._token = token
        self._bus = services.bus
        self._inbox = services.inbox
        self._services = services
        self._public_url = public_url
        self._bot = bot or Bot(token, base_url=spec.api_base_url, base_file_url=file_base_url(spec.api_base_url))
        self._files = services.files
        self._platform = TelegramPlatform(self._bot)
        self._stream = EditStream(self._platform, services.messages, CHANNEL, interval_s=spec.edit_interval_ms / 1000,
                                  limit=MAX_MESSAGE_CHARS, files=services.files)
        self._gate: AllowList[int] = AllowList(CHANNEL, spec.allowed_users, empty_refuses=True)
        self._approvers = frozenset(str(user) for user in spec.approvers)
        self._typing: dict[str, asyncio.Task[None]] = {}
        self._poller: asyncio.Task[None] | None = None
        self.username = ""
        self._bot_id = 0

    async def start(self) -> None:
        try:
            await self._bot.initialize()  # getMe: a wrong token fails the start
        except InvalidToken:
            raise ConfigError(TOKEN_REFUSED) from None  # the SDK's message would carry the token itself
        self.username, self._bot_id = self._bot.username, self._bot.id
        if not self._spec.allowed_users:
            log.warning("[telegram] allowed_users is empty: the bot refuses everyone")
        if self._spec.mode == "webhook":
            if not self._public_url:
                raise ConfigError("telegram webhook mode needs gateway_public_url (the https address "
                                  "Telegram can reach)")
            secret = self._spec.webhook_secret
            assert secret is not None
            await self._bot.set_webhook(self._public_url.rstrip("/") + WEBHOOK_PATH,
                                        secret_token=secret.get_secret_value(),
                                        allowed_updates=["message", "callback_query"])
        else:
            await self._bot.delete_webhook()
            self._poller = asyncio.create_task(self._poll(), name="ember-telegram-poll")
        log.info("telegram: @%s is %s", self.username, "polling" if self._poller else "called back")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for task in self._typing.values():
            task.cancel()
        await asyncio.gather(*self._typing.values(), return_exceptions=True)
        self._typing = {}
        await self._stream.close()
        await self._bot.shutdown()

    # In

    async def _poll(self) -> None:
        offset: int | None = None
        backoff = 1.0
        while True:
            try:
                updates = await self._bot.get_updates(
                    offset=offset, timeout=self._spec.poll_timeout_s, read_timeout=self._spec.poll_timeout_s + 10,
                    allowed_updates=["message", "callback_query"])
                backoff = 1.0
            except RetryAfter as exc:
                await asyncio.sleep(_seconds(exc.retry_after))
                continue
            except TelegramError as exc:
                log.warning("telegram: getUpdates failed (%s); trying again in %.0f s", self._hide(exc), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 60.0)
                continue
            # Confirmed by the next call's offset, once their messages are kept.
            await self._handle(*updates)
            if updates:
                offset = updates[-1].update_id + 1

    def routes(self) -> list[Route]:
        return [Route(WEBHOOK_PATH, self.receive, methods=["POST"])] if self._spec.mode == "webhook" else []

    async def receive(self, request: Request) -> Response:
        secret = self._spec.webhook_secret
        given = request.headers.get("X-Telegram-Bot-Api-Secret-Token", "")
        if secret is None or not hmac.compare_digest(given.encode(), secret.get_secret_value().encode()):
            raise ApiError(401, "not Telegram: the secret token is missing or wrong", code="invalid_secret")
        try:
            update = Update.de_json(json.loads(await read_body(request, 1_048_576)), self._bot)
        except (ValueError, TypeError, KeyError) as exc:
            raise ApiError(400, f"not a Telegram update: {exc}", code="invalid_update") from None
        if update is not None:
            await self._handle(update)
        return JSONResponse({"ok": True})

    async def _handle(self, *updates: Update) -> None:
        """Keep the updates' messages (in one group commit), then start their turns in order."""
        events = []
        for update in updates:
            if update.callback_query is not None:
                await self._tapped(update)
            elif (event := await self._message(update)) is not None:
                events.append(event)
        kept = await asyncio.gather(*(self._inbox.accept(event) for event in events))
        for event, new in zip(events, kept):
            if new:  # else a replayed update: its turn ran, or runs, once
                self._start_typing(event.chat_id)
                await self._bus.publish_inbound(event)

    async def _message(self, update: Update) -> InboundEvent | None:
        """The update's message as the agent's, if it is one to answer."""
        message = update.message
        if message is None or message.from_user is None or not (
                message.text or message.caption or message.photo or message.document or message.voice or message.audio):
            return None
        user = message.from_user
        if not self._gate.admits(user.id):
            if self._gate.first_refusal(user.id):
                await self._quietly(self._bot.send_message(message.chat_id, refusal("Telegram user id", user.id)))
            return None
        text = message.text or message.caption or ""
        if message.chat.type in ("group", "supergroup") and self._spec.group_replies == "mention":
            mention = f"@{self.username}"
            replied = message.reply_to_message is not None and message.reply_to_message.from_user is not None \
                and message.reply_to_message.from_user.id == self._bot_id
            if mention.lower() not in text.lower() and not replied:
                return None
            text = text.replace(mention, "").strip() or text
        try:
            files = await message_files(self._bot, message, self._files)
            text = await self._files.heard(text, files)
        except (AttachmentRefused, TelegramError, ModelError) as exc:  # said in the chat; nothing is kept
            told = "Telegram did not hand it over; send it again" if isinstance(exc, TelegramError) else exc
            await self._quietly(self._bot.send_message(message.chat_id, not_taken(told)))
            return None
        chat_id = str(message.chat_id)
        return InboundEvent(channel=CHANNEL, chat_id=chat_id, sender_id=str(user.id), text=text,
                            message_id=str(message.message_id), sender_name=user.full_name or None,
                            stream=True, can_approve=True,
                            attachments=await self._files.keep(f"{CHANNEL}:{chat_id}", files))

    def _start_typing(self, chat_id: str) -> None:
        if chat_id not in self._typing or self._typing[chat_id].done():
            self._typing[chat_id] = asyncio.create_task(self._type(chat_id), name="ember-telegram-typing")

    async def _type(self, chat_id: str) -> None:
        for _ in range(40):  # at most 3 minutes of "typing…" without any text
            if self._stream.started(chat_id):
                return
            await self._quietly(self._bot.send_chat_action(int(chat_id), ChatAction.TYPING))
            await asyncio.sleep(TYPING_EVERY_S)

    def _stop_typing(self, chat_id: str) -> None:
        task = self._typing.pop(chat_id, None)
        if task is not None:
            task.cancel()

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        if event.kind in (OutboundKind.DELTA, OutboundKind.FINAL, OutboundKind.ERROR):
            self._stop_typing(event.chat_id)  # text is coming
        await show_streamed(event, self._stream, ask=self._ask)

    async def _ask(self, event: OutboundEvent) -> None:
        assert event.approval is not None
        approval_id = event.approval.id
        buttons = InlineKeyboardMarkup([[
            InlineKeyboardButton("Allow once", callback_data=f"ap:{approval_id}:once"),
            InlineKeyboardButton("Always in this chat", callback_data=f"ap:{approval_id}:session"),
            InlineKeyboardButton("Deny", callback_data=f"ap:{approval_id}:deny"),
        ]])
        text = split_message(event.text, MAX_MESSAGE_CHARS)[0]
        await self._retrying(lambda: self._platform.send(event.chat_id, text, buttons=buttons))

    async def _tapped(self, update: Update) -> None:
        query = update.callback_query
        assert query is not None
        kind, _, rest = (query.data or "").partition(":")
        approval_id, _, code = rest.partition(":")
        if kind != "ap" or code not in DECISIONS:
            await self._quietly(query.answer())
            return
        decision, user = DECISIONS[code], str(query.from_user.id)
        outcome = await decided(self._services, CHANNEL, self._approvers, approval_id, decision, user)
        if outcome is None:
            await self._quietly(query.answer(NOT_YOURS, show_alert=True))
            return
        card = query.message
        note = outcome_note(outcome, f"{DECIDED[decision]} by {query.from_user.full_name}.")
        answer = {Resolution.RESOLVED: DECIDED[decision], Resolution.EXPIRED: "Expired"}.get(outcome,
                                                                                             "Answered already")
        await self._quietly(query.answer(answer))
        if card is not None and getattr(card, "text", None) is not None:
            await self._quietly(self._platform.edit(str(card.chat.id), str(card.message_id),
                                                    f"{card.text}\n\n{note}"))

    async def _retrying(self, write: Any) -> Any:
        while True:
            try:
                return await write()
            except RateLimited as limited:
                await asyncio.sleep(limited.retry_after_s)

    async def _quietly(self, call: Any) -> None:
        """A courtesy (typing, a refusal, a card's note): its failure must not stop the channel."""
        try:
            await call
        except (TelegramError, RateLimited, DeliveryRefused, MessageGone) as exc:
            log.info("telegram: %s", self._hide(exc))

    def _hide(self, error: BaseException) -> str:
        """An error's text without the token (the SDK's URLs carry it)."""
        return str(error).replace(self._token, REDACTED)
