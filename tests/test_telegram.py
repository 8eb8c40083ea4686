"""The Telegram channel against a Bot API server of the tests' own (tests/telegramserver.py):
a streamed answer ends as one message showing the committed text, under 429s too; long
answers are split; a replayed update runs once; strangers get one refusal and leave
nothing; groups answer when mentioned; approvals are buttons only their person can press."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.channels.gateway.http import ApiError
from ember.channels.telegram.channel import TelegramChannel
from ember.channels.telegram.config import TelegramSpec
from ember.channels.telegram.markup import telegram_html
from ember.config.settings import Settings
from ember.core.messages import Message, Role
from ember.models.base import ModelClient, ModelReply
from ember.models.scripted import FunctionModel
from ember.models.transcription import Transcriber
from ember.store.tx import Statement
from ember.tools.base import ToolRegistry
from tests.chatplatform import asking_model, settled_in, settling, writing_tool
from tests.gatewayproc import EMBER_SOURCE
from tests.loopback import LoopbackServer, wait_until
from tests.telegramserver import BOT_USERNAME, TOKEN, FakeTelegram, Shown, render, serving_telegram

ANA, BEN, STRANGER = 1001, 1002, 6666
GROUP = -100500


@pytest.fixture
def telegram() -> Any:
    with serving_telegram() as served:
        yield served


def spec(base_url: str, **fields: Any) -> TelegramSpec:
    return TelegramSpec(token=TOKEN, api_base_url=base_url, allowed_users=[ANA, BEN], poll_timeout_s=1,
                        edit_interval_ms=250, **fields)


def telegram_channel(runtime: Runtime, base_url: str, *, public_url: str | None = None,
                     transcriber: Transcriber | None = None, **fields: Any) -> TelegramChannel:
    return TelegramChannel(spec(base_url, **fields), chat_services(runtime, transcriber=transcriber),
                           public_url=public_url)


@asynccontextmanager
async def agent(settings: Settings, model: ModelClient, base_url: str, *, tools: ToolRegistry | None = None,
                transcriber: Transcriber | None = None, builtin_tools: bool = False,
                **fields: Any) -> AsyncIterator[tuple[Runtime, TelegramChannel]]:
    runtime = await build_runtime(settings, model, tools=None if builtin_tools else tools or ToolRegistry())
    channel = telegram_channel(runtime, base_url, transcriber=transcriber, **fields)
    settling(runtime, channel)
    async with running(runtime, recover=True):
        yield runtime, channel


def answering(text: str | Callable[[str], str], *, delay_s: float = 0.01) -> FunctionModel:
    """Streams `text` (or `text(question)`) in small pieces, slowly enough for several edits."""
    def reply(messages: list[Message], tools: Any) -> ModelReply:
        question = [m for m in messages if m.role is Role.USER][-1].content
        return ModelReply(text=text(question) if callable(text) else text)
    return FunctionModel(reply, chunk_size=8, delta_delay_s=delay_s)


async def committed(runtime: Runtime, chat_id: int) -> str:
    history = await runtime.sessions.history(f"telegram:{chat_id}")
    return [m.content for m in history if m.role is Role.ASSISTANT][-1]


def as_shown(markdown: str) -> str:
    """What a person reads of an answer in Telegram: its Markdown rendered."""
    return render(telegram_html(markdown), "HTML")


async def settled(fake: FakeTelegram, runtime: Runtime, chat_id: int, *, answers: int = 1,
                  timeout_s: float = 30) -> list[str]:
    """The chat's visible texts once the session has `answers` answers and the chat shows the last."""
    async with asyncio.timeout(timeout_s):
        while True:
            history = await runtime.sessions.history(f"telegram:{chat_id}")
            done = [m.content for m in history if m.role is Role.ASSISTANT]
            if len(done) >= answers and as_shown(done[-1]) in "\n\n".join(fake.texts(chat_id)):
                await settled_in(runtime, "telegram").settled(str(chat_id))  # anything sent twice shows by then
                return fake.texts(chat_id)
            await asyncio.sleep(0.05)


