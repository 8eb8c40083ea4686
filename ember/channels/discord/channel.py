"""The `discord` channel, on discord.py: the Gateway in, answers streamed by message edits.

discord.py keeps the Gateway connection (identify, heartbeats, resume after a drop) and waits out
the HTTP API's rate limits itself. A direct message is answered; in a server's channel, a message
that mentions the bot. Each channel (or DM) is a session. A message is kept in the store as it
arrives, and one seen again (a resumed Gateway replays what it missed) runs no second turn. The
answer replies to the message and streams by editing it (channels/chat/editing.py); an approval is
a message with buttons that only the turn's person (or an approver) can press.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import discord
import yarl
from discord.http import Route

from ember.channels.attachments import not_taken
from ember.channels.chat.commands import NOT_YOURS, decided, outcome_note
from ember.channels.chat.editing import EditStream, MessageGone
from ember.channels.chat.inbound import AllowList, refusal
from ember.channels.chat.platform import required, show_streamed
from ember.channels.chat.services import ChatServices
from ember.channels.chat.split import split_message
from ember.channels.discord.config import TOKEN_ENV, DiscordSpec
from ember.core.attachments import AttachmentContent, AttachmentRefused
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.errors import ConfigError, ModelError
from ember.core.events import InboundEvent, OutboundEvent
from ember.core.tools import Decision
from ember.runtime.tasks import cancel_task

CHANNEL = "discord"
MAX_MESSAGE_CHARS = 2_000
READY_TIMEOUT_S = 60.0
DECISIONS = {"once": Decision.APPROVE_ONCE, "session": Decision.APPROVE_SESSION, "deny": Decision.DENY}
DECIDED = {Decision.APPROVE_ONCE: "Allowed once", Decision.APPROVE_SESSION: "Allowed for this channel",
           Decision.DENY: "Denied"}
NO_TOKEN = f"[discord] needs the bot's token: token = \"…\" or {TOKEN_ENV}"

log = logging.getLogger(__name__)


def _pointed_at(spec: DiscordSpec) -> None:
    """discord.py reads where Discord is from two class attributes: one Discord bot per process."""
    Route.BASE = spec.api_base_url.rstrip("/")
    discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(spec.gateway_url)
    # Ember speaks no voice channels: discord.py need not warn that its voice libraries are missing.
    discord.VoiceClient.warn_nacl = discord.VoiceClient.warn_dave = False


async def probe(spec: DiscordSpec) -> str:
    """Whether the token works (the bot's own user is read; nothing is sent, no Gateway opened)."""
    token = required(spec.key(), NO_TOKEN)
    _pointed_at(spec)
    client = discord.Client(intents=discord.Intents.none())
    try:
        me = await client.http.static_login(token)
    except discord.LoginFailure:
        raise ConfigError("Discord refused the bot token: check [discord] token or " + TOKEN_ENV) from None
    finally:
        await client.close()
    return f"{me['username']} ({me['id']})"


class DiscordPlatform:
    """Send, edit and delete through the HTTP API, as EditStream needs them."""

    def __init__(self, client: discord.Client) -> None:
        self._client = client

    async def send(self, chat_id: str, text: str, *, reply_to: str | None = None,
                   view: discord.ui.View | None = None) -> str:
        channel = self._client.get_partial_messageable(int(chat_id))
        reference = (discord.MessageReference(message_id=int(reply_to), channel_id=int(chat_id),
                                              fail_if_not_exists=False) if reply_to and reply_to.isdigit() else None)
        async with _refusals():
            message = await channel.send(text, reference=reference, view=view or discord.utils.MISSING,
                                         allowed_mentions=discord.AllowedMentions.none())
        return str(message.id)

    async def send_file(self, chat_id: str, file: AttachmentContent, *, reply_to: str | None = None) -> str:
        """An attachment of a message of its own (Discord plays audio and shows pictures inline)."""
        upload = discord.File(io.BytesIO(file.data), filename=file.name or "file")
        async with _refusals():
            message = await self._client.get_partial_messageable(int(chat_id)).send(file=upload)
        return str(message.id)

    async def edit(self, chat_id: str, message_id: str, text: str) -> None:
        async with _refusals():
            await self._client.get_partial_messageable(int(chat_id)).get_partial_message(int(message_id)).edit(
                content=text)

    async def delete(self, chat_id: str, message_id: str) -> None:
        with contextlib.suppress(MessageGone):  # gone already: nothing of it is shown twice
            async with _refusals():
                await self._client.get_partial_messageable(int(chat_id)).get_partial_message(int(message_id)).delete()


@contextlib.asynccontextmanager
async def _refusals() -> AsyncIterator[None]:
    """The HTTP API's errors as the chat kit's (discord.py waits out 429s itself)."""
    try:
        yield
    except discord.NotFound as exc:
        raise MessageGone(str(exc)) from None
    except discord.Forbidden as exc:  # no access to the channel, or the person blocks DMs: for good
        raise DeliveryRefused(f"Discord refused: {exc.text}") from None


class DiscordChannel:
    name = CHANNEL
    capabilities = ChannelCapabilities(streams=True, edits=True, buttons=True, approvals=True,
                                       max_message_chars=MAX_MESSAGE_CHARS, confirms_delivery=True)

    def __init__(self, spec: DiscordSpec, services: ChatServices) -> None:
        self._token = required(spec.key(), NO_TOKEN)
        self._spec = spec
        self._services = services
        intents = discord.Intents.default()
        intents.message_content = True  # a privileged intent: turned on for the bot in the Developer Portal
        self._client = discord.Client(intents=intents)
        self._client.event(self.on_message)
        self._client.event(self.on_interaction)
        self._platform = DiscordPlatform(self._client)
        self._stream = EditStream(self._platform, services.messages, CHANNEL, interval_s=spec.edit_interval_ms / 1000,
                                  limit=MAX_MESSAGE_CHARS, files=services.files)
        self._gate: AllowList[str] = AllowList(CHANNEL, spec.allowed_users)
        self._asked: dict[str, str] = {}  # approval id -> its question, shown again with the answer
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        _pointed_at(self._spec)
        try:
            await self._connected()
        except BaseException:
            await self.stop()
            raise
        log.info("discord: answering as %s", self._client.user)

    async def _connected(self) -> None:
        try:
            await self._client.login(self._token)
        except discord.LoginFailure:
            raise ConfigError("Discord refused the bot token: check [discord] token or " + TOKEN_ENV) from None
        self._task = asyncio.create_task(self._client.connect(reconnect=True), name="ember-discord")
        ready = asyncio.create_task(self._client.wait_until_ready())
        await asyncio.wait({ready, self._task}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            failed = self._task.exception() if self._task.done() else TimeoutError("no READY from the Gateway")
            raise ConfigError(f"Discord's Gateway did not let the bot in: {failed}")

    async def stop(self) -> None:
        await self._stream.close()
        await self._client.close()
        await cancel_task(self._task)

    def routes(self) -> list[Any]:
        return []

    # In

    async def on_message(self, message: discord.Message) -> None:
        me = self._client.user
        direct = isinstance(message.channel, discord.DMChannel)
        if message.author.bot or me is None or (not direct and me not in message.mentions):
            return  # its own and other bots' messages; in a server, what does not mention it
        sender, chat_id = str(message.author.id), str(message.channel.id)
        if not self._gate.admits(sender):
            if self._gate.first_refusal(sender):
                await self._courtesy(chat_id, refusal("Discord user id", sender), str(message.id))
            return
        text = re.sub(rf"<@!?{me.id}>\s*", "", message.content).strip()
        try:
            files = [await self._file(attachment) for attachment in message.attachments]
            text = await self._services.files.heard(text, files)
        except (AttachmentRefused, discord.HTTPException, ModelError) as exc:  # said; nothing is kept
            await self._courtesy(chat_id, not_taken(exc), str(message.id))
            return
        if not text and not files:
            return
        kept = await self._services.files.keep(f"{CHANNEL}:{chat_id}", files)
        event = InboundEvent(channel=CHANNEL, chat_id=chat_id, sender_id=sender, text=text,
                             message_id=str(message.id), sender_name=message.author.display_name, stream=True,
                             can_approve=True, attachments=kept)
        if await self._services.inbox.accept(event):
            await self._services.bus.publish_inbound(event)

    async def _file(self, attachment: discord.Attachment) -> AttachmentContent:
        shelf = self._services.files
        if attachment.size > shelf.max_bytes:  # not fetched at all
            raise AttachmentRefused(f"{attachment.filename} is {attachment.size} bytes; the limit is {shelf.max_bytes} "
                                    "(attachment_max_bytes)", code="attachment_too_large")
        return shelf.checked(await attachment.read(), declared=attachment.content_type, name=attachment.filename)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        """A button of an approval message: resolved if the presser may; else only they are told no."""
        custom_id = str((interaction.data or {}).get("custom_id", ""))
        prefix, _, rest = custom_id.partition(":")
        code, _, approval_id = rest.partition(":")
        if prefix != "ap" or code not in DECISIONS:
            return
        user, decision = str(interaction.user.id), DECISIONS[code]
        outcome = await decided(self._services, CHANNEL, self._spec.approvers, approval_id, decision, user)
        if outcome is None:
            await interaction.response.send_message(NOT_YOURS, ephemeral=True)
            return
        note = outcome_note(outcome, f"{DECIDED[decision]} by <@{user}>.")
        question = self._asked.get(approval_id, "")
        await interaction.response.edit_message(content=f"{question}\n\n{note}".strip(), view=None)

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        await show_streamed(event, self._stream, ask=self._ask)

    async def _ask(self, event: OutboundEvent) -> None:
        assert event.approval is not None
        question = split_message(event.text, MAX_MESSAGE_CHARS)[0]
        self._asked[event.approval.id] = question
        view = discord.ui.View(timeout=None)
        for code, label, style in (("once", "Allow once", discord.ButtonStyle.primary),
                                   ("session", "Always in this channel", discord.ButtonStyle.secondary),
                                   ("deny", "Deny", discord.ButtonStyle.danger)):
            view.add_item(discord.ui.Button(label=label, style=style, custom_id=f"ap:{code}:{event.approval.id}"))
        await self._platform.send(event.chat_id, question, reply_to=event.reply_to, view=view)

    async def _courtesy(self, chat_id: str, text: str, reply_to: str) -> None:
        """A refusal: its failure must not stop the channel."""
        try:
            await self._platform.send(chat_id, text, reply_to=reply_to)
        except (DeliveryRefused, MessageGone, discord.HTTPException) as exc:
            log.info("discord: could not answer in %s: %s", chat_id, exc)
