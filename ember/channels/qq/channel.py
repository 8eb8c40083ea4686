"""The `qq` channel: the QQ official bot (QQ 机器人), called back over HTTP.

QQ posts every event to `/channels/qq`, signed with the bot secret (signing.py): a
call whose signature is missing or wrong is refused 401 before its body is read as
JSON. The callback-URL check (op 13) is answered with its signature. A message (op
0: C2C_MESSAGE_CREATE in a direct chat, GROUP_AT_MESSAGE_CREATE when the bot is
@-mentioned in a group) is kept in the store before the call is answered with the
HTTP callback ACK (op 12), so a crash loses none, and a replay, which QQ does send,
never runs a second turn.

QQ only takes replies: an answer goes back as replies to the message that asked,
numbered by msg_seq, at most five to one message (within 1 h in a direct chat, 5 min
in a group). The numbers come from a counter in the store, so none repeats across
restarts (QQ refuses a repeat), and each part is recorded as it is sent, so an answer
sent again after a crash sends only what is missing. QQ has no edits and no buttons:
an approval request is text, answered by the turn's person or a configured approver
with /approve, /always or /deny and the request's short id.

A message's pictures and files are fetched from the URLs QQ gives and kept with it; a
voice note is read by QQ's own transcript (`asr_refer_text`), else its WAV is heard
by the transcription model. An answer's pictures follow its text as replies of their
own (from part 1000 on); its other files are named at the end of the text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.attachments import capped, not_taken
from ember.channels.chat.commands import ApprovalCommands, hint
from ember.channels.chat.editing import FILE_PARTS, digest
from ember.channels.chat.inbound import AllowList, refusal, remember
from ember.channels.chat.plain import plain_text
from ember.channels.chat.platform import required, show_answers_only
from ember.channels.chat.services import ChatServices
from ember.channels.chat.split import split_message
from ember.channels.gateway.http import ApiError, read_body
from ember.channels.qq.api import AccessToken, QQApi, QQUnavailable, TokenRefused, can_send
from ember.channels.qq.config import SECRET_ENV, QQSpec
from ember.channels.qq.signing import (
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    VALIDATION_OP,
    QQSigner,
    ValidationPayloadError,
)
from ember.core.attachments import AttachmentContent, AttachmentRefused
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.errors import ConfigError, ModelError
from ember.core.events import InboundEvent, OutboundEvent

CHANNEL = "qq"
CALLBACK_PATH = "/channels/qq"
# The docs state no limit; 2,000 characters is the lowest QQ has been seen to enforce.
MAX_MESSAGE_CHARS = 2_000
MAX_REPLIES = 5  # QQ takes five replies to one message
MAX_BODY_BYTES = 1_048_576
TIMEOUT_S = 10.0  # the docs ask for at least 5 s: a send that timed out may still have landed
DISPATCH_OP = 0
ACK = {"op": 12, "d": 0}  # d = 1 would ask QQ to send the event again (botgo's GenDispatchACK)
DIRECT, GROUP = "C2C_MESSAGE_CREATE", "GROUP_AT_MESSAGE_CREATE"
MENTION = re.compile(r"^\s*<@!?[^>]*>")
COMMAND = re.compile(r"^/(approve|always|deny)\b\s*(\S*)\s*$", re.IGNORECASE)
CUT = "\n\n[The rest is cut: QQ takes at most five replies to one message.]"
SHORT_ID_CHARS = 6

log = logging.getLogger(__name__)


class _Callback(BaseModel):
    op: StrictInt
    t: str | None = None


class _Author(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_openid: str = ""  # a direct chat's
    member_openid: str = ""  # a group's: the same person has another one in every group


class _Attachment(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str = ""
    filename: str = ""
    content_type: str = ""  # a media type, or "voice" for a voice note (SILK at `url`)
    voice_wav_url: str = ""
    asr_refer_text: str = ""  # QQ's transcript of a voice note


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1)
    author: _Author
    content: str = ""
    group_openid: str = ""
    attachments: list[_Attachment] = Field(default_factory=list)


class _Dispatch(BaseModel):
    d: _Message


def _unescape(text: str) -> str:
    """QQ escapes &, < and > in what it passes on (message_format.md)."""
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


class QQChannel:
    name = CHANNEL
    # Answers only: a message QQ has shown cannot be edited to stream, and approvals are typed.
    capabilities = ChannelCapabilities(approvals=True, max_message_chars=MAX_MESSAGE_CHARS, confirms_delivery=True)

    def __init__(self, spec: QQSpec, services: ChatServices, *,
                 clock: Callable[[], float] = time.monotonic, http: httpx.AsyncClient | None = None) -> None:
        secret = required(spec.key(), "[qq] needs the bot's AppSecret: secret = \"…\" or EMBER_QQ_SECRET")
        self._app_id = spec.app_id
        self._bus = services.bus
        self._inbox = services.inbox
        self._messages = services.messages
        self._files = services.files
        self._approval_commands = ApprovalCommands(CHANNEL, services, frozenset(spec.approvers))
        self._signer = QQSigner(secret)
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=TIMEOUT_S)
        self._token = AccessToken(self._http, spec.token_url, spec.app_id, secret, clock)
        self._api = QQApi(self._http, spec.api_base_url, self._token)
        self._gate: AllowList[str] = AllowList(CHANNEL, spec.allowed_users)
        self._approvers = frozenset(spec.approvers)
        self._short_ids: dict[str, str] = {}  # what a request's text shows -> its approval id
        self._answered: dict[str, str] = {}  # approval commands answered (QQ may send one twice)
        self._replies: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        try:
            await self._token.get()  # a wrong app id or secret fails the start
        except TokenRefused as exc:
            raise ConfigError(str(exc)) from None
        except QQUnavailable as exc:
            log.warning("qq: %s; it is fetched again for the first reply", exc)
        if self._gate.everyone:
            log.warning("[qq] allowed_users is empty: everyone who can reach the bot may talk to it")
        log.info("qq: app %s is called back at %s", self._app_id, CALLBACK_PATH)

    async def stop(self) -> None:
        for task in self._replies:
            task.cancel()
        await asyncio.gather(*self._replies, return_exceptions=True)
        self._replies = set()
        if self._own_http:
            await self._http.aclose()

    # In

    def routes(self) -> list[Route]:
        return [Route(CALLBACK_PATH, self.receive, methods=["POST"])]

    async def receive(self, request: Request) -> Response:
        body = await read_body(request, MAX_BODY_BYTES)
        if not self._signer.verify(request.headers.get(HEADER_SIGNATURE, ""), request.headers.get(HEADER_TIMESTAMP, ""),
                                   body):
            raise ApiError(401, "not QQ: the callback's signature is missing or wrong", code="invalid_signature")
        try:
            payload = json.loads(body)
            callback = _Callback.model_validate(payload)
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or no op
            raise ApiError(400, f"not a QQ callback: {str(exc)[:200]}", code="invalid_callback") from None
        if callback.op == VALIDATION_OP:
            try:
                return JSONResponse(self._signer.validation_response(payload))
            except ValidationPayloadError as exc:
                raise ApiError(400, f"not a QQ callback-URL check: {exc}", code="invalid_callback") from None
        if callback.op == DISPATCH_OP and callback.t in (DIRECT, GROUP):
            try:
                message = _Dispatch.model_validate(payload).d
            except ValidationError as exc:  # sending it again would not mend it: it is acknowledged
                log.warning("qq: a %s event without its message fields (%s)", callback.t,
                            ", ".join(".".join(map(str, error["loc"])) for error in exc.errors()[:3]))
            else:
                await self._received(callback.t, message)
        return JSONResponse(ACK)

    async def _received(self, kind: str, message: _Message) -> None:
        if kind == DIRECT:
            sender, chat_id, text = message.author.user_openid, f"c2c:{message.author.user_openid}", message.content
        else:
            sender, chat_id = message.author.member_openid, f"group:{message.group_openid}"
            text = MENTION.sub("", message.content, count=1)
        if not sender or chat_id.endswith(":"):
            log.warning("qq: a %s message without its sender or group; ignored", kind)
            return
        text = _unescape(text).strip()
        command = COMMAND.match(text)
        if not self._may_talk(sender, command is not None):
            if self._gate.first_refusal(sender):
                # Reply 1 of its message, from no counter: nothing of a stranger's is stored.
                self._later(self._reply(chat_id, refusal("QQ openid", sender), message.id, seq=1))
            return
        if command is not None:
            if message.id not in self._answered:
                remember(self._answered, message.id, sender)
                self._later(self._decide(chat_id, sender, message.id, command[1].lower(), command[2]))
            return
        try:
            files = [await self._fetched(a) for a in message.attachments if not a.asr_refer_text]
            transcripts = [a.asr_refer_text.strip() for a in message.attachments if a.asr_refer_text]
            text = await self._files.heard("\n\n".join(part for part in (text, *transcripts) if part), files)
        except (AttachmentRefused, ModelError, ValueError, httpx.HTTPError) as exc:  # said; nothing is kept
            told = exc if isinstance(exc, AttachmentRefused | ModelError) else f"it could not be fetched ({exc})"
            self._later(self._reply(chat_id, not_taken(told), message.id))
            return
        if not text and not files:
            return
        event = InboundEvent(channel=CHANNEL, chat_id=chat_id, sender_id=sender, text=text, message_id=message.id,
                             stream=False, can_approve=True,
                             attachments=await self._files.keep(f"{CHANNEL}:{chat_id}", files))
        if await self._inbox.accept(event):  # False: a replay, whose turn ran, or runs, once
            await self._bus.publish_inbound(event)

    async def _fetched(self, attachment: _Attachment) -> AttachmentContent:
        """An attachment's bytes, from its URL (a voice note's WAV); checked as every file is."""
        voice = attachment.content_type == "voice"
        url = attachment.voice_wav_url if voice else attachment.url
        if not url:
            raise ValueError("QQ gave no URL for it")
        url = f"https:{url}" if url.startswith("//") else url
        async with self._http.stream("GET", url) as response:
            response.raise_for_status()
            data = await capped(response, self._files.max_bytes)
        name = "voice.wav" if voice else attachment.filename or None
        return self._files.checked(data, declared=None if voice else attachment.content_type or None, name=name)

    def _may_talk(self, sender: str, command: bool) -> bool:
        return self._gate.admits(sender) or (command and sender in self._approvers)

    async def _decide(self, chat_id: str, sender: str, message_id: str, verb: str, given: str) -> None:
        """An approval command: resolved if it is the sender's to answer; they are told how it went."""
        if not given:
            text = "Which request? Reply /approve ID or /deny ID, with the ID the request showed."
        else:
            text = await self._approval_commands.answer(sender, verb, self._short_ids.get(given.lower(), given.lower()))
        await self._reply(chat_id, text, message_id)

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        await show_answers_only(event, ask=self._ask, answer=self._answer, sends_files=True)

    async def _ask(self, event: OutboundEvent) -> None:
        assert event.approval is not None
        short = self._short_id(event.approval.id)
        how = hint(short)
        text = split_message(event.text, MAX_MESSAGE_CHARS - len(how))[0] + how
        await self._api.reply(event.chat_id, text, msg_id=event.reply_to, msg_seq=await self._seq(event.reply_to))

    async def _answer(self, event: OutboundEvent) -> None:
        """The answer, in parts of at most MAX_MESSAGE_CHARS; the parts a run before sent are not sent again."""
        if event.delivery_id is not None and await self._messages.finished(CHANNEL, event.turn_id) \
                == event.delivery_id:
            return  # shown already (a re-send after a restart, a replayed message)
        text, pictures = await self._files.outgoing(event, can_send)
        pieces = split_message(plain_text(text), MAX_MESSAGE_CHARS)  # QQ shows text as it is
        digests = {part: digest(text) for part, text in enumerate(pieces)}
        shown = await self._messages.digests(CHANNEL, event.turn_id)
        for part, text in enumerate(pieces):
            if not text.strip() or shown.get(part) == digests[part]:
                continue
            seq = await self._seq(event.reply_to)
            last = event.reply_to is not None and seq >= MAX_REPLIES and part < len(pieces) - 1
            if last:  # the last reply QQ takes to the message: it says the rest is cut
                text = text[:MAX_MESSAGE_CHARS - len(CUT)].rstrip() + CUT
            message_id = await self._api.reply(event.chat_id, text, msg_id=event.reply_to, msg_seq=seq)
            await self._messages.record(CHANNEL, event.chat_id, event.turn_id, part, message_id)
            # Shown, should a later part fail: the answer's next try starts after it.
            await self._messages.finish(CHANNEL, event.turn_id, None, {part: digests[part]})
            if last:
                digests = {p: d for p, d in digests.items() if p <= part}
                break
        else:
            digests |= await self._send_pictures(event, pictures, shown)
        await self._messages.finish(CHANNEL, event.turn_id, event.delivery_id, digests)

    async def _send_pictures(self, event: OutboundEvent, pictures: list[AttachmentContent],
                             shown: dict[int, str]) -> dict[int, str]:
        """The answer's pictures, each a reply of its own while QQ takes replies to the message."""
        sent: dict[int, str] = {}
        for part, file in enumerate(pictures, start=FILE_PARTS):
            if shown.get(part) == file.digest[:16]:
                continue
            seq = await self._seq(event.reply_to)
            if event.reply_to is not None and seq > MAX_REPLIES:
                log.warning("qq: %s was not sent: QQ takes at most five replies to one message", file.label)
                break
            message_id = await self._api.reply_picture(event.chat_id, file, msg_id=event.reply_to, msg_seq=seq)
            await self._messages.record(CHANNEL, event.chat_id, event.turn_id, part, message_id)
            sent[part] = file.digest[:16]
            await self._messages.finish(CHANNEL, event.turn_id, None, {part: sent[part]})
        return sent

    async def _seq(self, reply_to: str | None) -> int:
        """The next msg_seq of replies to `reply_to`; 1 for a message of the bot's own, which has none."""
        return await self._messages.next_counter(CHANNEL, reply_to) if reply_to is not None else 1

    def _short_id(self, approval_id: str) -> str:
        """The shortest prefix of the id, from SHORT_ID_CHARS on, that names no other request in memory."""
        for size in range(SHORT_ID_CHARS, len(approval_id)):
            short = approval_id[:size].lower()
            if self._short_ids.get(short, approval_id) == approval_id:
                remember(self._short_ids, short, approval_id)
                return short
        return approval_id

    async def _reply(self, chat_id: str, text: str, message_id: str, *, seq: int | None = None) -> None:
        """A courtesy (a refusal, how an approval went): its failure must not stop the channel."""
        try:
            await self._api.reply(chat_id, text, msg_id=message_id, msg_seq=seq or await self._seq(message_id))
        except (QQUnavailable, TokenRefused, DeliveryRefused) as exc:
            log.info("qq: could not reply in %s: %s", chat_id, exc)
        except Exception:  # the channel's edge: logged here, once
            log.warning("qq: could not reply in %s", chat_id, exc_info=True)

    async def replies_sent(self) -> None:
        """Once the replies begun after their callbacks' ACKs (refusals, approval commands) are over:
        what a drain or a test waits on, as they go out past the bus and its delivery order."""
        while self._replies:
            await asyncio.gather(*self._replies, return_exceptions=True)

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` after the callback is answered (QQ waits for the ACK); it is cancelled at stop."""
        task = asyncio.create_task(work, name="ember-qq-reply")
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)


async def probe(spec: QQSpec) -> str:
    """Whether the app id and secret work (an access token is fetched; nothing is sent), or ConfigError."""
    secret = required(spec.key(), f"[qq] needs the bot secret: secret = \"…\" or {SECRET_ENV}")
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        try:
            await AccessToken(http, spec.token_url, spec.app_id, secret, time.monotonic).get()
        except (TokenRefused, QQUnavailable) as exc:
            raise ConfigError(str(exc)) from None
    return f"app {spec.app_id} got an access token"