async def all_confirmed(fake: FakeTelegram, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while fake.unconfirmed():
            await asyncio.sleep(0.02)


ANSWER = "Here is the plan.\n\n" + " ".join(f"Step {n} is **done**." for n in range(1, 40))


async def test_a_streamed_answer_ends_as_one_message_with_the_committed_text(
        settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    async with agent(settings, answering(ANSWER), base_url) as (runtime, _):
        fake.message(ANA, ANA, "what is the plan?")
        texts = await settled(fake, runtime, ANA)
        answer = await committed(runtime, ANA)
    assert texts == [as_shown(answer)] and "**" not in texts[0]  # one message; bold rendered, not as stars
    [shown] = fake.visible(ANA)
    assert shown.edits >= 2  # it streamed: the draft was edited as text came
    assert (ANA, "typing") in fake.actions
    writes = [w.at for w in fake.writes_in(ANA) if w.ok]
    assert all(b - a >= 0.2 for a, b in itertools.pairwise(writes))  # never above edit_interval_ms


async def test_429s_on_edits_are_waited_out_and_the_final_is_never_dropped(
        settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    fake.rate_limits["editMessageText"] = [1, 1, 1]
    async with agent(settings, answering(ANSWER), base_url) as (runtime, _):
        fake.message(ANA, ANA, "the plan, please")
        texts = await settled(fake, runtime, ANA)
        answer = await committed(runtime, ANA)
    assert texts == [as_shown(answer)]
    refused = [w for w in fake.writes_in(ANA) if not w.ok]
    assert len(refused) == 3
    for limited in refused:  # after each 429 the chat was left alone for retry_after
        later = [w.at for w in fake.writes_in(ANA) if w.at > limited.at]
        assert not later or later[0] - limited.at >= 0.9


async def test_a_long_answer_is_split_at_paragraphs_into_one_answer(
        settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    paragraphs = [f"Paragraph {n}. " + " ".join(["All work and no play."] * 20) for n in range(25)]
    long_answer = "\n\n".join(paragraphs)
    assert len(long_answer) > 10_000
    async with agent(settings, answering(long_answer, delay_s=0), base_url) as (runtime, _):
        fake.message(ANA, ANA, "write a lot")
        texts = await settled(fake, runtime, ANA)
    assert len(texts) == 3 and all(len(text) <= 4096 for text in texts)
    assert "\n\n".join(texts) == long_answer  # cut at paragraph breaks, nothing lost or repeated
    assert all(text.startswith("Paragraph") for text in texts)


async def test_a_replayed_update_is_answered_once(settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    model = answering(lambda question: f"You said: {question}")
    async with agent(settings, model, base_url) as (runtime, _):
        update = fake.message(ANA, ANA, "hello once")
        await settled(fake, runtime, ANA)
        fake.replay(update)
        fake.replay(update)
        await all_confirmed(fake)  # the poller handled the replays, or never got them
        await settled_in(runtime, "telegram").settled(str(ANA))
        texts = fake.texts(ANA)
    assert texts == ["You said: hello once"]
    assert len([r for r in model.requests if r[-1].content == "hello once"]) == 1


async def test_a_stranger_gets_one_refusal_and_nothing_is_kept(
        settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    model = answering("hi")
    async with agent(settings, model, base_url) as (runtime, _):
        fake.message(STRANGER, STRANGER, "let me in")
        fake.message(STRANGER, STRANGER, "please")
        fake.message(ANA, ANA, "hello")
        await settled(fake, runtime, ANA)
        stranger_history = await runtime.sessions.history(f"telegram:{STRANGER}")
        kept = await runtime.db.run_read(lambda tx: tx.execute(Statement(
            "SELECT COUNT(*) FROM accepted_inbound WHERE sender_id = :sender"),
            {"sender": str(STRANGER)}).fetchone()[0])
    [refusal] = fake.texts(STRANGER)
    assert str(STRANGER) in refusal and "allowed" in refusal
    assert stranger_history == [] and kept == 0 and len(model.requests) == 1


async def test_in_a_group_it_answers_when_mentioned_or_replied_to(
        settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    model = answering(lambda question: f"Re: {question}")
    async with agent(settings, model, base_url) as (runtime, _):
        fake.message(GROUP, ANA, "just chatting among us", chat_type="supergroup")
        fake.message(GROUP, ANA, f"@{BOT_USERNAME} what time is it?", chat_type="supergroup")
        first = await settled(fake, runtime, GROUP)
        mine = fake.visible(GROUP)[0]
        fake.message(GROUP, BEN, "and tomorrow?", chat_type="supergroup", reply_to_bot=mine.message_id,
                     first_name="Ben")
        both = await settled(fake, runtime, GROUP, answers=2)
    assert first == ["Re: what time is it?"]
    assert both == ["Re: what time is it?", "Re: and tomorrow?"]
    assert len(model.requests) == 2


async def approval_card(fake: FakeTelegram, chat_id: int) -> Shown:
    async with asyncio.timeout(20):
        while True:
            cards = [m for m in fake.visible(chat_id) if m.buttons]
            if cards:
                return cards[-1]
            await asyncio.sleep(0.05)


def button(card: Shown, label: str) -> str:
    return next(b["callback_data"] for row in card.buttons or [] for b in row if b["text"] == label)


async def test_only_the_turns_person_can_press_its_approval_buttons(
        settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    ran: list[str] = []
    async with agent(settings, asking_model(), base_url, tools=ToolRegistry([writing_tool(ran)])) as (runtime, _):
        fake.message(GROUP, ANA, f"@{BOT_USERNAME} write my note", chat_type="group")
        card = await approval_card(fake, GROUP)
        assert "write the file notes.txt" in card.text
        fake.tap(BEN, card, button(card, "Allow once"), first_name="Ben")
        async with asyncio.timeout(10):
            while not fake.callback_answers:
                await asyncio.sleep(0.05)
        assert fake.callback_answers[0]["text"] == "This request is not yours to answer."
        assert ran == []  # Ben's tap changed nothing
        fake.tap(ANA, card, button(card, "Allow once"))
        texts = await settled(fake, runtime, GROUP)
    assert ran == ["notes.txt"]
    assert "Allowed once by Ana." in texts[0]
    assert texts[-1] == "Result: wrote notes.txt"


async def test_an_expired_request_says_so_on_its_card(settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    ran: list[str] = []
    config = settings.model_copy(update={"tool_policy": settings.tool_policy.model_copy(update={"timeout_s": 0.5})})
    async with agent(config, asking_model(), base_url, tools=ToolRegistry([writing_tool(ran)])) as (runtime, _):
        fake.message(ANA, ANA, "write my note")
        card = await approval_card(fake, ANA)
        await settled(fake, runtime, ANA)  # denied by the timeout, and answered
        fake.tap(ANA, card, button(card, "Allow once"))
        async with asyncio.timeout(10):
            while "expired" not in fake.shown[card.message_id].text:
                await asyncio.sleep(0.05)
    assert ran == []
    assert fake.callback_answers[-1]["text"] == "Expired"


def test_kill_9_between_the_draft_and_the_final_still_shows_one_message(
        tmp_path: Path, telegram: tuple[FakeTelegram, str]) -> None:
    """`ember` is killed while its draft streams; the restarted process resumes the turn
    and edits that same message into the committed answer: no second message."""
    fake, base_url = telegram
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    child = subprocess.Popen([sys.executable, "-m", "tests.telegram_child", str(home), base_url],
                             cwd=EMBER_SOURCE, env={**env, "PYTHONPATH": EMBER_SOURCE}, stderr=subprocess.PIPE,
                             text=True)
    try:
        fake.message(ANA, ANA, "a hard question")
        wait_until(lambda: any(m.edits >= 2 for m in fake.visible(ANA)) or child.poll() is not None,
                   timeout_s=60, what="the draft to stream")
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    [draft] = fake.visible(ANA)
    assert draft.text.startswith("Let me think")

    async def restarted() -> tuple[list[str], str]:
        model = answering("The answer, after the restart.")
        async with agent(Settings(home=home), model, base_url) as (runtime, _):
            return await settled(fake, runtime, ANA), await committed(runtime, ANA)

    texts, answer = asyncio.run(restarted())
    assert texts == [answer] == ["The answer, after the restart."]
    assert fake.visible(ANA)[0].message_id == draft.message_id


async def test_webhook_mode_checks_the_secret_and_answers(settings: Settings,
                                                          telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    runtime = await build_runtime(settings, answering(lambda q: f"Webhook answer to {q}"), tools=ToolRegistry())
    channel = telegram_channel(runtime, base_url, public_url="https://ember.example", mode="webhook",
                               webhook_secret="s3cret-token")
    settling(runtime, channel)
    app = Starlette(routes=channel.routes(), exception_handlers={ApiError: lambda request, exc: exc.response()})
    server = LoopbackServer(app, "telegram-webhook")
    async with running(runtime):
        server.start()
        try:
            assert fake.webhook["url"] == "https://ember.example/channels/telegram"
            update = {"update_id": 77, "message": {
                "message_id": 9, "date": 0, "text": "via webhook", "chat": {"id": ANA, "type": "private"},
                "from": {"id": ANA, "is_bot": False, "first_name": "Ana"}}}
            async with httpx.AsyncClient(base_url=server.origin) as http:
                wrong = await http.post("/channels/telegram", json=update,
                                        headers={"X-Telegram-Bot-Api-Secret-Token": "nope"})
                right = await http.post("/channels/telegram", json=update,
                                        headers={"X-Telegram-Bot-Api-Secret-Token": "s3cret-token"})
                again = await http.post("/channels/telegram", json=update,
                                        headers={"X-Telegram-Bot-Api-Secret-Token": "s3cret-token"})
            assert (wrong.status_code, right.status_code, again.status_code) == (401, 200, 200)
            texts = await settled(fake, runtime, ANA)
        finally:
            server.stop()
    assert texts == ["Webhook answer to via webhook"]


def test_channels_lists_the_bot_and_doctor_checks_its_token_without_sending(
        tmp_path: Path, telegram: tuple[FakeTelegram, str]) -> None:
    fake, base_url = telegram
    home = tmp_path / "home"
    home.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}, "EMBER_HOME": str(home)}
    ember = str(Path(sys.executable).with_name("ember"))
    (home / "ember.toml").write_text(f'[telegram]\napi_base_url = "{base_url}"\nallowed_users = [{ANA}]\n')

    def run(*args: str, token: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ember, *args], env={**env, "EMBER_TELEGRAM_TOKEN": token}, capture_output=True,
                              text=True, timeout=120)

    listed = json.loads(run("channels", "--json", token=TOKEN).stdout)
    [bot] = [row for row in listed if row["channel"] == "telegram"]
    assert bot["name"] == "polling" and "token set, 1 allowed users" in bot["state"]
    good = run("doctor", token=TOKEN)
    assert f"telegram: the token is @{BOT_USERNAME}'s; polling; 1 allowed user" in good.stdout
    bad = run("doctor", token="999:wrong")
    assert bad.returncode == 1 and "FAIL  telegram: Telegram refused the bot token" in bad.stdout
    assert TOKEN not in good.stdout + good.stderr and "999:wrong" not in bad.stdout + bad.stderr
    assert fake.shown == {} and fake.actions == []  # nothing was sent


async def test_a_card_from_before_a_restart_answers_the_resumed_turn(
        settings: Settings, telegram: tuple[FakeTelegram, str]) -> None:
    """The request outlives the restart: the resumed turn takes it up again, so the card shown
    before it still answers, and the tool runs once."""
    fake, base_url = telegram
    ran: list[str] = []
    tools = ToolRegistry([writing_tool(ran)])
    async with agent(settings, asking_model(), base_url, tools=tools):
        fake.message(ANA, ANA, "write my note")
        old = await approval_card(fake, ANA)
    async with agent(settings, asking_model(), base_url, tools=tools) as (runtime, _):
        fake.tap(ANA, old, button(old, "Allow once"))
        texts = await settled(fake, runtime, ANA)
    assert ran == ["notes.txt"]
    assert texts[-1] == "Result: wrote notes.txt"
