"""The WeCom smart bot channel, called back with real signed and encrypted JSON pushes (tests/wecomserver.py):
the URL check; forged pushes refused and nothing kept; an answer shown over several stream refreshes and
finished with exactly the committed text, once; a retried msgid runs one turn; /approve only from the turn's
person; a stranger refused once; an answer later than the stream sent once through the response_url."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.channels.gateway.http import ApiError
from ember.channels.wecom.bot import LATER, WeComBotChannel, stream_id_of
from ember.channels.wecom.config import WeComBotSpec
from ember.config.settings import Settings
from ember.models.scripted import FunctionModel
from ember.store.tx import Statement
from ember.tools.base import ToolRegistry
from tests.chatplatform import asking_model, kept, settled_in, settling, writing_tool
from tests.loopback import LoopbackServer
from tests.test_wecom import OnLoop, answering
from tests.wecomserver import (
    AES_KEY,
    TOKEN,
    FakeWeixin,
    Push,
    bot_push,
    bot_refresh,
    bot_text,
    bot_url_check,
    read_bot_reply,
    serving_weixin,
    wecom_url_check,
)

ANA, BEN, STRANGER = "ana", "ben", "mallory"  # WeCom UserIDs


@pytest.fixture
def weixin() -> Any:
    with serving_weixin() as served:
        yield served


def bot_spec(**fields: Any) -> WeComBotSpec:
    return WeComBotSpec(token=TOKEN, encoding_aes_key=AES_KEY, **{"allowed_users": [ANA, BEN], **fields})


@dataclass
class Served:
    runtime: Runtime
    channel: WeComBotChannel
    http: httpx.AsyncClient  # to the channel's routes
    refreshes: Iterator[int] = field(default_factory=lambda: count(1))  # each refresh's own msgid

    async def push(self, push: Push) -> httpx.Response:
        return await self.http.post(self.channel.path, params=push.params, content=push.body)

    async def reply(self, message: dict[str, object]) -> dict[str, Any]:
        """The passive reply's message ({} for an empty answer), checked as the platform checks it."""
        push = bot_push(message)
        response = await self.push(push)
        assert response.status_code == 200, response.text
        return read_bot_reply(response.text, push.params["nonce"])

    async def refresh(self, user: str, stream_id: str) -> dict[str, Any]:
        return await self.reply(bot_refresh(user, stream_id, f"refresh-{next(self.refreshes)}"))

    async def refresh_until(self, user: str, stream_id: str, done: Any) -> list[dict[str, Any]]:
        """The stream's states, refreshed as the platform does until `done(state)`."""
        states = []
        async with asyncio.timeout(30):
            while True:
                reply = await self.refresh(user, stream_id)
                assert reply["msgtype"] == "stream" and reply["stream"]["id"] == stream_id, reply
                states.append(reply["stream"])
                if done(reply["stream"]):
                    return states
                await asyncio.sleep(0.05)


def finished(state: dict[str, Any]) -> bool:
    return bool(state["finish"])


@asynccontextmanager
async def serving(settings: Settings, model: FunctionModel, spec: WeComBotSpec, *,
                  tools: ToolRegistry | None = None) -> AsyncIterator[Served]:
    # Memory is not what these tests are about: the hashing embedder spares loading the e5 model.
    light = settings.model_copy(update={"embedding_model": "hashing"})
    runtime = await build_runtime(light, model, tools=tools or ToolRegistry())
    channel = WeComBotChannel(spec, chat_services(runtime))
    settling(runtime, channel)
    app = Starlette(routes=channel.routes(), exception_handlers={ApiError: lambda request, exc: exc.response()})
    server = LoopbackServer(OnLoop(app, asyncio.get_running_loop()), "wecom-bot-callbacks")
    async with running(runtime, recover=True):
        server.start()
        try:
            async with httpx.AsyncClient(base_url=server.origin, trust_env=False, timeout=30) as http:
                yield Served(runtime, channel, http)
        finally:
            server.stop()


