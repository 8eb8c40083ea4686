"""The `email` channel: a mailbox Ember reads over IMAP and answers from over SMTP.

Ember takes the mailbox's unread mail, waits for more with IMAP IDLE (or looks every
`poll_interval_s` where the server cannot push), and marks a mail read once it is kept in the
store: a crash before that reads it again, and the store knows its Message-ID, so no second turn
runs. A thread is one session (mail.py). Mail from a sender `allowed_senders` does not name is not
kept, and the sender is told so once a run.

An answer is one mail in the thread, to the mail's sender, with the answer's files attached. Its
Message-ID is made of the delivery id, so an answer sent again after a crash is the same mail to a
mail client; and one recorded as sent is not sent again. Mail has no buttons: an approval request
is a mail answered with /approve, /always or /deny and its short id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from collections.abc import AsyncIterator, Sequence

import aioimaplib
import aiosmtplib
from starlette.routing import Route

from ember.channels.attachments import not_taken
from ember.channels.chat.commands import ApprovalCommands, command, hint
from ember.channels.chat.inbound import AllowList, remember
from ember.channels.chat.platform import required, show_answers_only
from ember.channels.chat.services import ChatServices
from ember.channels.email.config import PASSWORD_ENV, EmailSpec
from ember.channels.email.mail import Incoming, Replied, parsed, reply
from ember.core.attachments import AttachmentContent, AttachmentRefused
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.errors import ConfigError, ModelError
from ember.core.events import InboundEvent, OutboundEvent
from ember.runtime.tasks import cancel_task

CHANNEL = "email"
IDLE_S = 25 * 60.0  # servers end an IDLE after 30 minutes
MAX_BACKOFF_S = 300.0
_FETCHED = re.compile(rb"UID (\d+)")
NO_PASSWORD = f"[email] needs the mailbox's password: password = \"…\" or {PASSWORD_ENV}"

log = logging.getLogger(__name__)


async def probe(spec: EmailSpec) -> str:
    """Whether the mailbox opens and the SMTP server takes the login (nothing is sent)."""
    password = required(spec.key(), NO_PASSWORD)
    async with _mailbox(spec, password) as imap:
        unread = len(await _unseen(imap))
    async with _smtp(spec, password):
        pass
    return f"{spec.login} logs in to {spec.imap_host} ({unread} unread) and {spec.smtp_host}"


@contextlib.asynccontextmanager
async def _mailbox(spec: EmailSpec, password: str) -> AsyncIterator[aioimaplib.IMAP4]:
    imap = (aioimaplib.IMAP4_SSL(spec.imap_host, spec.imap_port, timeout=30) if spec.imap_security == "tls"
            else aioimaplib.IMAP4(spec.imap_host, spec.imap_port, timeout=30))
    try:
        await imap.wait_hello_from_server()
        if (await imap.login(spec.login, password)).result != "OK":
            raise ConfigError(f"{spec.imap_host} refused the login of {spec.login}: check [email] username and "
                              f"password")
        if (await imap.select(spec.mailbox)).result != "OK":
            raise ConfigError(f"{spec.imap_host} has no mailbox {spec.mailbox!r} ([email] mailbox)")
        yield imap
    finally:
        if imap.has_pending_idle():
            imap.idle_done()
        with contextlib.suppress(Exception):  # closing a connection that may be gone already
            await asyncio.wait_for(imap.logout(), 5)


@contextlib.asynccontextmanager
async def _smtp(spec: EmailSpec, password: str) -> AsyncIterator[aiosmtplib.SMTP]:
    secure = spec.smtp_security
    client = aiosmtplib.SMTP(hostname=spec.smtp_host, port=spec.smtp_port, use_tls=secure == "tls",
                             start_tls=secure == "starttls", timeout=30,
                             tls_context=ssl.create_default_context() if secure != "none" else None)
    async with client:
        if secure != "none" or client.supports_extension("auth"):
            await client.login(spec.login, password)
        yield client


async def _unseen(imap: aioimaplib.IMAP4) -> list[str]:
    found = await imap.uid_search("UNSEEN")
    return found.lines[0].decode().split() if found.result == "OK" and found.lines else []


class EmailChannel:
    name = CHANNEL
    capabilities = ChannelCapabilities(approvals=True, confirms_delivery=True)

    def __init__(self, spec: EmailSpec, services: ChatServices) -> None:
        self._password = required(spec.key(), NO_PASSWORD)
        self._spec = spec
        self._services = services
        self._gate: AllowList[str] = AllowList(CHANNEL, [s.lower() for s in spec.allowed_senders], empty_refuses=True)
        self._approvers = frozenset(a.lower() for a in spec.approvers)
        self._commands = ApprovalCommands(CHANNEL, services, self._approvers)
        self._replied: dict[str, Replied] = {}  # message id -> what a reply to it needs
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="ember-email")

    async def stop(self) -> None:
        await cancel_task(self._task)

    def routes(self) -> list[Route]:
        return []

    # In

    async def _watch(self) -> None:
        backoff = 1.0
        while True:
            try:
                async with _mailbox(self._spec, self._password) as imap:
                    backoff = 1.0
                    await self._read(imap)
            except (aioimaplib.AioImapException, OSError, TimeoutError, ConfigError) as exc:
                log.warning("email: the mailbox %s failed (%s); trying again in %.0f s", self._spec.imap_host,
                            exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _read(self, imap: aioimaplib.IMAP4) -> None:
        while True:
            for uid in await _unseen(imap):
                try:
                    await self._take(imap, uid)
                except (aioimaplib.AioImapException, OSError, TimeoutError):
                    raise  # the connection's: connect again
                except Exception:  # this mail's (the store, a mail Ember cannot read): it stays unread
                    log.warning("email: mail %s could not be taken; it stays unread, to try again", uid,
                                exc_info=True)
            if imap.has_capability("IDLE"):
                idle = await imap.idle_start(timeout=IDLE_S)
                await imap.wait_server_push(timeout=IDLE_S + 60)
                imap.idle_done()
                await asyncio.wait_for(idle, 30)
            else:
                await asyncio.sleep(self._spec.poll_interval_s)

    async def _take(self, imap: aioimaplib.IMAP4, uid: str) -> None:
        fetched = await imap.uid("fetch", uid, "(BODY.PEEK[])")
        raw = next((bytes(line) for line in fetched.lines if isinstance(line, bytearray)), None)
        if fetched.result != "OK" or raw is None:
            return
        mail = parsed(raw, f"uid-{uid}@{self._spec.imap_host}")
        await self._received(mail)
        # Read once it is kept (or refused): a crash before this reads it again, and runs no second turn.
        await imap.uid("store", uid, "+FLAGS.SILENT", r"(\Seen)")

    async def _received(self, mail: Incoming) -> None:
        sender, typed = mail.sender, command(mail.text)
        remember(self._replied, mail.message_id, mail.replied)
        if not sender or sender == self._spec.address.lower():
            return  # its own mail, or nobody's
        if not self._admits(sender) and not (typed and sender in self._approvers):
            if self._gate.first_refusal(sender):
                await self._courtesy(mail, "Sorry, I only answer mail from the people my owner allowed. If that "
                                           f"should include you, send them your address: {sender}.")
            return
        if typed is not None:
            await self._courtesy(mail, await self._commands.answer(sender, *typed))
            return
        shelf = self._services.files
        try:
            files = [shelf.checked(data, declared=declared, name=name) for name, declared, data in mail.files]
            text = await shelf.heard(mail.text, files)
        except (AttachmentRefused, ModelError) as exc:  # said; nothing is kept
            await self._courtesy(mail, not_taken(exc))
            return
        if not text and not files:
            return
        text = f"{mail.subject}\n\n{text}" if mail.thread == mail.message_id and mail.subject else text
        event = InboundEvent(channel=CHANNEL, chat_id=mail.thread, sender_id=sender, text=text,
                             message_id=mail.message_id, sender_name=mail.sender_name, stream=False,
                             can_approve=True,
                             attachments=await shelf.keep(f"{CHANNEL}:{mail.thread}", files))
        if await self._services.inbox.accept(event):
            await self._services.bus.publish_inbound(event)

    def _admits(self, sender: str) -> bool:
        return self._gate.admits(sender) or self._gate.admits("@" + sender.rpartition("@")[2])

    # Out

    async def deliver(self, event: OutboundEvent) -> None:
        await show_answers_only(event, ask=self._ask, answer=self._answer, sends_files=True)

    async def _ask(self, event: OutboundEvent) -> None:
        assert event.approval is not None
        await self._send(event, event.text + hint(await self._commands.short_id(event)), event.approval.id)

    async def _answer(self, event: OutboundEvent) -> None:
        messages = self._services.messages
        if event.delivery_id is not None and await messages.finished(CHANNEL, event.turn_id) == event.delivery_id:
            return  # sent already (a re-send after a restart)
        files = (await self._services.files.read(event.session_key, event.attachments)
                 if event.attachments and event.session_key else [])
        await self._send(event, event.text, event.delivery_id or event.turn_id, files)
        await messages.finish(CHANNEL, event.turn_id, event.delivery_id, {})

    async def _send(self, event: OutboundEvent, text: str, key: str,
                    files: Sequence[AttachmentContent] = ()) -> None:
        to = await self._mail_answered(event)
        domain = self._spec.address.rpartition("@")[2]
        answer = reply(to, sender=self._spec.address, text=text, files=files,
                       message_id=f"{re.sub(r'[^A-Za-z0-9.-]', '.', key)}@{domain}")
        try:
            async with _smtp(self._spec, self._password) as smtp:
                await smtp.send_message(answer)
        except aiosmtplib.SMTPRecipientsRefused as exc:
            raise DeliveryRefused(f"the mail server refused {to.sender}: {exc}") from None

    async def _mail_answered(self, event: OutboundEvent) -> Replied:
        """What a reply to the mail `event` answers needs: kept when it came, else read from the mailbox."""
        asked = event.reply_to or event.chat_id
        if (known := self._replied.get(asked)) is not None:
            return known
        async with _mailbox(self._spec, self._password) as imap:
            found = await imap.uid_search("HEADER", "Message-ID", f'"<{asked}>"', charset=None)
            uids = found.lines[0].decode().split() if found.result == "OK" and found.lines else []
            fetched = await imap.uid("fetch", uids[-1], "(BODY.PEEK[])") if uids else None
        raw = next((bytes(line) for line in fetched.lines if isinstance(line, bytearray)), None) if fetched else None
        if raw is None:
            raise DeliveryRefused(f"the mail {asked} this answers is no longer in {self._spec.mailbox}")
        return parsed(raw, asked).replied

    async def _courtesy(self, mail: Incoming, text: str) -> None:
        """A refusal, or how an approval command went: its failure must not stop the channel."""
        try:
            async with _smtp(self._spec, self._password) as smtp:
                await smtp.send_message(reply(mail.replied, sender=self._spec.address, text=text,
                                              message_id=f"re.{mail.message_id}"))
        except (aiosmtplib.SMTPException, OSError) as exc:
            log.info("email: could not answer %s: %s", mail.sender, exc)

