"""The Feishu channel against the tests' own Feishu, over real HTTP on 127.0.0.1: encrypted, signed
events in; the answer a card updated in place as it streams; an event sent again answered once;
forged, unencrypted and wrong-token events refused; the URL check answered; 429s waited out with
one card; approval cards only the asker can press; a stranger told once; the same on the long
connection, acknowledged frame by frame and opened again when dropped."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.channels.feishu.channel import FeishuChannel, probe
from ember.channels.feishu.config import FeishuSpec
from ember.config.settings import Settings
from ember.core.messages import Role
from ember.models.base import ModelClient
from ember.pipeline.voice import TURNED_ON
from ember.tools.base import ToolRegistry
from tests.chatplatform import answered, asking_model, called_back, settling, writing_tool
from tests.feishuserver import (
    APP_ID,
    APP_SECRET,
    ENCRYPT_KEY,
    VERIFICATION_TOKEN,
    FakeFeishu,
    encrypted,
    serving_feishu,
    signed,
)
from tests.gatewayproc import EMBER_SOURCE
from tests.loopback import wait_until
from tests.modelserver import SPOKEN_PREFIX, serving
from tests.test_telegram import ANSWER, answering
from tests.test_telegram_files import speaking

ANA, BEN, STRANGER = "ou_ana", "ou_ben", "ou_stranger"
DM, TEAM = "oc_dm_ana", "oc_team"


@pytest.fixture
def feishu() -> Iterator[FakeFeishu]:
    with serving_feishu() as fake:
        yield fake


def spec(fake: FakeFeishu, **fields: Any) -> FeishuSpec:
    return FeishuSpec(**{"app_id": APP_ID, "app_secret": APP_SECRET, "verification_token": VERIFICATION_TOKEN,
                         "encrypt_key": ENCRYPT_KEY, "api_base_url": fake.origin, "allowed_users": [ANA, BEN],
                         "edit_interval_ms": 200, **fields})


@asynccontextmanager
async def agent(settings: Settings, model: ModelClient, fake: FakeFeishu, *,
                tools: ToolRegistry | None = None) -> AsyncIterator[tuple[Runtime, httpx.AsyncClient]]:
    runtime = await build_runtime(settings, model, tools=tools or ToolRegistry())
    async with called_back(runtime, FeishuChannel(spec(fake), chat_services(runtime))) as http:
        yield runtime, http


async def post(http: httpx.AsyncClient, event: dict[str, Any]) -> httpx.Response:
    body = encrypted(event)
    return await http.post("/channels/feishu/events", content=body, headers=signed(body))


async def settled(fake: FakeFeishu, runtime: Runtime, chat_id: str, *, answers: int = 1) -> list[str]:
    await answered(runtime, "feishu", chat_id, answers=answers)
    return fake.texts(chat_id)


async def test_a_streamed_answer_is_one_card_updated_in_place_and_an_event_sent_again_runs_once(
        settings: Settings, feishu: FakeFeishu) -> None:
    async with agent(settings, answering(ANSWER), feishu) as (runtime, http):
        event = feishu.message("make a plan", sender=ANA, chat_id=DM)
        assert (await post(http, event)).status_code == 200
        assert (await post(http, event)).status_code == 200  # Feishu posts again when it heard no 200 in time
        texts = await settled(feishu, runtime, DM)
        history = await runtime.sessions.history(f"feishu:{DM}")
    [card] = feishu.visible(DM)  # its markdown as Feishu renders it
    assert texts == [ANSWER] and card.updates >= 1 and card.reply_to == event["event"]["message"]["message_id"]
    assert [m.role for m in history] == [Role.USER, Role.ASSISTANT]


async def test_the_url_check_is_answered_and_forged_or_plain_events_are_refused(
        settings: Settings, feishu: FakeFeishu) -> None:
    async with agent(settings, answering("never"), feishu) as (runtime, http):
        check = encrypted({"challenge": "c-123", "token": VERIFICATION_TOKEN, "type": "url_verification"})
        answered = await http.post("/channels/feishu/events", content=check)
        body = encrypted(feishu.message("hi", sender=ANA, chat_id=DM))
        forged = await http.post("/channels/feishu/events", content=body, headers=signed(body, key="not-it"))
        plain_body = json.dumps(feishu.message("hi", sender=ANA, chat_id=DM)).encode()
        plain = await http.post("/channels/feishu/events", content=plain_body, headers=signed(plain_body))
        wrong = feishu.message("hi", sender=ANA, chat_id=DM)
        wrong["header"]["token"] = "another-apps-token"
        wrong_token = await post(http, wrong)
        await asyncio.sleep(0.3)
        history = await runtime.sessions.history(f"feishu:{DM}")
    assert answered.status_code == 200 and answered.json() == {"challenge": "c-123"}
    assert [r.status_code for r in (forged, plain, wrong_token)] == [401, 400, 401]
    assert forged.json()["error"]["code"] == "invalid_signature" and history == [] and feishu.cards == {}


async def test_429s_are_waited_out_and_the_answer_shows_once(settings: Settings, feishu: FakeFeishu) -> None:
    feishu.rate_limits["send"], feishu.rate_limits["update"] = 2, 3
    async with agent(settings, answering(ANSWER), feishu) as (runtime, http):
        await post(http, feishu.message("make a plan", sender=ANA, chat_id=DM))
        texts = await settled(feishu, runtime, DM)
    assert texts == [ANSWER] and feishu.limited >= 2


async def test_in_a_group_only_the_asker_can_press_the_approval_card(settings: Settings, feishu: FakeFeishu) -> None:
    ran: list[str] = []
    async with agent(settings, asking_model(), feishu, tools=ToolRegistry([writing_tool(ran)])) as (runtime, http):
        await post(http, feishu.message("not for the bot", sender=ANA, chat_id=TEAM, group=True))
        await post(http, feishu.message("write my note", sender=ANA, chat_id=TEAM, group=True, mention_bot=True))
        async with asyncio.timeout(20):
            while not (asking := [c for c in feishu.visible(TEAM) if c.buttons]):
                await asyncio.sleep(0.05)
        [card] = asking
        pressed = await post(http, feishu.press(card, "once", by=BEN))
        assert pressed.json()["toast"]["content"] == "This request is not yours to answer." and ran == []
        pressed = await post(http, feishu.press(card, "once", by=ANA))
        texts = await settled(feishu, runtime, TEAM)
        history = await runtime.sessions.history(f"feishu:{TEAM}")
    assert pressed.json()["toast"]["content"] == "Allowed once." and ran == ["notes.txt"]
    assert card.buttons == [] and card.text.endswith("**Allowed once.**")
    assert texts[-1] == "Result: wrote notes.txt"
    assert [m.content for m in history if m.role is Role.USER] == ["write my note"]


async def test_a_stranger_is_told_once_and_nothing_is_kept(settings: Settings, feishu: FakeFeishu) -> None:
    async with agent(settings, answering("never"), feishu) as (runtime, http):
        for text in ("hello?", "anyone?"):
            await post(http, feishu.message(text, sender=STRANGER, chat_id="oc_stranger"))
        await asyncio.sleep(0.3)
        history = await runtime.sessions.history("feishu:oc_stranger")
    [told] = feishu.texts("oc_stranger")
    assert "Feishu open_id: ou_stranger" in told and history == []


def test_kill_9_between_the_draft_and_the_final_still_shows_one_card(tmp_path: Path, feishu: FakeFeishu) -> None:
    """Killed while its card streams; the restarted process resumes the turn and updates that same
    card into the committed answer: no second card."""
    home, origin = tmp_path / "home", tmp_path / "origin"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    child = subprocess.Popen([sys.executable, "-m", "tests.chat_child", "feishu", str(home), feishu.origin,
                              str(origin)], cwd=EMBER_SOURCE, env={**env, "PYTHONPATH": EMBER_SOURCE},
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (origin.exists() and origin.read_text() != "") or child.poll() is not None, timeout_s=60,
                   what="the child to serve")
        body = encrypted(feishu.message("a hard question", sender=ANA, chat_id=DM))
        assert httpx.post(origin.read_text() + "/channels/feishu/events", content=body, headers=signed(body),
                          timeout=10).status_code == 200
        wait_until(lambda: any(c.updates >= 2 for c in feishu.cards.values()) or child.poll() is not None,
                   timeout_s=60, what="the card to stream")
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    [draft] = feishu.cards.values()
    assert draft.text.startswith("Let me think")

    async def restarted() -> list[str]:
        async with agent(Settings(home=home), answering("The answer, after the restart."), feishu) as (runtime, _):
            return await settled(feishu, runtime, DM)

    assert asyncio.run(restarted()) == ["The answer, after the restart."]
    assert [c.message_id for c in feishu.cards.values() if not c.recalled] == [draft.message_id]


async def test_doctor_gets_a_token_without_sending(feishu: FakeFeishu) -> None:
    assert await probe(spec(feishu)) == f"app {APP_ID} got a tenant access token"
    with pytest.raises(Exception, match="check \\[feishu\\] app_id and app_secret"):
        await probe(spec(feishu, app_secret="wrong"))
    assert feishu.cards == {}


async def test_a_spoken_reply_follows_the_card_as_a_voice_message(settings: Settings, feishu: FakeFeishu) -> None:
    with serving() as model:
        async with agent(speaking(settings, model), answering("Sunny all day."), feishu) as (runtime, http):
            await post(http, feishu.message("/voice on", sender=ANA, chat_id=DM))
            await settled(feishu, runtime, DM)
            await post(http, feishu.message("weather?", sender=ANA, chat_id=DM))
            await settled(feishu, runtime, DM, answers=2)
    voices = [card for card in feishu.visible(DM) if card.kind == "audio"]
    assert [card.file for card in voices] == [("reply.ogg", SPOKEN_PREFIX + text.encode())
                                              for text in (TURNED_ON, "Sunny all day.")]
    assert feishu.file_types == ["opus", "opus"] and feishu.texts(DM)[-2] == "Sunny all day."


async def test_the_long_connection_acknowledges_each_event_once_kept_and_opens_again_when_dropped(
        settings: Settings, feishu: FakeFeishu) -> None:
    ran: list[str] = []
    runtime = await build_runtime(settings, asking_model(), tools=ToolRegistry([writing_tool(ran)]))
    channel = FeishuChannel(spec(feishu, mode="websocket", verification_token=None, encrypt_key=None),
                            chat_services(runtime))
    assert channel.routes() == []  # nothing for Feishu to post to
    settling(runtime, channel)
    async with running(runtime, recover=True):
        ask = feishu.message("write my note", sender=ANA, chat_id=DM)
        frames = [feishu.push(ask, parts=3), feishu.push(ask)]  # split in three, then sent again: one turn
        async with asyncio.timeout(20):
            while not (asking := [c for c in feishu.visible(DM) if c.buttons]) or feishu.pings < 1:
                await asyncio.sleep(0.05)
        feishu.dropping = True
        async with asyncio.timeout(20):
            while feishu.connections < 2:
                await asyncio.sleep(0.05)
        [card] = asking
        frames += [feishu.push(feishu.press(card, "once", by=BEN)), feishu.push(feishu.press(card, "once", by=ANA))]
        texts = await settled(feishu, runtime, DM)
        async with asyncio.timeout(10):  # the fake reads acknowledgements on its own loop
            while not all(f in feishu.acks for f in frames):
                await asyncio.sleep(0.05)
        history = await runtime.sessions.history(f"feishu:{DM}")
    toasts = [json.loads(base64.b64decode(feishu.acks[f]["data"]))["toast"]["content"] for f in frames[2:]]
    assert all(feishu.acks[f]["code"] == 200 for f in frames) and ran == ["notes.txt"]
    assert toasts == ["This request is not yours to answer.", "Allowed once."]
    assert texts[-1] == "Result: wrote notes.txt"
    assert [m.content for m in history if m.role is Role.USER] == ["write my note"]


async def test_doctor_asks_for_a_long_connection_without_opening_one(feishu: FakeFeishu) -> None:
    websocket = spec(feishu, mode="websocket", verification_token=None)
    assert await probe(websocket) == f"app {APP_ID} got a tenant access token and a long-connection address"
    assert feishu.connections == 0
    with pytest.raises(ValueError, match='mode = "http" needs verification_token'):
        spec(feishu, verification_token=None)
