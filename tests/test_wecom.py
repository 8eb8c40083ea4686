"""The WeCom and Official Account channels against platform APIs of the tests' own (tests/wecomserver.py),
called back with real signed and encrypted pushes: the URL checks; forged pushes refused and nothing kept;
a fast answer as the passive reply, a slow one through the send API, never both; a retried push runs one
turn and is answered once; the access token cached and fetched again after 42001; long answers split;
approvals by /approve only from their person; strangers refused once; a picture taken in and an answer's
files sent after its text (named where the platform cannot send them)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.app.tools import workspaces
from ember.channels.gateway.http import ApiError
from ember.channels.wecom.channel import (
    MAX_MESSAGE_BYTES,
    NOT_READ,
    WeChatOfficialChannel,
    WeComChannel,
    byte_pieces,
)
from ember.channels.wecom.config import WeChatOfficialSpec, WeComSpec
from ember.config.settings import Settings
from ember.core.events import OutboundEvent, OutboundKind
from ember.core.messages import Message as ChatMessage
from ember.core.messages import Role
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store.tx import Statement
from ember.tools.base import ToolRegistry
from tests.chatplatform import asking_model, kept, sending_model, settled_in, settling, texts_when, writing_tool
from tests.loopback import LoopbackServer
from tests.test_attachments import pdf, png
from tests.wecomserver import (
    ACCOUNT,
    AES_KEY,
    AGENT_ID,
    APP_ID,
    APP_SECRET,
    CORP_ID,
    CORP_SECRET,
    TOKEN,
    FakeWeixin,
    Push,
    read_reply,
    serving_weixin,
    wechat_push,
    wechat_url_check,
    wecom_push,
    wecom_url_check,
)

ANA, BEN, STRANGER = "ana", "ben", "mallory"  # WeCom UserIDs
FAN = "oLOkR5PG536EbZgd9WcCfGaLfoM8"  # an OpenID


@pytest.fixture
def weixin() -> Any:
    with serving_weixin() as served:
        yield served


def wecom_spec(base_url: str, **fields: Any) -> WeComSpec:
    return WeComSpec(corp_id=CORP_ID, agent_id=AGENT_ID, secret=CORP_SECRET, token=TOKEN, encoding_aes_key=AES_KEY,
                     api_base_url=base_url, **{"allowed_users": [ANA, BEN], **fields})


def wechat_spec(base_url: str, *, safe: bool = True, **fields: Any) -> WeChatOfficialSpec:
    return WeChatOfficialSpec(app_id=APP_ID, secret=APP_SECRET, token=TOKEN,
                              encoding_aes_key=AES_KEY if safe else None, api_base_url=base_url, **fields)


class OnLoop:
    """An ASGI app run on `loop` (the runtime's) for a LoopbackServer's thread: `ember serve` runs the gateway
    on the runtime's own loop, where the channel's futures and the bus live."""

    def __init__(self, app: ASGIApp, loop: asyncio.AbstractEventLoop) -> None:
        self._app = app
        self._loop = loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        given: list[Message] = []
        requests = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> Message:
            return requests.pop() if requests else {"type": "http.disconnect"}

        async def keep(message: Message) -> None:
            given.append(message)

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._app(scope, replay, keep), self._loop))
        for message in given:
            await send(message)


@dataclass
class Served:
    runtime: Runtime
    channel: WeComChannel | WeChatOfficialChannel
    http: httpx.AsyncClient  # to the channel's routes

    async def push(self, push: Push) -> httpx.Response:
        return await self.http.post(self.channel.path, params=push.params, content=push.body)

    async def reply(self, push: Push) -> dict[str, str]:
        """The passive reply's fields ({} for an empty answer), checked as the platform checks it."""
        response = await self.push(push)
        assert response.status_code == 200, response.text
        return read_reply(response.text, CORP_ID if isinstance(self.channel, WeComChannel) else APP_ID)


@asynccontextmanager
async def serving(settings: Settings, model: FunctionModel, spec: WeComSpec | WeChatOfficialSpec, *,
                  tools: ToolRegistry | None = None, clock: Callable[[], float] | None = None,
                  builtin_tools: bool = False) -> AsyncIterator[Served]:
    # Memory is not what these tests are about: the hashing embedder spares loading the e5 model.
    light = settings.model_copy(update={"embedding_model": "hashing"})
    runtime = await build_runtime(light, model, tools=None if builtin_tools else tools or ToolRegistry())
    extra = {"clock": clock} if clock else {}
    args = (chat_services(runtime),)
    channel = WeComChannel(spec, *args, **extra) if isinstance(spec, WeComSpec) \
        else WeChatOfficialChannel(spec, *args, **extra)
    settling(runtime, channel)
    app = Starlette(routes=channel.routes(), exception_handlers={ApiError: lambda request, exc: exc.response()})
    server = LoopbackServer(OnLoop(app, asyncio.get_running_loop()), f"{channel.name}-callbacks")
    async with running(runtime, recover=True):
        server.start()
        try:
            async with httpx.AsyncClient(base_url=server.origin, trust_env=False, timeout=30) as http:
                yield Served(runtime, channel, http)
        finally:
            server.stop()


def answering(text: str | Callable[[str], str], *, gate: asyncio.Event | None = None) -> FunctionModel:
    """Answers `text` (or `text(question)`); with a gate, only once the test opens it."""
    async def reply(messages: list[ChatMessage], tools: Any) -> ModelReply:
        if gate is not None:
            await gate.wait()
        question = [m for m in messages if m.role is Role.USER][-1].content
        return ModelReply(text=text(question) if callable(text) else text)
    return FunctionModel(reply)


async def sent(served: Served, fake: FakeWeixin, user: str, count: int = 1, *,
               timeout_s: float = 30) -> list[str]:
    """What the API sent `user`, once it is `count` messages and nothing more is under way."""
    def settled() -> Awaitable[None]:
        return settled_in(served.runtime, served.channel.name).settled(user)
    return await texts_when(lambda: fake.texts(user), count, settled, timeout_s=timeout_s)


async def test_the_url_checks_answer_the_echo_and_refuse_a_bad_signature(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    _, base_url = weixin
    async with serving(settings, answering("hi"), wecom_spec(base_url)) as served:
        good = await served.http.get("/channels/wecom", params=wecom_url_check("1616140317555161061"))
        forged = await served.http.get("/channels/wecom", params={**wecom_url_check("x"), "msg_signature": "0" * 40})
    assert (good.status_code, good.text) == (200, "1616140317555161061")
    assert forged.status_code == 401
    async with serving(settings, answering("hi"), wechat_spec(base_url)) as served:
        good = await served.http.get("/channels/wechat", params=wechat_url_check("echo-4711"))
        forged = await served.http.get("/channels/wechat", params={**wechat_url_check("echo"), "nonce": "other"})
    assert (good.status_code, good.text) == (200, "echo-4711")
    assert forged.status_code == 401


async def test_a_forged_push_is_refused_and_nothing_is_kept(settings: Settings,
                                                             weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    model = answering("hi")
    async with serving(settings, model, wecom_spec(base_url)) as served:
        push = wecom_push(ANA, "hello", "1001")
        wrong_signature = await served.push(Push({**push.params, "msg_signature": "f" * 40}, push.body))
        other = wecom_push(ANA, "transfer everything", "1002")
        swapped_body = await served.push(Push(push.params, other.body))  # a valid signature, of another body
        unsigned = await served.push(Push({}, push.body))
        malformed = await served.push(Push(push.params, "<xml><Encrypt>"))
        held = await kept(served.runtime, ANA)
    assert [r.status_code for r in (wrong_signature, swapped_body, unsigned)] == [401, 401, 401]
    assert malformed.status_code == 400
    assert held == 0 and model.requests == [] and fake.sent == []


async def test_a_fast_answer_is_the_passive_reply_and_nothing_is_sent(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    model = answering(lambda question: f"You said: {question}")
    async with serving(settings, model, wecom_spec(base_url)) as served:
        reply = await served.reply(wecom_push(ANA, "hello there", "2001"))
        await settled_in(served.runtime, served.channel.name).settled(ANA)  # a second copy via the API shows by then
    assert reply["Content"] == "You said: hello there"
    assert (reply["ToUserName"], reply["FromUserName"], reply["MsgType"]) == (ANA, CORP_ID, "text")
    assert fake.sent == []


async def test_a_slow_answer_goes_through_the_send_api_once(settings: Settings,
                                                             weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    gate = asyncio.Event()
    async with serving(settings, answering("Sorry for the wait: 42.", gate=gate),
                       wecom_spec(base_url, passive_reply_s=0.5)) as served:
        response = await served.push(wecom_push(ANA, "the answer?", "3001"))
        gate.set()  # the model answers only after the POST gave up waiting
        texts = await sent(served, fake, ANA)
    assert (response.status_code, response.text) == (200, "")
    assert texts == ["Sorry for the wait: 42."]
    assert fake.sent[0].agent_id == AGENT_ID


async def test_a_retried_push_runs_one_turn_and_is_answered_once(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    gate = asyncio.Event()
    model = answering(lambda question: f"Once: {question}", gate=gate)
    async with serving(settings, model, wecom_spec(base_url)) as served:
        push = wecom_push(ANA, "only once", "4001")
        first = asyncio.create_task(served.reply(push))
        async with asyncio.timeout(20):
            while not model.requests:  # kept, and its turn asks the model
                await asyncio.sleep(0.02)
        retries = [await served.reply(push) for _ in range(3)]  # the platform's three retries
        gate.set()
        replies = [await first, *retries]
        await settled_in(served.runtime, served.channel.name).settled(ANA)
        late = await served.reply(push)
    passive = [r["Content"] for r in replies if r]
    assert retries == [{}, {}, {}] and late == {}
    assert passive + fake.texts(ANA) == ["Once: only once"]  # as the passive reply, or else through the API
    assert len(model.requests) == 1


async def test_the_access_token_is_cached_and_fetched_again_once_after_42001(
        settings: Settings, weixin: tuple[FakeWeixin, str], caplog: pytest.LogCaptureFixture) -> None:
    fake, base_url = weixin
    caplog.set_level(logging.DEBUG)
    now = [1_000.0]
    async with serving(settings, answering(lambda question: f"Re: {question}"),
                       wecom_spec(base_url, passive_reply_s=0), clock=lambda: now[0]) as served:
        for n in range(3):
            await served.push(wecom_push(ANA, f"question {n}", f"500{n}"))
            await sent(served, fake, ANA, n + 1)
        assert fake.token_calls == 1  # the start's check, and three sends
        fake.expire_tokens()
        await served.push(wecom_push(ANA, "after the expiry", "5010"))
        texts = await sent(served, fake, ANA, 4)
        assert (fake.token_calls, fake.send_calls) == (2, 5)  # refused once with 42001, fetched once, sent
        now[0] += 7_200  # the token's expires_in has passed: fetched before it is used
        await served.push(wecom_push(ANA, "two hours later", "5020"))
        texts = await sent(served, fake, ANA, 5)
    assert texts == ["Re: question 0", "Re: question 1", "Re: question 2", "Re: after the expiry",
                     "Re: two hours later"]
    assert (fake.token_calls, fake.send_calls) == (3, 6)
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("ember"))
    assert "refused its access token" in ours
    assert CORP_SECRET not in ours and "ACCESS-" not in ours


async def test_a_rate_limit_is_waited_out_and_a_refusal_is_given_up(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    async with serving(settings, answering(lambda question: f"Re: {question}"),
                       wecom_spec(base_url, passive_reply_s=0)) as served:
        fake.refuse_next(45009)
        await served.push(wecom_push(ANA, "busy?", "6001"))
        assert await sent(served, fake, ANA) == ["Re: busy?"]
        assert fake.send_calls == 2
        fake.refuse_next(81013)  # the person left the app's visibility: no retry helps
        await served.push(wecom_push(ANA, "still there?", "6002"))

        async def given_up() -> list[str]:
            return await served.runtime.db.run_read(lambda tx: [row[0] for row in tx.execute(Statement(
                "SELECT failure FROM outbox WHERE failure IS NOT NULL")).fetchall()])

        async with asyncio.timeout(20):
            while not (failures := await given_up()):
                await asyncio.sleep(0.05)
    assert "errcode 81013" in failures[0]
    assert fake.texts(ANA) == ["Re: busy?"] and fake.send_calls == 3


async def test_a_long_answer_is_split_into_messages_that_join_back(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    english = [f"Paragraph {n}. " + " ".join(["All work and no play."] * 12) for n in range(10)]
    chinese = [f"第{n}段。" + "只工作不玩耍，聪明的孩子也变傻。" * 20 for n in range(8)]
    answer = "\n\n".join(english + chinese)
    assert len(answer.encode()) > 4 * MAX_MESSAGE_BYTES
    async with serving(settings, answering(answer), wecom_spec(base_url)) as served:
        response = await served.push(wecom_push(ANA, "write a lot", "7001"))
        await sent(served, fake, ANA, 3)
        async with asyncio.timeout(20):
            while "\n\n".join(fake.texts(ANA)) != answer:
                await asyncio.sleep(0.05)
        texts = await sent(served, fake, ANA)
    assert response.text == ""  # several messages: none is the passive reply, all go in order through the API
    assert "\n\n".join(texts) == answer and len(texts) >= 5
    assert all(len(text.encode()) <= MAX_MESSAGE_BYTES for text in texts)
    assert all(text.startswith(("Paragraph", "第")) for text in texts)  # cut at paragraph breaks


def test_pieces_fit_the_byte_limit_whatever_the_characters() -> None:
    emoji = "😀" * 3_000  # 4 bytes each, and nowhere a reader would cut
    pieces = byte_pieces(emoji, MAX_MESSAGE_BYTES)
    assert "".join(pieces) == emoji and all(len(p.encode()) <= MAX_MESSAGE_BYTES for p in pieces)
    assert len(pieces) == 6  # 12 000 bytes in as few messages as fit
    assert byte_pieces("short", MAX_MESSAGE_BYTES) == ["short"]


async def test_a_final_sent_again_after_a_restart_sends_nothing_twice(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    answer = "\n\n".join(f"Part {n}. " + "x" * 1_500 for n in range(3))
    final = OutboundEvent(channel="wecom", chat_id=ANA, kind=OutboundKind.FINAL, text=answer, turn_id="t-restart",
                          reply_to="8001", stream_full_text=True, delivery_id="t-restart:2")
    async with serving(settings, answering("unused"), wecom_spec(base_url)) as served:
        await served.channel.deliver(final)
        assert len(fake.texts(ANA)) == 3
        runtime = served.runtime
        again = WeComChannel(wecom_spec(base_url), chat_services(runtime))  # the next process: nothing in memory
        await again.deliver(final)
        await again.stop()
    assert fake.texts(ANA) == answer.split("\n\n")


async def approval_request(served: Served, fake: FakeWeixin, push: Push) -> tuple[str, str]:
    """The request's text, as the passive reply or else through the API, and its short id."""
    reply = await served.reply(push)
    async with asyncio.timeout(20):
        while not reply and not fake.texts(ANA):
            await asyncio.sleep(0.05)
    text = reply.get("Content") or fake.texts(ANA)[0]
    found = re.search(r"Reply /approve (\S+) or /deny \1$", text)
    assert found, text
    return text, found[1]


async def test_only_the_turns_person_can_approve(settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    ran: list[str] = []
    model = asking_model()
    async with serving(settings, model, wecom_spec(base_url), tools=ToolRegistry([writing_tool(ran)])) as served:
        text, short = await approval_request(served, fake, wecom_push(ANA, "write my note", "9001"))
        assert "write the file notes.txt" in text
        refused = await served.reply(wecom_push(BEN, f"/approve {short}", "9002"))
        assert refused["Content"] == "This request is not yours to answer." and ran == []
        allowed = await served.reply(wecom_push(ANA, f"/approve {short}", "9003"))
        assert allowed["Content"] == "Allowed once."
        async with asyncio.timeout(20):
            while "Result: wrote notes.txt" not in fake.texts(ANA):
                await asyncio.sleep(0.05)
        again = await served.reply(wecom_push(ANA, f"/deny {short}", "9004"))
        held = await kept(served.runtime, ANA), await kept(served.runtime, BEN)
    assert ran == ["notes.txt"]
    assert again["Content"] == "This request was answered already."
    assert held == (1, 0) and len(model.requests) == 2  # the commands are no turns


async def test_an_expired_request_says_so(settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    ran: list[str] = []
    config = settings.model_copy(update={"tool_policy": settings.tool_policy.model_copy(update={"timeout_s": 0.5})})
    async with serving(config, asking_model(), wecom_spec(base_url), tools=ToolRegistry([writing_tool(ran)])) as served:
        _, short = await approval_request(served, fake, wecom_push(ANA, "write my note", "9101"))
        async with asyncio.timeout(20):
            while not any(t.startswith("Result:") for t in fake.texts(ANA)):  # denied by the timeout, answered
                await asyncio.sleep(0.05)
        late = await served.reply(wecom_push(ANA, f"/approve {short}", "9102"))
    assert ran == []
    assert late["Content"].startswith("This request expired")


async def test_a_stranger_is_refused_once_and_nothing_is_kept(settings: Settings,
                                                              weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    model = answering("hi")
    async with serving(settings, model, wecom_spec(base_url)) as served:
        first = await served.reply(wecom_push(STRANGER, "let me in", "10001"))
        second = await served.reply(wecom_push(STRANGER, "please", "10002"))
        held = await kept(served.runtime, STRANGER)
        history = await served.runtime.sessions.history(f"wecom:{STRANGER}")
    assert STRANGER in first["Content"] and "allowed" in first["Content"]
    assert second == {} and held == 0 and history == []
    assert model.requests == [] and fake.sent == []


async def test_other_messages_get_a_note_and_events_nothing(settings: Settings,
                                                           weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    model = answering("hi")
    async with serving(settings, model, wecom_spec(base_url)) as served:
        video = await served.reply(wecom_push(ANA, "", "11001", msg_type="video"))
        retried = await served.reply(wecom_push(ANA, "", "11001", msg_type="video"))
        unheard = await served.reply(wecom_push(ANA, "", "11003", msg_type="voice"))  # no transcript with it
        lost = await served.reply(wecom_push(ANA, "no-such-media", "11004", msg_type="image"))
        entered = await served.reply(wecom_push(ANA, "enter_agent", "", msg_type="event"))
        other_app = await served.push(wecom_push(ANA, "hello", "11002", agent_id=AGENT_ID + 1))
    assert video["Content"] == unheard["Content"] == NOT_READ and retried == {}
    assert lost["Content"].startswith("I could not take that file: WeCom gave no picture: errcode 40007")
    assert entered == {} and other_app.status_code == 403
    assert model.requests == [] and fake.sent == []


async def test_an_official_account_in_safe_mode_replies_sealed_or_sends_a_customer_message(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    async with serving(settings, answering(lambda question: f"Re: {question}"), wechat_spec(base_url)) as served:
        reply = await served.reply(wechat_push(FAN, "hello account", "12001"))
        clear = await served.push(wechat_push(FAN, "in clear text", "12002", safe=False))
    assert (reply["Content"], reply["ToUserName"], reply["FromUserName"]) == ("Re: hello account", FAN, ACCOUNT)
    assert clear.status_code == 403 and fake.sent == []
    async with serving(settings, answering(lambda question: f"Later: {question}"),
                       wechat_spec(base_url, passive_reply_s=0)) as served:
        response = await served.push(wechat_push(FAN, "take your time", "12003"))
        texts = await sent(served, fake, FAN)
    assert response.text == "success"  # what the platform asks for when there is no passive reply
    assert texts == ["Later: take your time"]
    assert (fake.sent[0].platform, fake.sent[0].agent_id) == ("wechat", None)


async def test_an_official_account_in_plain_mode_checks_the_signature(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    model = answering(lambda question: f"Re: {question}")
    async with serving(settings, model, wechat_spec(base_url, safe=False)) as served:
        push = wechat_push(FAN, "plain hello", "13001", safe=False)
        forged = await served.push(Push({**push.params, "signature": "0" * 40}, push.body))
        response = await served.push(push)
        sealed = await served.push(wechat_push(FAN, "sealed", "13002"))
    assert forged.status_code == 401
    assert "<Encrypt>" not in response.text
    assert read_reply(response.text, APP_ID)["Content"] == "Re: plain hello"
    assert sealed.status_code == 403  # a safe-mode push, but no EncodingAESKey configured
    assert len(model.requests) == 1 and fake.sent == []


@pytest.mark.parametrize("platform", ["wecom", "wechat"])
async def test_a_picture_and_a_transcribed_voice_message_reach_the_turn_and_the_answers_files_follow_its_text(
        settings: Settings, weixin: tuple[FakeWeixin, str], platform: str) -> None:
    fake, base_url = weixin
    fake.media["pic1"] = (png(4, 4), "image/png")
    seen: list[ChatMessage] = []
    wecom = platform == "wecom"
    person, push = (ANA, wecom_push) if wecom else (FAN, wechat_push)
    spec = wecom_spec(base_url) if wecom else wechat_spec(base_url)
    async with serving(settings, sending_model("chart.png", "plan.pdf", seen=seen), spec, builtin_tools=True) as served:
        folder = workspaces(settings, None).for_identity(served.runtime.identities.resolve(platform, person)).root
        (folder / "chart.png").write_bytes(png(8, 8))
        (folder / "plan.pdf").write_bytes(pdf("Day 1"))
        picture = await served.reply(push(person, "pic1", "12001", msg_type="image"))
        spoken = await served.reply(push(person, "send me the chart and the plan", "12002", msg_type="voice"))
        files = await texts_when(lambda: [s.file for s in fake.sent if s.file], 2 if wecom else 1,
                                 lambda: settled_in(served.runtime, platform).settled(person))
    assert picture["Content"] == "A small picture." and seen[0].attachments[0].media_type == "image/png"
    assert seen[1].content == "send me the chart and the plan"
    named = f"\n\n[plan.pdf (application/pdf, {len(pdf('Day 1'))} bytes): this chat cannot show files]"
    assert spoken["Content"] == "Here you are." + ("" if wecom else named)
    assert files == [("chart.png", png(8, 8)), ("plan.pdf", pdf("Day 1"))][:2 if wecom else 1]
