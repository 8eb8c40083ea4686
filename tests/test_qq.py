"""The QQ channel against an OpenAPI of the tests' own (tests/qqserver.py), called back with
signed events as QQ posts them: only QQ's signature gets in; each message is answered once,
in replies whose msg_seq never repeats, across restarts too; long answers are split; the
token is cached and fetched again after a 401; approvals are text commands only their
person can give; strangers get one refusal and leave nothing."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.app.tools import workspaces
from ember.channels.gateway.http import ApiError
from ember.channels.qq.channel import ACK, CUT, MAX_MESSAGE_CHARS, QQChannel
from ember.channels.qq.config import QQSpec
from ember.channels.qq.signing import HEADER_SIGNATURE, HEADER_TIMESTAMP, QQSigner
from ember.config.settings import Settings
from ember.core.errors import ConfigError
from ember.core.events import OutboundEvent, OutboundKind
from ember.core.messages import Message, Role
from ember.memory.embeddings import HashingEmbedder
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store.tx import Statement
from ember.tools.base import ToolRegistry
from tests.chatplatform import asking_model, kept, sending_model, settled_in, settling, texts_when, writing_tool
from tests.loopback import LoopbackServer
from tests.qqserver import APP_ID, SECRET, FakeQQ, serving_qq
from tests.test_attachments import pdf, png

# user_openids of direct chats; a group's member_openids differ from them (and from group to group)
ANA, BEN, STRANGER = "E4F4AEA33253A2797FB897C50B81D7ED", "0B3D6A1F9C2E4B5A8D7C6E5F4A3B2C1D", "F0F0F0F0"
GROUP = "C9F778FE6ADF9D1D1DBE395BF744A33A"
ANA_IN_GROUP, BEN_IN_GROUP = "A1A1A1A1B2B2B2B2C3C3C3C3D4D4D4D4", "B2B2B2B2C3C3C3C3D4D4D4D4E5E5E5E5"


@pytest.fixture
def qq() -> Iterator[FakeQQ]:
    with serving_qq() as fake:
        yield fake


class Clock:
    """Monotonic seconds a test moves on by hand (the token's lifetime)."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def on_loop(endpoint: Callable[[Request], Awaitable[Response]],
            loop: asyncio.AbstractEventLoop) -> Callable[[Request], Awaitable[Response]]:
    """The gateway runs a channel's routes on the runtime's event loop; the loopback server's thread
    has a loop of its own, so each call is handed, with its body, to the runtime's."""
    async def call(request: Request) -> Response:
        body = await request.body()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(endpoint(Request(request.scope, receive)),
                                                                          loop))
    return call


@dataclass
class Agent:
    runtime: Runtime
    channel: QQChannel
    fake: FakeQQ
    http: httpx.AsyncClient

    async def post(self, payload: dict[str, Any] | bytes, *, headers: dict[str, str] | None = None,
                   secret: str | None = None) -> httpx.Response:
        """POST a callback to /channels/qq, signed as QQ signs it (or with the given headers)."""
        body, signed = self.fake.signed(payload, secret=secret)
        return await self.http.post("/channels/qq", content=body, headers=signed if headers is None else headers)


def spec(fake: FakeQQ, **fields: Any) -> QQSpec:
    return QQSpec(app_id=APP_ID, secret=SECRET, api_base_url=fake.origin, token_url=fake.token_url, **fields)


@asynccontextmanager
async def agent(settings: Settings, model: FunctionModel, fake: FakeQQ, *, tools: ToolRegistry | None = None,
                clock: Clock | None = None, builtin_tools: bool = False, **fields: Any) -> AsyncIterator[Agent]:
    # The hashing embedder: the local model's embedding of long answers is not what these tests are about.
    runtime = await build_runtime(settings, model, tools=None if builtin_tools else tools or ToolRegistry(),
                                  embedder=HashingEmbedder())
    channel = QQChannel(spec(fake, **fields), chat_services(runtime),
                        **({"clock": clock} if clock else {}))
    settling(runtime, channel)
    loop = asyncio.get_running_loop()
    routes = [Route(r.path, on_loop(r.endpoint, loop), methods=list(r.methods or ())) for r in channel.routes()]
    app = Starlette(routes=routes, exception_handlers={ApiError: lambda request, exc: exc.response()})
    server = LoopbackServer(app, "qq-callbacks")
    async with running(runtime, recover=True):
        server.start()
        try:
            async with httpx.AsyncClient(base_url=server.origin) as http:
                yield Agent(runtime, channel, fake, http)
        finally:
            server.stop()


