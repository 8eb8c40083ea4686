"""The `slack` channel, on slack_sdk: the Events API over HTTP or Socket Mode, answers streamed by edits.

Slack POSTs each event to `/channels/slack/events`, signed with the app's signing secret
(`X-Slack-Signature` v0 over the timestamp and the body; a timestamp more than 5 minutes off is
refused); or, in Socket Mode, sends it on a WebSocket Ember opened. Each message is kept in the
store before Slack hears it arrived (the 200, or the envelope's acknowledgement), so a crash loses
none; Slack's retries of an event (same `event_id`, and the same message) run no second turn. A
direct message is answered in its conversation, a mention in a channel in its thread, and each
thread is a session. The answer streams by `chat.update` edits of one message (channels/chat/
editing.py); an approval is a Block Kit card whose buttons Slack posts to
`/channels/slack/interactions` (or sends on the socket), and only the turn's person (or an
approver) can press.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import httpx
from slack_sdk.errors import SlackApiError
from slack_sdk.signature import SignatureVerifier
from slack_sdk.socket_mode.aiohttp import SocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest
from slack_sdk.socket_mode.response import SocketModeResponse
from slack_sdk.web.async_client import AsyncWebClient
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
from ember.channels.gateway.http import ApiError, read_body
from ember.channels.slack.config import APP_TOKEN_ENV, SIGNING_SECRET_ENV, TOKEN_ENV, SlackSpec
from ember.channels.slack.files import shared_files
from ember.channels.slack.markup import slack_mrkdwn
from ember.core.attachments import AttachmentContent, AttachmentRefused
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.errors import ConfigError, ModelError
from ember.core.events import InboundEvent, OutboundEvent
from ember.core.tools import Decision

CHANNEL = "slack"
EVENTS_PATH = "/channels/slack/events"
INTERACTIONS_PATH = "/channels/slack/interactions"
MAX_MESSAGE_CHARS = 4_000  # Slack cuts a message's text at 40,000, and shows long ones folded
DECISIONS = {"once": Decision.APPROVE_ONCE, "session": Decision.APPROVE_SESSION, "deny": Decision.DENY}
DECIDED = {Decision.APPROVE_ONCE: "Allowed once", Decision.APPROVE_SESSION: "Allowed for this thread",
           Decision.DENY: "Denied"}
_GONE = ("message_not_found", "cant_update_message")
_REFUSED = ("channel_not_found", "not_in_channel", "is_archived", "account_inactive", "invalid_auth")

log = logging.getLogger(__name__)


async def probe(spec: SlackSpec) -> str:
    """Whether the token works (auth.test; nothing is sent): the bot's name and workspace."""
    token = required(spec.token(), f"[slack] needs the bot token: bot_token = \"xoxb-…\" or {TOKEN_ENV}")
    answer = await AsyncWebClient(token, base_url=spec.api_base_url).auth_test()
    return f"@{answer.get('user')} in {answer.get('team')}"


def place(chat_id: str) -> tuple[str, str | None]:
    """The conversation and the thread (None: none) a chat id names: "C123/1700000000.000100"."""
    channel, _, thread = chat_id.partition("/")
    return channel, thread or None


class SlackPlatform:
    """Send, edit and delete through the Web API, as EditStream needs them."""

    def __init__(self, client: AsyncWebClient) -> None:
        self._client = client

    async def send(self, chat_id: str, text: str, *, reply_to: str | None = None,
                   blocks: list[dict[str, Any]] | None = None) -> str:
        channel, thread = place(chat_id)
        answer = await _call(lambda: self._client.chat_postMessage(
            channel=channel, thread_ts=thread, text=slack_mrkdwn(text), blocks=blocks, unfurl_links=False))
        return str(answer["ts"])

    async def edit(self, chat_id: str, message_id: str, text: str,
                   blocks: list[dict[str, Any]] | None = None) -> None:
        channel, _ = place(chat_id)
        await _call(lambda: self._client.chat_update(channel=channel, ts=message_id, text=slack_mrkdwn(text),
                                                     blocks=blocks or []))

    async def delete(self, chat_id: str, message_id: str) -> None:
        channel, _ = place(chat_id)
        with contextlib.suppress(MessageGone):  # gone already: nothing of it is shown twice
            await _call(lambda: self._client.chat_delete(channel=channel, ts=message_id))

    async def send_file(self, chat_id: str, file: AttachmentContent, *, reply_to: str | None = None) -> str:
        """Uploaded into the conversation (its thread); the file's id, as Slack shares it in a message of its own."""
        channel, thread = place(chat_id)
        answer = await _call(lambda: self._client.files_upload_v2(
            channel=channel, thread_ts=thread, content=file.data, filename=file.name or "file", title=file.name))
        return str(answer["files"][0]["id"])