async def committed(runtime: Runtime) -> list[str]:
    return await runtime.db.run_read(lambda tx: [row[0] for row in tx.execute(Statement(
        "SELECT text FROM outbox WHERE channel = 'wecom_bot' AND kind = 'final' ORDER BY created_at")).fetchall()])


async def test_the_url_check_answers_the_echo_and_refuses_a_bad_signature(settings: Settings) -> None:
    async with serving(settings, answering("hi"), bot_spec()) as served:
        good = await served.http.get(served.channel.path, params=bot_url_check("1616140317555161061"))
        forged = await served.http.get(served.channel.path, params={**bot_url_check("x"), "msg_signature": "0" * 40})
        for_an_app = await served.http.get(served.channel.path, params=wecom_url_check("sealed for a corp id"))
    assert (good.status_code, good.text) == (200, "1616140317555161061")
    assert forged.status_code == 401
    assert for_an_app.status_code == 400  # sealed for a corp id: a smart bot's receive id is ""


async def test_a_forged_push_is_refused_and_nothing_is_kept(settings: Settings) -> None:
    model = answering("hi")
    async with serving(settings, model, bot_spec()) as served:
        push = bot_push(bot_text(ANA, "hello", "msg-1001"))
        wrong_signature = await served.push(Push({**push.params, "msg_signature": "f" * 40}, push.body))
        other = bot_push(bot_text(ANA, "transfer everything", "msg-1002"))
        swapped_body = await served.push(Push(push.params, other.body))  # a valid signature, of another body
        unsigned = await served.push(Push({}, push.body))
        malformed = await served.push(Push(push.params, '{"encrypt": '))
        held = await kept(served.runtime, ANA)
    assert [r.status_code for r in (wrong_signature, swapped_body, unsigned)] == [401, 401, 401]
    assert malformed.status_code == 400
    assert held == 0 and model.requests == []


async def test_an_answer_streams_over_refreshes_and_finishes_with_the_committed_text_once(
        settings: Settings) -> None:
    gate = asyncio.Event()
    answer = "Streams are refreshed: " + " ".join(f"word{n}" for n in range(40)) + "."
    model = answering(answer, gate=gate)
    async with serving(settings, model, bot_spec()) as served:
        opened = await served.reply(bot_text(ANA, "tell me about streams", "msg-2001"))
        stream_id = opened["stream"]["id"]
        waiting = await served.refresh(ANA, stream_id)  # the model has not answered yet
        gate.set()
        states = await served.refresh_until(ANA, stream_id, finished)
        after = await served.refresh(ANA, stream_id)  # the platform asks no more; if it did, nothing more
        answers = await committed(served.runtime)
    assert opened == {"msgtype": "stream", "stream": {"id": stream_id_of("msg-2001"), "finish": False, "content": ""}}
    assert waiting["stream"] == {"id": stream_id, "finish": False, "content": ""}
    assert answers == [answer]
    assert states[-1]["content"] == answer
    assert [s["finish"] for s in states].count(True) == 1
    assert all(answer.startswith(s["content"]) for s in states)  # the text so far, never more than the answer
    assert after == {}


async def test_a_replayed_msgid_runs_one_turn(settings: Settings) -> None:
    gate = asyncio.Event()
    model = answering(lambda question: f"Once: {question}", gate=gate)
    async with serving(settings, model, bot_spec()) as served:
        message = bot_text(ANA, "only once", "msg-3001")
        first = await served.reply(message)
        async with asyncio.timeout(20):
            while not model.requests:  # kept, and its turn asks the model
                await asyncio.sleep(0.02)
        retries = [await served.reply(message) for _ in range(2)]
        gate.set()
        states = await served.refresh_until(ANA, first["stream"]["id"], finished)
        late = await served.reply(message)
        held = await kept(served.runtime, ANA)
    assert [r["stream"]["id"] for r in retries] == [first["stream"]["id"]] * 2  # the same stream
    assert [r["stream"]["finish"] for r in retries] == [False, False]
    assert states[-1]["content"] == "Once: only once"
    assert late == {}  # shown in full already
    assert len(model.requests) == 1 and held == 1