def answering(text: str | Callable[[str], str]) -> FunctionModel:
    def reply(messages: list[Message], tools: Any) -> ModelReply:
        question = [m for m in messages if m.role is Role.USER][-1].content
        return ModelReply(text=text(question) if callable(text) else text)
    return FunctionModel(reply, chunk_size=256)


async def replies(bot: Agent, chat: str, count: int = 1, *, turn_waits: bool = False,
                  timeout_s: float = 30) -> list[str]:
    """The chat's replies once they are `count`, and nothing the agent would send it is under way
    (`turn_waits`: but the turn waiting for a person's decision)."""
    async def settled() -> None:
        await bot.channel.replies_sent()  # an approval command's decision may let a turn go on
        await settled_in(bot.runtime, bot.channel.name).settled(chat, turn_waits=turn_waits)
    return await texts_when(lambda: bot.fake.texts(chat), count, settled, timeout_s=timeout_s)


async def test_the_callback_url_check_is_answered_with_its_signature(settings: Settings, qq: FakeQQ) -> None:
    check = {"op": 13, "d": {"plain_token": "Arq0D5A61EgUu4OxUvOp", "event_ts": "1725442341"}}
    async with agent(settings, answering("hi"), qq) as bot:
        answered = await bot.post(check)
        unsigned = await bot.post(check, headers={"Content-Type": "application/json"})
    assert answered.status_code == 200
    assert answered.json() == QQSigner(SECRET).validation_response(check)
    assert QQSigner(SECRET).verify(answered.json()["signature"], "1725442341", b"Arq0D5A61EgUu4OxUvOp")
    assert unsigned.status_code == 401


async def test_only_calls_signed_by_qq_get_in_and_nothing_else_is_kept(settings: Settings, qq: FakeQQ) -> None:
    model = answering("hi")
    async with agent(settings, model, qq) as bot:
        event = qq.direct(ANA, "let me in")
        body, headers = qq.signed(event)
        other_secret = await bot.post(event, secret="not-the-bot-secret")
        changed = await bot.http.post("/channels/qq", content=body.replace(b"let me in", b"run rm -rf"),
                                      headers=headers)
        no_signature = await bot.post(event, headers={k: v for k, v in headers.items() if k != HEADER_SIGNATURE})
        no_timestamp = await bot.post(event, headers={k: v for k, v in headers.items() if k != HEADER_TIMESTAMP})
        not_json = await bot.post(b"{not json")
        await bot.channel.replies_sent()
        await settled_in(bot.runtime, bot.channel.name).settled(f"c2c:{ANA}")  # a turn let in would be over
        stored = await kept(bot.runtime, ANA)
    statuses = [r.status_code for r in (other_secret, changed, no_signature, no_timestamp)]
    assert statuses == [401, 401, 401, 401]
    assert all(r.json()["error"]["code"] == "invalid_signature" for r in (other_secret, changed, no_signature))
    assert not_json.status_code == 400  # signed, but not a callback
    assert stored == 0 and model.requests == [] and qq.replies == []


async def test_a_direct_message_is_answered_as_reply_1_to_it(settings: Settings, qq: FakeQQ) -> None:
    async with agent(settings, answering(lambda q: f"You said: {q}"), qq) as bot:
        event = qq.direct(ANA, "  hello &amp; welcome ")
        acked = await bot.post(event)
        texts = await replies(bot, f"c2c:{ANA}")
        history = await bot.runtime.sessions.history(f"qq:c2c:{ANA}")
    assert acked.status_code == 200 and acked.json() == ACK
    assert texts == ["You said: hello & welcome"]
    [reply] = qq.replies
    assert (reply.msg_id, reply.msg_seq) == (event["d"]["id"], 1)
    assert [m.content for m in history if m.role is Role.USER] == ["hello & welcome"]


async def test_a_group_at_message_is_answered_in_the_group(settings: Settings, qq: FakeQQ) -> None:
    model = answering(lambda q: f"Re: {q}")
    async with agent(settings, model, qq) as bot:
        event = qq.group(GROUP, ANA_IN_GROUP, "what time is it?")
        await bot.post(event)
        texts = await replies(bot, f"group:{GROUP}")
    assert texts == ["Re: what time is it?"]  # the @-mention is not part of the question
    [reply] = qq.replies
    assert (reply.msg_id, reply.msg_seq) == (event["d"]["id"], 1)
    assert len(model.requests) == 1