async def _call(request: Callable[[], Awaitable[Any]]) -> Any:
    """The Web API's errors as the chat kit's: a 429 to wait out, a message gone, a refusal for good."""
    try:
        return await request()
    except SlackApiError as exc:
        error = str(exc.response.get("error", "")) if exc.response is not None else ""
        if exc.response is not None and exc.response.status_code == 429:
            raise RateLimited(float(exc.response.headers.get("Retry-After", "1"))) from None
        if error in _GONE:
            raise MessageGone(error) from None
        if error in _REFUSED:
            raise DeliveryRefused(f"Slack refused: {error}") from None
        raise


class SlackChannel:
    name = CHANNEL
    capabilities = ChannelCapabilities(streams=True, edits=True, buttons=True, approvals=True,
                                       max_message_chars=MAX_MESSAGE_CHARS, confirms_delivery=True)

    def __init__(self, spec: SlackSpec, services: ChatServices, *, client: AsyncWebClient | None = None) -> None:
        token = required(spec.token(), f"[slack] needs the bot token: bot_token = \"xoxb-…\" or {TOKEN_ENV}")
        if spec.mode == "socket":
            self._app_token = required(spec.socket_token(), "[slack] mode = \"socket\" needs the app-level token: "
                                                            f"app_token = \"xapp-…\" or {APP_TOKEN_ENV}")
        secret = spec.secret() if spec.mode == "socket" else required(
            spec.secret(), f"[slack] needs the app's signing secret: signing_secret = \"…\" or {SIGNING_SECRET_ENV}")
        self._spec = spec
        self._token = token
        self._verifier = SignatureVerifier(secret) if secret else None  # socket mode: nothing is posted to Ember
        self._client = client or AsyncWebClient(token, base_url=spec.api_base_url)
        self._platform = SlackPlatform(self._client)
        self._services = services
        self._stream = EditStream(self._platform, services.messages, CHANNEL, interval_s=spec.edit_interval_ms / 1000,
                                  limit=MAX_MESSAGE_CHARS, files=services.files)
        self._gate: AllowList[str] = AllowList(CHANNEL, spec.allowed_users)
        self._seen: dict[str, None] = {}  # event ids of this run: Slack's retries
        self._socket: SocketModeClient | None = None
        self.bot_user = ""

    async def start(self) -> None:
        try:
            self.bot_user = str((await self._client.auth_test()).get("user_id") or "")
        except SlackApiError as exc:
            raise ConfigError(f"Slack refused the bot token ({exc.response.get('error')}): check [slack] bot_token "
                              f"or {TOKEN_ENV}") from None
        if self._spec.mode == "socket":
            self._socket = SocketModeClient(self._app_token,
                                            web_client=AsyncWebClient(base_url=self._spec.api_base_url))
            self._socket.socket_mode_request_listeners.append(self._on_socket)
            await self._socket.connect()
        log.info("slack: answering as %s, %s", self.bot_user, "over Socket Mode" if self._socket else "called back")

    async def stop(self) -> None:
        if self._socket is not None:
            await self._socket.close()
            self._socket = None
        await self._stream.close()

    def routes(self) -> list[Route]:
        if self._spec.mode == "socket":
            return []
        return [Route(EVENTS_PATH, self.events, methods=["POST"]),
                Route(INTERACTIONS_PATH, self.interactions, methods=["POST"])]

    # In

    async def _signed(self, request: Request) -> bytes:
        body = await read_body(request, 1_048_576)
        if self._verifier is None or not self._verifier.is_valid(body, request.headers.get("X-Slack-Request-Timestamp"),
                                       request.headers.get("X-Slack-Signature")):
            raise ApiError(401, "not Slack: the signature is missing, wrong or more than 5 minutes old",
                           code="invalid_signature")
        return body

    async def events(self, request: Request) -> Response:
        try:
            envelope = json.loads(await self._signed(request))
        except ValueError:
            raise ApiError(400, "not a Slack event: the body is not JSON", code="invalid_event") from None
        if envelope.get("type") == "url_verification":
            return JSONResponse({"challenge": envelope.get("challenge")})
        await self._received(envelope)
        return JSONResponse({"ok": True})

    async def _on_socket(self, client: SocketModeClient, request: SocketModeRequest) -> None:
        """An envelope on the socket, acknowledged once handled: Slack sends one it never heard back of again."""
        payload = request.payload if isinstance(request.payload, dict) else {}
        if request.type == "events_api":
            await self._received(payload)
        elif request.type == "interactive" and payload.get("type") == "block_actions":
            await self._pressed(payload)
        await client.send_socket_mode_response(SocketModeResponse(envelope_id=request.envelope_id))

    async def _received(self, envelope: dict[str, Any]) -> None:
        """An event, kept before Slack hears it arrived; a retried one finds it kept and runs no second turn."""
        event_id = str(envelope.get("event_id") or "")
        if envelope.get("type") == "event_callback" and event_id not in self._seen:
            event = await self._message(envelope.get("event") or {})
            if event is not None and await self._services.inbox.accept(event):
                await self._services.bus.publish_inbound(event)
            remember(self._seen, event_id, None)

    async def _message(self, event: dict[str, Any]) -> InboundEvent | None:
        """The event as the agent's message, if it is one to answer."""
        kind, user, text = event.get("type"), str(event.get("user") or ""), str(event.get("text") or "")
        if kind not in ("message", "app_mention") or event.get("subtype") not in (None, "file_share") \
                or event.get("bot_id") or not user:
            return None
        direct = event.get("channel_type") == "im"
        mentioned = kind == "app_mention"
        # In a channel the mention arrives twice (message and app_mention): the app_mention is answered.
        if not direct and (kind == "message") == (self._spec.channel_replies == "mention"):
            return None
        if not self._gate.admits(user):
            if self._gate.first_refusal(user):
                await self._quietly(self._client.chat_postEphemeral(
                    channel=str(event.get("channel")), user=user, text=refusal("Slack member ID", user)))
            return None
        if mentioned and self.bot_user:
            text = text.replace(f"<@{self.bot_user}>", "").strip() or text
        channel, ts = str(event.get("channel")), str(event.get("ts"))
        thread = event.get("thread_ts") or (None if direct else ts)
        chat_id = f"{channel}/{thread}" if thread else channel
        try:
            files = await shared_files(event.get("files") or [], self._token, self._services.files,
                                       self._spec.api_base_url)
            text = await self._services.files.heard(text, files)
        except (AttachmentRefused, httpx.HTTPError, ModelError) as exc:  # said in the thread; nothing is kept
            told = "Slack did not hand it over; share it again" if isinstance(exc, httpx.HTTPError) else exc
            await self._quietly(self._platform.send(chat_id, not_taken(told)))
            return None
        return InboundEvent(channel=CHANNEL, chat_id=chat_id, sender_id=user, text=text,
                            message_id=f"{channel}:{ts}", stream=True, can_approve=True,
                            attachments=await self._services.files.keep(f"{CHANNEL}:{chat_id}", files))

    async def interactions(self, request: Request) -> Response:
        body = await self._signed(request)
        try:
            payload = json.loads(parse_qs(body.decode())["payload"][0])
        except (KeyError, IndexError, ValueError, UnicodeDecodeError):
            raise ApiError(400, "not a Slack interaction: no payload", code="invalid_interaction") from None
        if payload.get("type") == "block_actions":
            await self._pressed(payload)
        return Response(status_code=200)

    async def _pressed(self, payload: dict[str, Any]) -> None:
        action = (payload.get("actions") or [{}])[0]
        code = str(action.get("action_id", "")).removeprefix("ap:")
        approval_id, user = str(action.get("value", "")), str((payload.get("user") or {}).get("id", ""))
        channel = str((payload.get("channel") or {}).get("id", ""))
        card_ts = str((payload.get("container") or {}).get("message_ts", ""))
        decision = DECISIONS.get(code)
        outcome = None if decision is None else await decided(self._services, CHANNEL, self._spec.approvers,
                                                              approval_id, decision, user)
        if outcome is None or decision is None:
            await self._quietly(self._client.chat_postEphemeral(channel=channel, user=user, text=NOT_YOURS))
            return
        note = outcome_note(outcome, f"{DECIDED[decision]} by <@{user}>.")
        question = str((payload.get("message") or {}).get("text", ""))  # mrkdwn already, as Slack shows it
        await self._quietly(_call(lambda: self._client.chat_update(channel=channel, ts=card_ts,
                                                                   text=f"{question}\n\n{note}", blocks=[])))

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        await show_streamed(event, self._stream, ask=self._ask)

    async def _ask(self, event: OutboundEvent) -> None:
        assert event.approval is not None
        text = split_message(event.text, MAX_MESSAGE_CHARS)[0]
        buttons = [{"type": "button", "action_id": f"ap:{code}", "value": event.approval.id,
                    "text": {"type": "plain_text", "text": label}, **({"style": style} if style else {})}
                   for code, label, style in (("once", "Allow once", "primary"), ("session", "Always in this thread",
                                                                                   None), ("deny", "Deny", "danger"))]
        blocks = [{"type": "section", "text": {"type": "mrkdwn", "text": slack_mrkdwn(text)}},
                  {"type": "actions", "elements": buttons}]
        while True:
            try:
                await self._platform.send(event.chat_id, text, blocks=blocks)
                return
            except RateLimited as limited:
                await asyncio.sleep(limited.retry_after_s)

    async def _quietly(self, call: Awaitable[Any]) -> None:
        """A courtesy (a refusal, a card's note): its failure must not stop the channel."""
        try:
            await call
        except (SlackApiError, RateLimited, DeliveryRefused, MessageGone) as exc:
            log.info("slack: %s", exc)
