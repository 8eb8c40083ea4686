"""The email channel against real servers on loopback: Debian's Dovecot for IMAP (mail put in with
APPEND, as delivery does) and aiosmtpd for SMTP (every mail Ember sends, as a server receives it).
A thread of three mails is one session answered in the thread; a file comes in with a mail and
another goes out with the answer; a mail seen twice runs one turn; a stranger is told once. And
`ember channels` and `ember doctor` for the platforms that came with it: email, Feishu, Discord."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.app.tools import workspaces
from ember.channels.email.channel import EmailChannel, probe
from ember.channels.email.config import EmailSpec
from ember.channels.email.mail import new_text
from ember.config.settings import Settings
from ember.core.messages import Role
from ember.models.openai_compat import OpenAICompatibleModel
from ember.tools.base import ToolRegistry
from tests.chatplatform import asking_model, settled_in, settling, writing_tool
from tests.discordserver import TOKEN as DISCORD_TOKEN
from tests.discordserver import serving_discord
from tests.feishuserver import APP_ID as FEISHU_APP
from tests.feishuserver import APP_SECRET as FEISHU_SECRET
from tests.feishuserver import VERIFICATION_TOKEN, serving_feishu
from tests.gatewayproc import free_port
from tests.imapserver import PASSWORD, USER, ImapServer, dovecot, imap_server  # noqa: F401 (the fixture)
from tests.modelserver import ModelServer, Reply, serving
from tests.test_attachments import pdf

ANA, BEN, STRANGER = "ana@example.test", "ben@example.test", "spam@elsewhere.test"


class Outbox:
    """aiosmtpd's handler: every mail it is given, parsed."""

    def __init__(self) -> None:
        self.mails: list[EmailMessage] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.mails.append(BytesParser(policy=policy.default).parsebytes(envelope.content))
        return "250 OK"