async def test_a_replayed_event_is_answered_once(settings: Settings, qq: FakeQQ) -> None:
    model = answering(lambda q: f"You said: {q}")
    async with agent(settings, model, qq) as bot:
        event = qq.direct(ANA, "hello once")
        first = await bot.post(event)
        await replies(bot, f"c2c:{ANA}")
        again = [await bot.post(event), await bot.post(event)]
        texts = await replies(bot, f"c2c:{ANA}")
    assert [r.json() for r in (first, *again)] == [ACK] * 3  # QQ is told each time that it arrived
    assert texts == ["You said: hello once"]
    assert len([r for r in model.requests if r[-1].content == "hello once"]) == 1


async def test_an_answer_sent_again_is_not_shown_twice(settings: Settings, qq: FakeQQ) -> None:
    async with agent(settings, answering("Only once."), qq) as bot:
        event = qq.direct(ANA, "hello")
        await bot.post(event)
        await replies(bot, f"c2c:{ANA}")
        receipt = await bot.runtime.deliveries.store.receipt("qq", f"c2c:{ANA}", event["d"]["id"])
        assert receipt is not None
        answer = await bot.runtime.deliveries.store.answer_of(receipt.turn_id)
        assert answer is not None
        await bot.runtime.deliveries.send(answer)  # as a restart does with an answer it is not sure of
        texts = await replies(bot, f"c2c:{ANA}")
    assert texts == ["Only once."] and qq.refusals == []


async def test_msg_seq_continues_across_a_restart(settings: Settings, qq: FakeQQ) -> None:
    event = qq.direct(ANA, "first")
    message_id = event["d"]["id"]
    async with agent(settings, answering("The first answer."), qq) as bot:
        await bot.post(event)
        await replies(bot, f"c2c:{ANA}")
    async with agent(settings, answering("unused"), qq) as bot:  # a new process on the same home
        await bot.runtime.bus.publish_outbound(OutboundEvent(
            channel="qq", chat_id=f"c2c:{ANA}", kind=OutboundKind.FINAL, text="Another reply to it.",
            turn_id="turn-after-restart", reply_to=message_id))
        await replies(bot, f"c2c:{ANA}", 2)
    assert [(r.content, r.msg_seq) for r in qq.replies_to(message_id)] == [
        ("The first answer.", 1), ("Another reply to it.", 2)]
    assert qq.refusals == []
    # The fake refuses a repeat as QQ does, so seq 2 above was not luck.
    async with httpx.AsyncClient(base_url=qq.origin) as http:
        token = (await http.post("/app/getAppAccessToken", json={"appId": APP_ID, "clientSecret": SECRET})).json()
        repeat = await http.post(f"/v2/users/{ANA}/messages", json={
            "content": "again", "msg_type": 0, "msg_id": message_id, "msg_seq": 1},
            headers={"Authorization": f"QQBot {token['access_token']}"})
    assert repeat.status_code == 400 and repeat.json()["code"] == 40054005


async def test_an_answer_cut_off_by_failures_is_finished_after_a_restart(settings: Settings, qq: FakeQQ) -> None:
    paragraphs = [f"Part {n}. " + " ".join(["Nothing is sent twice."] * 60) for n in range(2)]
    answer = "\n\n".join(paragraphs)
    event = qq.direct(ANA, "two parts, please")
    qq.failures = [None, 502, 502, 502, 502]  # every try of the second part fails: the answer stays owed
    async with agent(settings, answering(answer), qq) as bot:
        await bot.post(event)
        async with asyncio.timeout(30):
            while len(qq.refusals) < 4:
                await asyncio.sleep(0.05)
    assert qq.texts(f"c2c:{ANA}") == [paragraphs[0]]
    async with agent(settings, answering("unused"), qq) as bot:  # sends what it owes, at start
        texts = await replies(bot, f"c2c:{ANA}", 2)
    assert texts == paragraphs  # the first part is not sent again
    # Seq 2 was tried before the restart, and is not used again.
    assert [r.msg_seq for r in qq.replies_to(event["d"]["id"])] == [1, 3]
    assert not [r for r in qq.refusals if r.code == 40054005]