async def test_only_the_turns_person_can_approve(settings: Settings) -> None:
    ran: list[str] = []
    model = asking_model()
    async with serving(settings, model, bot_spec(), tools=ToolRegistry([writing_tool(ran)])) as served:
        opened = await served.reply(bot_text(ANA, "write my note", "msg-4001"))
        stream_id = opened["stream"]["id"]
        states = await served.refresh_until(ANA, stream_id, lambda s: "Reply /approve" in s["content"])
        asking = states[-1]
        found = re.search(r"Reply /approve (\S+) or /deny \1$", asking["content"])
        assert found and "write the file notes.txt" in asking["content"] and not asking["finish"], asking
        short = found[1]
        refused = await served.reply(bot_text(BEN, f"/approve {short}", "msg-4002"))
        assert refused["stream"]["content"] == "This request is not yours to answer." and ran == []
        allowed = await served.reply(bot_text(ANA, f"/approve {short}", "msg-4003"))
        states = await served.refresh_until(ANA, stream_id, finished)
        retried = await served.reply(bot_text(ANA, f"/approve {short}", "msg-4003"))
        held = await kept(served.runtime, ANA), await kept(served.runtime, BEN)
    assert refused["stream"]["finish"] is True
    assert allowed["stream"] == {"id": stream_id_of("msg-4003"), "finish": True, "content": "Allowed once."}
    assert retried == allowed  # a retried command gets the same answer, and resolves nothing again
    assert states[-1]["content"] == "Result: wrote notes.txt"
    assert ran == ["notes.txt"]
    assert held == (1, 0) and len(model.requests) == 2  # the commands are no turns


async def test_a_stranger_is_refused_once_and_nothing_is_kept(settings: Settings) -> None:
    model = answering("hi")
    async with serving(settings, model, bot_spec()) as served:
        first = await served.reply(bot_text(STRANGER, "let me in", "msg-5001"))
        second = await served.reply(bot_text(STRANGER, "please", "msg-5002", chat_id="wrkSFfCgAA-group"))
        held = await kept(served.runtime, STRANGER)
        history = await served.runtime.sessions.history(f"wecom_bot:{STRANGER}")
    assert first["stream"]["finish"] is True
    assert STRANGER in first["stream"]["content"] and "allowed" in first["stream"]["content"]
    assert second == {} and held == 0 and history == []
    assert model.requests == []


async def test_a_group_message_is_the_groups_turn_without_the_bots_name(settings: Settings) -> None:
    model = answering(lambda question: f"Re: {question}")
    async with serving(settings, model, bot_spec()) as served:
        opened = await served.reply(bot_text(BEN, "@Ember what time is it?", "msg-6001", chat_id="wrkSFfCgAA-group"))
        states = await served.refresh_until(BEN, opened["stream"]["id"], finished)
        history = await served.runtime.sessions.history("wecom_bot:wrkSFfCgAA-group")
    assert states[-1]["content"] == "Re: what time is it?"
    assert [m.content for m in history][-2:] == ["what time is it?", "Re: what time is it?"]


async def test_an_answer_later_than_the_stream_goes_once_through_the_response_url(
        settings: Settings, weixin: tuple[FakeWeixin, str]) -> None:
    fake, base_url = weixin
    gate = asyncio.Event()
    model = answering("Sorry for the wait: 42.", gate=gate)
    response_url = f"{base_url}/cgi-bin/aibot/response?response_code=RC-7001"
    async with serving(settings, model, bot_spec(stream_window_s=0.2)) as served:
        opened = await served.reply(bot_text(ANA, "the answer?", "msg-7001", response_url=response_url))
        states = await served.refresh_until(ANA, opened["stream"]["id"], finished)  # past the window
        gate.set()
        async with asyncio.timeout(20):
            while not fake.responses:
                await asyncio.sleep(0.02)
        await settled_in(served.runtime, served.channel.name).settled(ANA)  # a second send shows by then
    assert states[-1]["content"].endswith(LATER.strip())
    assert fake.responses == [{"response_code": "RC-7001", "msgtype": "markdown",
                               "markdown": {"content": "Sorry for the wait: 42."}}]