@pytest.fixture
def smtp() -> Iterator[tuple[Outbox, int]]:
    outbox, port = Outbox(), free_port()
    controller = Controller(outbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield outbox, port
    finally:
        controller.stop()


@pytest.fixture
def mailbox(imap_server: ImapServer) -> Iterator[ImapServer]:  # noqa: F811
    imap_server.clear()
    yield imap_server


@pytest.fixture
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


def spec(imap: ImapServer, smtp_port: int, **fields: Any) -> EmailSpec:
    return EmailSpec(**{"address": USER, "password": PASSWORD, "imap_host": "127.0.0.1", "imap_port": imap.port,
                        "imap_security": "none", "smtp_host": "127.0.0.1", "smtp_port": smtp_port,
                        "smtp_security": "none", "allowed_senders": [ANA, "@team.test"], **fields})


def mail(sender: str, text: str, message_id: str, *, subject: str = "Trip to Lyon", replying: list[str] = (),
         files: dict[str, bytes] | None = None) -> EmailMessage:
    message = EmailMessage()
    message["From"], message["To"], message["Message-ID"] = sender, USER, f"<{message_id}>"
    message["Subject"] = subject if not replying else f"Re: {subject}"
    if replying:
        message["In-Reply-To"] = f"<{replying[-1]}>"
        message["References"] = " ".join(f"<{ref}>" for ref in replying)
    message.set_content(text)
    for name, data in (files or {}).items():
        message.add_attachment(data, maintype="application", subtype="octet-stream", filename=name)
    return message


@asynccontextmanager
async def agent(settings: Settings, model: ModelServer, email: EmailSpec) -> AsyncIterator[Runtime]:
    runtime = await build_runtime(settings, OpenAICompatibleModel(model="test-model", base_url=model.base_url,
                                                                  api_key=None))
    settling(runtime, EmailChannel(email, chat_services(runtime)))
    async with running(runtime, recover=True):
        yield runtime


async def mails_sent(outbox: Outbox, count: int, timeout_s: float = 30) -> list[EmailMessage]:
    async with asyncio.timeout(timeout_s):
        while len(outbox.mails) < count:
            await asyncio.sleep(0.05)
    return outbox.mails


def ids(header: object) -> list[str]:
    return str(header or "").replace("<", " ").replace(">", " ").split()


async def test_a_thread_of_three_mails_is_one_session_answered_in_the_thread_with_files_both_ways(
        settings: Settings, mailbox: ImapServer, smtp: tuple[Outbox, int], model: ModelServer) -> None:
    outbox, port = smtp
    itinerary = pdf("Day 1 Vieux Lyon")
    model.push(Reply(tool_calls=(("send_file", json.dumps({"path": "itinerary.pdf"})),)),
               Reply(text="Here is the plan."), Reply(text="Day 2: Fourviere."), Reply(text="Day 3: the Saone."))
    async with agent(settings, model, spec(mailbox, port)) as runtime:
        folder = workspaces(settings, None).for_identity(runtime.identities.resolve("email", ANA)).root
        (folder / "itinerary.pdf").write_bytes(itinerary)
        first = mail(ANA, "Plan three days, please.", "m1@example.test", files={"wishes.md": b"- museums\n- food"})
        mailbox.deliver(first)
        mailbox.deliver(first)  # the same mail twice (a client that sent it again): one turn
        [answer] = await mails_sent(outbox, 1)
        thread = ["m1@example.test", ids(answer["Message-ID"])[0]]
        mailbox.deliver(mail(ANA, "And day 2?\n\nOn Sunday, Ember wrote:\n> Here is the plan.", "m2@example.test",
                             replying=thread))
        second = (await mails_sent(outbox, 2))[1]
        mailbox.deliver(mail(ANA, "And day 3?", "m3@example.test",
                             replying=[*thread, "m2@example.test", ids(second["Message-ID"])[0]]))
        third = (await mails_sent(outbox, 3))[2]
        await settled_in(runtime, "email").settled("m1@example.test")
        history = await runtime.sessions.history("email:m1@example.test")
    assert [m.content for m in history if m.role is Role.USER] == [
        "Trip to Lyon\n\nPlan three days, please.", "And day 2?", "And day 3?"]
    assert len(model.requests) == 4 and "- museums" in json.dumps(model.requests[0]["messages"][-1])
    for sent, asked in zip((answer, second, third), ("m1", "m2", "m3")):
        assert sent["To"] == ANA and sent["Subject"] == "Re: Trip to Lyon"
        assert ids(sent["In-Reply-To"]) == [f"{asked}@example.test"] and ids(sent["References"])[0] == thread[0]
    assert [new_text(sent.get_body(("plain",)).get_content()) for sent in (answer, second, third)] == [
        "Here is the plan.", "Day 2: Fourviere.", "Day 3: the Saone."]
    [attached] = list(answer.iter_attachments())
    assert attached.get_filename() == "itinerary.pdf" and attached.get_content() == itinerary
    assert mailbox.unseen() == 0 and len(outbox.mails) == 3


async def test_a_server_that_cannot_push_is_looked_at_every_poll_interval(
        settings: Settings, smtp: tuple[Outbox, int], model: ModelServer) -> None:
    outbox, port = smtp
    model.push(Reply(text="Noted."))
    with dovecot("imap_capability = IMAP4rev1 LITERAL+ SASL-IR LOGIN-REFERRALS ID ENABLE UIDPLUS\n") as no_idle:
        async with agent(settings, model, spec(no_idle, port, poll_interval_s=1)) as runtime:
            await asyncio.sleep(0.5)  # the mailbox was looked at, empty: the mail comes while Ember waits
            no_idle.deliver(mail(ANA, "Buy milk.", "p1@example.test"))
            [answer] = await mails_sent(outbox, 1)
            await settled_in(runtime, "email").settled("p1@example.test")
        assert no_idle.unseen() == 0
    assert ids(answer["In-Reply-To"]) == ["p1@example.test"]
    assert new_text(answer.get_body(("plain",)).get_content()) == "Noted."


async def test_a_stranger_is_told_once_and_nothing_of_theirs_is_kept(
        settings: Settings, mailbox: ImapServer, smtp: tuple[Outbox, int], model: ModelServer) -> None:
    outbox, port = smtp
    model.push(Reply(text="Hello Ben."))
    async with agent(settings, model, spec(mailbox, port)) as runtime:
        mailbox.deliver(mail(STRANGER, "Buy now", "s1@elsewhere.test"))
        mailbox.deliver(mail(STRANGER, "Buy again", "s2@elsewhere.test"))
        mailbox.deliver(mail(BEN.replace("example", "team"), "Hi from the team", "b1@team.test"))
        sent = await mails_sent(outbox, 2)
        await asyncio.sleep(0.5)  # a second refusal would have been sent by now
        assert await runtime.sessions.history("email:s1@elsewhere.test") == []
    refusals = [m for m in sent if m["To"] == STRANGER]
    assert len(refusals) == 1 and STRANGER in refusals[0].get_body(("plain",)).get_content()
    assert [m["To"] for m in sent if m not in refusals] == ["ben@team.test"]
    assert mailbox.unseen() == 0


async def test_doctor_checks_both_logins_without_sending(mailbox: ImapServer, smtp: tuple[Outbox, int]) -> None:
    outbox, port = smtp
    assert "logs in to 127.0.0.1 (0 unread)" in await probe(spec(mailbox, port))
    with pytest.raises(Exception, match="refused the login"):
        await probe(spec(mailbox, port, password="wrong"))
    assert outbox.mails == []


def test_channels_lists_email_feishu_and_discord_and_doctor_checks_them_without_sending(
        tmp_path: Path, mailbox: ImapServer, smtp: tuple[Outbox, int]) -> None:
    outbox, port = smtp
    home = tmp_path / "home"
    home.mkdir()
    with serving_feishu() as feishu, serving_discord() as discord:
        (home / "ember.toml").write_text(f"""
[email]
address = "{USER}"
imap_host = "127.0.0.1"
imap_port = {mailbox.port}
imap_security = "none"
smtp_host = "127.0.0.1"
smtp_port = {port}
smtp_security = "none"
allowed_senders = ["{ANA}"]
[feishu]
app_id = "{FEISHU_APP}"
verification_token = "{VERIFICATION_TOKEN}"
api_base_url = "{feishu.origin}"
[discord]
api_base_url = "{discord.origin}/api/v10"
""")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}, "EMBER_HOME": str(home),
               "EMBER_EMAIL_PASSWORD": PASSWORD, "EMBER_FEISHU_APP_SECRET": FEISHU_SECRET,
               "EMBER_DISCORD_TOKEN": DISCORD_TOKEN}
        ember = str(Path(sys.executable).with_name("ember"))
        listed = subprocess.run([ember, "channels", "--json"], env=env, capture_output=True, text=True, timeout=120)
        doctor = subprocess.run([ember, "doctor"], env=env, capture_output=True, text=True, timeout=120)
        assert feishu.cards == {} and discord.shown == {} and discord.identified == 0  # nothing sent, no Gateway
    rows = {row["channel"]: row for row in json.loads(listed.stdout)}
    assert "1 allowed senders" in rows["email"]["state"] and "POST /channels/feishu/events" in rows["feishu"]["state"]
    assert rows["discord"]["state"].startswith("token set")
    assert f"email: {USER} logs in to 127.0.0.1 (0 unread)" in doctor.stdout
    assert f"feishu: app {FEISHU_APP} got a tenant access token" in doctor.stdout
    assert "discord: the token is ember (900000000000000001)'s" in doctor.stdout
    assert "feishu: no encrypt_key" in doctor.stdout and outbox.mails == []
    assert PASSWORD not in doctor.stdout + doctor.stderr and DISCORD_TOKEN not in doctor.stdout + doctor.stderr