async def test_a_long_answer_is_split_into_replies_with_rising_msg_seq(settings: Settings, qq: FakeQQ) -> None:
    paragraphs = [f"Paragraph {n}. " + " ".join(["All work and no play."] * 20) for n in range(10)]
    long_answer = "\n\n".join(paragraphs)
    assert len(long_answer) > 2 * MAX_MESSAGE_CHARS
    async with agent(settings, answering(long_answer), qq) as bot:
        await bot.post(qq.direct(ANA, "write a lot"))
        texts = await replies(bot, f"c2c:{ANA}", 3)
    assert len(texts) == 3 and all(len(text) <= MAX_MESSAGE_CHARS for text in texts)
    assert "\n\n".join(texts) == long_answer  # cut at paragraph breaks, nothing lost or repeated
    assert [r.msg_seq for r in qq.replies] == [1, 2, 3]


async def test_an_answer_longer_than_five_replies_says_where_it_is_cut(settings: Settings, qq: FakeQQ) -> None:
    paragraphs = [f"Paragraph {n}. " + " ".join(["All work and no play."] * 20) for n in range(30)]
    async with agent(settings, answering("\n\n".join(paragraphs)), qq) as bot:
        await bot.post(qq.direct(ANA, "write even more"))
        texts = await replies(bot, f"c2c:{ANA}", 5)
    assert len(texts) == 5 and all(len(text) <= MAX_MESSAGE_CHARS for text in texts)
    assert texts[-1].endswith(CUT) and [r.msg_seq for r in qq.replies] == [1, 2, 3, 4, 5]
    assert qq.refusals == []


async def test_the_token_is_cached_and_fetched_again_once_after_a_401(settings: Settings, qq: FakeQQ) -> None:
    clock = Clock()
    async with agent(settings, answering(lambda q: f"Re: {q}"), qq, clock=clock) as bot:
        await bot.post(qq.direct(ANA, "one"))
        await bot.post(qq.direct(BEN, "two"))
        await replies(bot, f"c2c:{ANA}")
        await replies(bot, f"c2c:{BEN}")
        cached = qq.token_fetches
        qq.expire_tokens()  # QQ ended the token early
        await bot.post(qq.direct(ANA, "three"))
        await replies(bot, f"c2c:{ANA}", 2)
        after_401 = qq.token_fetches
        clock.now += 7_200 - 30  # within the last minute of the token's 7200 s
        await bot.post(qq.direct(ANA, "four"))
        await replies(bot, f"c2c:{ANA}", 3)
    assert cached == 1  # fetched at start, then reused
    assert after_401 == 2 and [r.status for r in qq.refusals] == [401]
    assert qq.token_fetches == 3
    assert [r.token for r in qq.replies] == ["token-1", "token-1", "token-2", "token-3"]


async def test_429s_are_waited_out_with_the_same_msg_seq(settings: Settings, qq: FakeQQ) -> None:
    qq.failures = [429, 429]
    async with agent(settings, answering("Patience."), qq) as bot:
        await bot.post(qq.direct(ANA, "hello"))
        texts = await replies(bot, f"c2c:{ANA}")
    assert texts == ["Patience."]
    assert [(r.status, r.msg_seq) for r in qq.refusals] == [(429, 1), (429, 1)]
    assert [r.msg_seq for r in qq.replies] == [1]


def request_id(text: str) -> str:
    found = re.search(r"Reply /approve (\S+) or /deny \1$", text)
    assert found, text
    return found[1]


async def test_only_the_turns_person_can_approve_its_request(settings: Settings, qq: FakeQQ) -> None:
    ran: list[str] = []
    chat = f"group:{GROUP}"
    async with agent(settings, asking_model(), qq, tools=ToolRegistry([writing_tool(ran)])) as bot:
        asked = qq.group(GROUP, ANA_IN_GROUP, "write my note")
        await bot.post(asked)
        [card] = await replies(bot, chat, turn_waits=True)
        assert "write the file notes.txt" in card
        short = request_id(card)
        await bot.post(qq.group(GROUP, BEN_IN_GROUP, f"/approve {short}"))
        refused = await replies(bot, chat, 2, turn_waits=True)
        assert refused[-1] == "This request is not yours to answer."
        assert ran == []  # Ben's command changed nothing
        await bot.post(qq.group(GROUP, ANA_IN_GROUP, f"/approve {short}"))
        texts = await replies(bot, chat, 4)
        commands_kept = await kept(bot.runtime, BEN_IN_GROUP)
    assert ran == ["notes.txt"]
    assert sorted(texts[2:]) == ["Allowed once.", "Result: wrote notes.txt"]
    assert [r.msg_seq for r in qq.replies_to(asked["d"]["id"])] == [1, 2]  # the request, then the answer
    assert commands_kept == 0  # a command is not a turn


