"""The Slack channel against the tests' own Web API and Events API, over real HTTP on 127.0.0.1:
signed events in, answers streamed by chat.update in the right thread, Slack's retries answered
once, forged or stale requests refused, 429s waited out with one visible answer, approvals as
Block Kit buttons only the asker can press, strangers told once."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.app.tools import workspaces
from ember.channels.slack.channel import SlackChannel
from ember.channels.slack.config import SlackSpec
from ember.channels.slack.files import slacks_own
from ember.config.settings import Settings
from ember.core.messages import Message, Role, ToolCall
from ember.models.base import ModelClient, ModelReply
from ember.models.openai_compat import OpenAICompatibleModel
from ember.models.scripted import FunctionModel
from ember.tools.base import ToolRegistry
from tests.chatplatform import asking_model, called_back, settled_in, settling, writing_tool
from tests.gatewayproc import EMBER_SOURCE
from tests.loopback import wait_until
from tests.modelserver import Reply, serving
from tests.slackserver import (
    APP_TOKEN,
    SIGNING_SECRET,
    TOKEN,
    FakeSlack,
    message_event,
    press,
    serving_slack,
    signed,
)
from tests.test_attachments import png
from tests.test_telegram import answering

ANA, BEN, STRANGER = "U0ANA", "U0BEN", "U0STRANGER"
DM, TEAM = "D0ANA", "C0TEAM"
ANSWER = "Here is the plan.\n\n" + " ".join(f"Step {n} is **done**." for n in range(1, 30))


@pytest.fixture
def slack() -> Iterator[tuple[FakeSlack, str]]:
    with serving_slack() as served:
        yield served


def spec(base_url: str, **fields: Any) -> SlackSpec:
    return SlackSpec(bot_token=TOKEN, signing_secret=SIGNING_SECRET, api_base_url=base_url,
                     allowed_users=[ANA, BEN], edit_interval_ms=250, **fields)


@asynccontextmanager
async def agent(settings: Settings, model: ModelClient, base_url: str, *, tools: ToolRegistry | None = None,
                builtin_tools: bool = False, **fields: Any) -> AsyncIterator[tuple[Runtime, httpx.AsyncClient]]:
    """A runtime with the Slack channel, its routes served on 127.0.0.1, and a client to post to them."""
    runtime = await build_runtime(settings, model, tools=None if builtin_tools else tools or ToolRegistry())
    async with called_back(runtime, SlackChannel(spec(base_url, **fields), chat_services(runtime))) as http:
        yield runtime, http


async def send(http: httpx.AsyncClient, envelope: dict[str, Any], **headers: str) -> httpx.Response:
    body = json.dumps(envelope).encode()
    return await http.post("/channels/slack/events", content=body, headers={**signed(body), **headers})


async def settled(fake: FakeSlack, runtime: Runtime, chat_id: str, *, answers: int = 1) -> list[str]:
    """The conversation's visible texts once the session has `answers` answers, all delivered."""
    channel, _, thread = chat_id.partition("/")
    async with asyncio.timeout(30):
        while len([m for m in await runtime.sessions.history(f"slack:{chat_id}") if m.role is Role.ASSISTANT]) \
                < answers:
            await asyncio.sleep(0.05)
        await settled_in(runtime, "slack").settled(chat_id)
    return fake.visible(channel, thread or None)