async def test_an_approval_is_mailed_and_only_the_askers_reply_answers_it(
        settings: Settings, mailbox: ImapServer, smtp: tuple[Outbox, int]) -> None:
    outbox, port = smtp
    ran: list[str] = []
    runtime = await build_runtime(settings, asking_model(), tools=ToolRegistry([writing_tool(ran)]))
    settling(runtime, EmailChannel(spec(mailbox, port), chat_services(runtime)))
    async with running(runtime, recover=True):
        mailbox.deliver(mail(ANA, "Write my note.", "n1@example.test", subject="Notes"))
        [request] = await mails_sent(outbox, 1)
        short = request.get_body(("plain",)).get_content().rsplit("/deny ", 1)[1].strip()
        thread = ["n1@example.test", ids(request["Message-ID"])[0]]
        mailbox.deliver(mail("ben@team.test", f"/approve {short}", "b2@team.test", subject="Notes", replying=thread))
        refused = (await mails_sent(outbox, 2))[1]
        mailbox.deliver(mail(ANA, f"/approve {short}\n\nOn Sunday, Ember wrote:\n> Allow?", "n2@example.test",
                             subject="Notes", replying=thread))
        sent = await mails_sent(outbox, 4)
    assert refused["To"] == "ben@team.test" and "not yours to answer" in refused.get_body(("plain",)).get_content()
    assert ran == ["notes.txt"]
    answers = {new_text(m.get_body(("plain",)).get_content()) for m in sent[2:]}
    assert answers == {"Allowed once.", "Result: wrote notes.txt"}