async def test_an_expired_request_says_so(settings: Settings, qq: FakeQQ) -> None:
    ran: list[str] = []
    config = settings.model_copy(update={"tool_policy": settings.tool_policy.model_copy(update={"timeout_s": 0.5})})
    async with agent(config, asking_model(), qq, tools=ToolRegistry([writing_tool(ran)])) as bot:
        await bot.post(qq.direct(ANA, "write my note"))
        card, _denied = await replies(bot, f"c2c:{ANA}", 2)  # the request, then the answer without it
        await bot.post(qq.direct(ANA, f"/approve {request_id(card)}"))
        texts = await replies(bot, f"c2c:{ANA}", 3)
    assert ran == []
    assert "expired" in texts[-1]


async def test_a_stranger_gets_one_refusal_and_nothing_is_kept(settings: Settings, qq: FakeQQ) -> None:
    model = answering("hi")
    async with agent(settings, model, qq, allowed_users=[ANA, BEN]) as bot:
        await bot.post(qq.direct(STRANGER, "let me in"))
        await bot.post(qq.direct(STRANGER, "please"))
        await bot.post(qq.direct(ANA, "hello"))
        await replies(bot, f"c2c:{ANA}")
        refusals = await replies(bot, f"c2c:{STRANGER}")
        stored = await kept(bot.runtime, STRANGER)
        history = await bot.runtime.sessions.history(f"qq:c2c:{STRANGER}")
        counters = await bot.runtime.db.run_read(lambda tx: tx.execute(Statement(
            "SELECT COUNT(*) FROM channel_counters")).fetchone()[0])
    [refusal] = refusals
    assert STRANGER in refusal and "allowed" in refusal
    assert stored == 0 and history == [] and len(model.requests) == 1
    assert counters == 1  # Ana's message's; none for the stranger's


async def test_a_wrong_secret_fails_the_start_without_showing_it(settings: Settings, qq: FakeQQ) -> None:
    runtime = await build_runtime(settings, answering("hi"), tools=ToolRegistry(), embedder=HashingEmbedder())
    wrong = QQSpec(app_id=APP_ID, secret="wrong-secret-value", api_base_url=qq.origin, token_url=qq.token_url)
    channel = QQChannel(wrong, chat_services(runtime))
    runtime.channels.register(channel)
    with pytest.raises(ConfigError, match="QQ refused the token") as refused:
        async with running(runtime):
            pass
    await channel.stop()  # a channel whose start failed is not stopped by the runtime
    assert "wrong-secret-value" not in str(refused.value)
    assert qq.replies == []


async def test_a_picture_and_a_voice_note_reach_the_turn_and_the_answers_pictures_follow_its_text(
        settings: Settings, qq: FakeQQ) -> None:
    seen: list[Message] = []
    voice = {"content_type": "voice", "url": f"{qq.origin}/media/voice.silk", "filename": "voice.silk",
             "voice_wav_url": f"{qq.origin}/media/voice.wav", "asr_refer_text": "send me the chart and the plan"}
    async with agent(settings, sending_model("chart.png", "plan.pdf", seen=seen), qq, builtin_tools=True) as bot:
        folder = workspaces(settings, None).for_identity(bot.runtime.identities.resolve("qq", "u1")).root
        (folder / "chart.png").write_bytes(png(8, 8))
        (folder / "plan.pdf").write_bytes(pdf("Day 1"))
        await bot.post(qq.direct("u1", "", attachments=[qq.picture("cat.png", png(4, 4))]))
        await replies(bot, "c2c:u1", 1)
        await bot.post(qq.direct("u1", "", attachments=[voice]))
        texts = await replies(bot, "c2c:u1", 3)
        gone = {"content_type": "image/png", "url": f"{qq.origin}/media/gone"}
        lost = await bot.post(qq.direct("u1", "", attachments=[gone]))
        told = await replies(bot, "c2c:u1", 4)
    assert seen[0].attachments[0].media_type == "image/png" and seen[1].content == "send me the chart and the plan"
    named = f"\n\n[plan.pdf (application/pdf, {len(pdf('Day 1'))} bytes): this chat cannot show files]"
    assert texts == ["A small picture.", "Here you are." + named, ""]
    [shown] = [r for r in qq.replies if r.picture]
    assert shown.picture == png(8, 8) and shown.msg_seq == 2  # the second reply to the voice note
    assert lost.status_code == 200 and told[-1].startswith("I could not take that file: it could not be fetched")