async def test_a_direct_message_streams_its_answer_into_one_message(
        settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    async with agent(settings, answering(ANSWER), base_url) as (runtime, http):
        response = await send(http, message_event("what is the plan?", user=ANA, channel=DM))
        assert response.status_code == 200
        texts = await settled(fake, runtime, DM)
    [shown] = [p for p in fake.posted.values() if p.channel == DM]
    assert texts == [shown.text] and shown.text.startswith("Here is the plan.") and "*done*" in shown.text
    assert "**" not in shown.text and shown.edits >= 2  # Slack's bold; it streamed by edits
    writes = [at for at, _, ok in fake.writes if ok]
    assert all(b - a >= 0.2 for a, b in itertools.pairwise(writes))  # never above edit_interval_ms


async def test_a_mention_in_a_channel_is_answered_in_its_thread_which_is_a_session(
        settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    async with agent(settings, answering(lambda q: f"On it: {q}"), base_url) as (runtime, http):
        mention = message_event("summarise the thread", user=ANA, channel=TEAM, direct=False, mention=True)
        plain = {**mention, "event_id": "EvPLAIN", "event": {**mention["event"], "type": "message"}}
        await send(http, plain)  # Slack sends a channel's mention as a message too: not answered twice
        await send(http, mention)
        thread = mention["event"]["ts"]
        texts = await settled(fake, runtime, f"{TEAM}/{thread}")
        chatter = message_event("no mention here", user=BEN, channel=TEAM, direct=False)
        await send(http, chatter)
        await settled_in(runtime, "slack").settled(f"{TEAM}/{chatter['event']['ts']}")
    assert texts == ["On it: summarise the thread"]
    assert fake.visible(TEAM) == []  # nothing at the channel's top level


async def test_a_retried_event_is_answered_once(settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    async with agent(settings, answering("Once."), base_url) as (runtime, http):
        event = message_event("hello", user=ANA, channel=DM)
        first = await send(http, event)
        retried = await send(http, event, **{"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"})
        assert first.status_code == retried.status_code == 200
        texts = await settled(fake, runtime, DM)
        history = await runtime.sessions.history(f"slack:{DM}")
    assert texts == ["Once."] and [m.role for m in history] == [Role.USER, Role.ASSISTANT]


async def test_forged_stale_and_unsigned_requests_are_refused_and_the_url_check_answered(
        settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    async with agent(settings, answering("never"), base_url) as (runtime, http):
        body = json.dumps(message_event("hi", user=ANA, channel=DM)).encode()
        forged = await http.post("/channels/slack/events", content=body, headers=signed(body, secret="not-it"))
        stale = await http.post("/channels/slack/events", content=body, headers=signed(body, at=time.time() - 400))
        bare = await http.post("/channels/slack/events", content=body, headers={"Content-Type": "application/json"})
        challenge = json.dumps({"type": "url_verification", "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmd"}).encode()
        verified = await http.post("/channels/slack/events", content=challenge, headers=signed(challenge))
        await asyncio.sleep(0.3)
        history = await runtime.sessions.history(f"slack:{DM}")
    assert [r.status_code for r in (forged, stale, bare)] == [401, 401, 401]
    assert forged.json()["error"]["code"] == "invalid_signature"
    assert verified.json() == {"challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmd"}
    assert history == [] and fake.posted == {}


async def test_a_429_storm_is_waited_out_and_one_answer_shows(settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    fake.rate_limits["chat.postMessage"] = [1, 1]
    fake.rate_limits["chat.update"] = [1, 1, 1]
    async with agent(settings, answering(ANSWER, delay_s=0.05), base_url) as (runtime, http):
        await send(http, message_event("plan please", user=ANA, channel=DM))
        texts = await settled(fake, runtime, DM)
    assert len(texts) == 1 and texts[0].startswith("Here is the plan.") and texts[0].endswith("Step 29 is *done*.")
    assert not fake.rate_limits["chat.postMessage"] and not fake.rate_limits["chat.update"]  # each 429 was met


async def test_only_the_asker_can_press_the_approval_buttons(settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    ran: list[str] = []
    async with agent(settings, asking_model(), base_url, tools=ToolRegistry([writing_tool(ran)])) as (runtime, http):
        mention = message_event("write my note", user=ANA, channel=TEAM, direct=False, mention=True)
        await send(http, mention)
        async with asyncio.timeout(20):
            while not fake.cards(TEAM):
                await asyncio.sleep(0.05)
        [card] = fake.cards(TEAM)
        assert "write the file notes.txt" in card.text and card.thread_ts == mention["event"]["ts"]
        body, headers = press(card, BEN, "once")
        assert (await http.post("/channels/slack/interactions", content=body, headers=headers)).status_code == 200
        assert fake.ephemeral[-1] == {"channel": TEAM, "user": BEN, "text": "This request is not yours to answer."}
        assert ran == []
        body, headers = press(card, ANA, "once")
        await http.post("/channels/slack/interactions", content=body, headers=headers)
        texts = await settled(fake, runtime, f"{TEAM}/{mention['event']['ts']}")
    assert ran == ["notes.txt"]
    assert "Allowed once by <@U0ANA>." in texts[0] and fake.posted[card.ts].blocks is None  # the buttons went
    assert texts[-1] == "Result: wrote notes.txt"


def test_kill_9_between_the_draft_and_the_final_still_shows_one_message(
        tmp_path: Path, slack: tuple[FakeSlack, str]) -> None:
    """The process is killed while its draft streams; the restarted one resumes the turn and edits
    that same message into the committed answer: no second message."""
    fake, base_url = slack
    home, origin = tmp_path / "home", tmp_path / "origin"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    child = subprocess.Popen([sys.executable, "-m", "tests.chat_child", "slack", str(home), base_url, str(origin)],
                             cwd=EMBER_SOURCE, env={**env, "PYTHONPATH": EMBER_SOURCE}, stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_until(lambda: (origin.exists() and origin.read_text() != "") or child.poll() is not None, timeout_s=60,
                   what="the child to serve")
        body = json.dumps(message_event("a hard question", user=ANA, channel=DM)).encode()
        assert httpx.post(origin.read_text() + "/channels/slack/events", content=body, headers=signed(body),
                          timeout=10).status_code == 200
        wait_until(lambda: any(p.edits >= 2 for p in fake.posted.values()) or child.poll() is not None,
                   timeout_s=60, what="the draft to stream")
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    [draft] = fake.posted.values()
    assert draft.text.startswith("Let me think")

    async def restarted() -> list[str]:
        async with agent(Settings(home=home), answering("The answer, after the restart."), base_url) as (runtime, _):
            return await settled(fake, runtime, DM)

    assert asyncio.run(restarted()) == ["The answer, after the restart."]
    assert [p.ts for p in fake.posted.values() if not p.deleted] == [draft.ts]


async def test_a_shared_image_reaches_a_seeing_model_and_a_disguised_file_is_refused_in_the_thread(
        settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    origin = base_url.removesuffix("/api/")
    with serving() as model:
        model.push(Reply(text="A grey square."))
        seeing = OpenAICompatibleModel(model="test-model", base_url=model.base_url, api_key=None, vision=True)
        async with agent(settings, seeing, base_url) as (runtime, http):
            shared = message_event("what is this?", user=ANA, channel=DM)
            shared["event"] |= {"subtype": "file_share", "files": [fake.shared(origin, png(), "shot.png", "image/png")]}
            await send(http, shared)
            texts = await settled(fake, runtime, DM)
            disguised = message_event("and this", user=ANA, channel="D0ANA2")
            disguised["event"] |= {"subtype": "file_share",
                                   "files": [fake.shared(origin, b"not an image", "cat.png", "image/png")]}
            await send(http, disguised)
            async with asyncio.timeout(10):
                while not fake.visible("D0ANA2"):
                    await asyncio.sleep(0.05)
            refused = await runtime.sessions.history("slack:D0ANA2")
    assert texts == ["A grey square."]
    assert model.requests[-1]["messages"][-1]["content"][1] == {
        "type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png()).decode()}}
    assert fake.visible("D0ANA2") == ["I could not take that file: cat.png says it is image/png, but its content is "
                                      "not"] and refused == [] and len(model.requests) == 1
    assert slacks_own("https://files.slack.com/files-pri/T1-F1/x.png", "https://slack.com/api/")
    assert not slacks_own("https://evil.example/files-pri/x.png", "https://slack.com/api/")  # the token stays home


async def test_a_file_the_model_sends_is_uploaded_into_the_thread_once(
        settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack

    def reply(messages: list[Message], tools: Any) -> ModelReply:
        if messages[-1].role is Role.TOOL:
            return ModelReply(text="The chart is attached.")
        return ModelReply(tool_calls=(ToolCall("s1", "send_file", json.dumps({"path": "chart.png"})),))
    async with agent(settings, FunctionModel(reply), base_url, builtin_tools=True) as (runtime, http):
        folder = workspaces(settings, None).for_identity(runtime.identities.resolve("slack", ANA)).root
        (folder / "chart.png").write_bytes(png(12, 6))
        mention = message_event("chart please", user=ANA, channel=TEAM, direct=False, mention=True)
        await send(http, mention)
        thread = mention["event"]["ts"]
        texts = await settled(fake, runtime, f"{TEAM}/{thread}")
        [answer] = [m for m in await runtime.sessions.history(f"slack:{TEAM}/{thread}")
                    if m.attachments and m.role is Role.ASSISTANT]
        again = await runtime.deliveries.store.answer_of(answer.turn_id or "")
        assert again is not None
        await runtime.deliveries.send(again)  # sent again after a restart: nothing is uploaded twice
        await settled_in(runtime, "slack").settled(f"{TEAM}/{thread}")
    assert texts == ["The chart is attached."]
    assert fake.uploaded == [(TEAM, thread, "chart.png", png(12, 6))]


async def test_a_stranger_is_told_once_and_nothing_is_kept(settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    async with agent(settings, answering("never"), base_url) as (runtime, http):
        for text in ("hello?", "anyone?"):
            await send(http, message_event(text, user=STRANGER, channel="D0STRANGER"))
        await asyncio.sleep(0.3)
        history = await runtime.sessions.history("slack:D0STRANGER")
    assert [e["user"] for e in fake.ephemeral] == [STRANGER]
    assert "Slack member ID: U0STRANGER" in fake.ephemeral[0]["text"]
    assert history == [] and fake.posted == {}


def test_channels_lists_the_app_and_doctor_checks_its_token_without_sending(
        tmp_path: Path, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    home = tmp_path / "home"
    home.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}, "EMBER_HOME": str(home)}
    ember = str(Path(sys.executable).with_name("ember"))
    (home / "ember.toml").write_text(f'[slack]\napi_base_url = "{base_url}"\nallowed_users = ["{ANA}"]\n')

    def run(*args: str, token: str) -> subprocess.CompletedProcess[str]:
        secrets = {"EMBER_SLACK_BOT_TOKEN": token, "EMBER_SLACK_SIGNING_SECRET": SIGNING_SECRET}
        return subprocess.run([ember, *args], env={**env, **secrets}, capture_output=True, text=True, timeout=120)

    [app] = [row for row in json.loads(run("channels", "--json", token=TOKEN).stdout) if row["channel"] == "slack"]
    assert app["name"] == "events, mention in channels" and "token set, 1 allowed users" in app["state"]
    good = run("doctor", token=TOKEN)
    assert "slack: the token is @ember in Test Team's; events mode" in good.stdout
    bad = run("doctor", token="xoxb-wrong")
    assert bad.returncode == 1 and "FAIL  slack:" in bad.stdout and "invalid_auth" in bad.stdout
    assert TOKEN not in good.stdout + good.stderr and "xoxb-wrong" not in bad.stdout + bad.stderr
    assert fake.posted == {} and fake.ephemeral == []  # nothing was sent


async def test_socket_mode_answers_events_and_button_presses_it_acknowledges(
        settings: Settings, slack: tuple[FakeSlack, str]) -> None:
    fake, base_url = slack
    ran: list[str] = []
    runtime = await build_runtime(settings, asking_model(), tools=ToolRegistry([writing_tool(ran)]))
    channel = SlackChannel(SlackSpec(bot_token=TOKEN, app_token=APP_TOKEN, mode="socket", api_base_url=base_url,
                                     allowed_users=[ANA]), chat_services(runtime))
    settling(runtime, channel)
    assert channel.routes() == []  # nothing for Slack to post to
    async with running(runtime, recover=True):
        asked = fake.send_on_socket("events_api", message_event("write my note", user=ANA, channel=DM))
        async with asyncio.timeout(20):
            while not fake.cards(DM) or asked not in fake.acked:
                await asyncio.sleep(0.05)
        [card] = fake.cards(DM)
        body, _ = press(card, ANA, "once")
        pressed = fake.send_on_socket("interactive", json.loads(parse_qs(body.decode())["payload"][0]))
        texts = await settled(fake, runtime, DM)
    assert ran == ["notes.txt"] and pressed in fake.acked
    assert texts[-1] == "Result: wrote notes.txt"
