"""The Discord channel on discord.py against the tests' own Discord on 127.0.0.1: the Gateway
(zlib-stream; identify, heartbeats, resume) brings messages in; the answer replies and streams by
edits into one message; a message replayed on resume runs once; 429s waited out; approval buttons
only the asker can press; a stranger told once; mentions needed in a server's channels."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.channels.discord.channel import DiscordChannel, probe
from ember.channels.discord.config import DiscordSpec
from ember.config.settings import Settings
from ember.core.messages import Role
from ember.models.base import ModelClient
from ember.pipeline.voice import TURNED_ON
from ember.tools.base import ToolRegistry
from tests.chatplatform import answered, asking_model, settling, writing_tool
from tests.discordserver import TOKEN, FakeDiscord, serving_discord
from tests.gatewayproc import EMBER_SOURCE
from tests.loopback import wait_until
from tests.modelserver import SPOKEN_PREFIX, serving
from tests.test_telegram import answering
from tests.test_telegram_files import speaking

ANA, BEN, STRANGER = "100000000000000011", "100000000000000012", "100000000000000066"
DM, GENERAL, GUILD = "200000000000000001", "200000000000000002", "300000000000000001"
ANSWER = "Here is the plan. " + " ".join(f"Step {n} is done." for n in range(1, 30))


@pytest.fixture
def fake() -> Iterator[FakeDiscord]:
    with serving_discord() as served:
        yield served


def spec(fake: FakeDiscord, **fields: Any) -> DiscordSpec:
    return DiscordSpec(**{"token": TOKEN, "api_base_url": f"{fake.origin}/api/v10",
                          "gateway_url": f"{fake.origin.replace('http', 'ws')}/gateway",
                          "allowed_users": [ANA, BEN], "edit_interval_ms": 200, **fields})


@asynccontextmanager
async def agent(settings: Settings, model: ModelClient, fake: FakeDiscord, *,
                tools: ToolRegistry | None = None) -> AsyncIterator[Runtime]:
    runtime = await build_runtime(settings, model, tools=tools or ToolRegistry())
    settling(runtime, DiscordChannel(spec(fake), chat_services(runtime)))
    async with running(runtime, recover=True):
        yield runtime


async def settled(fake: FakeDiscord, runtime: Runtime, chat_id: str, *, answers: int = 1) -> list[str]:
    await answered(runtime, "discord", chat_id, answers=answers)
    return fake.texts(chat_id)


async def test_a_dm_streams_its_answer_into_one_reply_and_a_replay_on_resume_runs_once(
        settings: Settings, fake: FakeDiscord) -> None:
    async with agent(settings, answering(ANSWER), fake) as runtime:
        asked = fake.message("make a plan", author=ANA, channel_id=DM)
        texts = await settled(fake, runtime, DM)
        fake.drop_connection()  # discord.py resumes; the fake replays what came since the last ack'd seq
        async with asyncio.timeout(20):
            while not fake.resumed:
                await asyncio.sleep(0.05)
        fake.dispatch("MESSAGE_CREATE", fake.dispatched("MESSAGE_CREATE")[0])  # the same message again
        await asyncio.sleep(0.5)
        history = await runtime.sessions.history(f"discord:{DM}")
    [shown] = fake.visible(DM)
    assert texts == [ANSWER] and shown.reply_to == asked and shown.edits >= 1
    assert [m.role for m in history] == [Role.USER, Role.ASSISTANT] and fake.identified == 1


async def test_in_a_server_only_mentions_are_answered_and_only_the_asker_can_press(
        settings: Settings, fake: FakeDiscord) -> None:
    ran: list[str] = []
    fake.rate_limits["POST"] = 1  # the first message waits out a 429
    async with agent(settings, asking_model(), fake, tools=ToolRegistry([writing_tool(ran)])) as runtime:
        fake.message("chatter, not for the bot", author=BEN, channel_id=GENERAL, guild_id=GUILD)
        fake.message("write my note", author=ANA, channel_id=GENERAL, guild_id=GUILD, mention=True)
        async with asyncio.timeout(20):
            while not (cards := [m for m in fake.visible(GENERAL) if m.components]):
                await asyncio.sleep(0.05)
        [card] = cards
        fake.press(card, "once", by=BEN)
        async with asyncio.timeout(10):
            while not fake.ephemeral:
                await asyncio.sleep(0.05)
        assert fake.ephemeral == ["This request is not yours to answer."] and ran == []
        fake.press(card, "once", by=ANA)
        texts = await settled(fake, runtime, GENERAL)
        history = await runtime.sessions.history(f"discord:{GENERAL}")
    assert ran == ["notes.txt"] and card.components == [] and card.content.endswith(f"Allowed once by <@{ANA}>.")
    assert texts[-1] == "Result: wrote notes.txt" and fake.limited == 1
    assert [m.content for m in history if m.role is Role.USER] == ["write my note"]


async def test_a_stranger_is_told_once_and_nothing_is_kept(settings: Settings, fake: FakeDiscord) -> None:
    async with agent(settings, answering("never"), fake) as runtime:
        for text in ("hello?", "anyone?"):
            fake.message(text, author=STRANGER, channel_id="200000000000000066")
        await asyncio.sleep(0.5)
        history = await runtime.sessions.history("discord:200000000000000066")
    [told] = fake.texts("200000000000000066")
    assert f"Discord user id: {STRANGER}" in told and history == []


def test_kill_9_between_the_draft_and_the_final_still_shows_one_message(tmp_path: Path, fake: FakeDiscord) -> None:
    """Killed while its reply streams; the restarted process identifies again, resumes the turn and
    edits that same message into the committed answer: no second message."""
    home, origin = tmp_path / "home", tmp_path / "origin"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    child = subprocess.Popen([sys.executable, "-m", "tests.chat_child", "discord", str(home), fake.origin,
                              str(origin)], cwd=EMBER_SOURCE, env={**env, "PYTHONPATH": EMBER_SOURCE},
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: fake.identified == 1 or child.poll() is not None, timeout_s=60, what="the child to connect")
        fake.message("a hard question", author=ANA, channel_id=DM)
        wait_until(lambda: any(m.edits >= 2 for m in fake.shown.values()) or child.poll() is not None,
                   timeout_s=60, what="the reply to stream")
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    [draft] = fake.shown.values()
    assert draft.content.startswith("Let me think")

    async def restarted() -> list[str]:
        async with agent(Settings(home=home), answering("The answer, after the restart."), fake) as runtime:
            return await settled(fake, runtime, DM)

    assert asyncio.run(restarted()) == ["The answer, after the restart."]
    assert [m.message_id for m in fake.visible(DM)] == [draft.message_id] and fake.identified == 2


async def test_doctor_reads_the_bot_without_a_gateway(fake: FakeDiscord) -> None:
    assert await probe(spec(fake)) == "ember (900000000000000001)"
    with pytest.raises(Exception, match="refused the bot token"):
        await probe(spec(fake, token="wrong"))
    assert fake.identified == 0 and fake.shown == {}


async def test_a_spoken_reply_follows_the_answer_as_an_attachment(settings: Settings, fake: FakeDiscord) -> None:
    with serving() as model:
        async with agent(speaking(settings, model), answering("Sunny all day."), fake) as runtime:
            fake.message("/voice on", author=ANA, channel_id=DM)
            await settled(fake, runtime, DM)
            fake.message("weather?", author=ANA, channel_id=DM)
            await settled(fake, runtime, DM, answers=2)
    sent = [m.file for m in fake.visible(DM) if m.file]
    assert sent == [("reply.ogg", SPOKEN_PREFIX + text.encode()) for text in (TURNED_ON, "Sunny all day.")]
