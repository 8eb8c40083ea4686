"""The DingTalk channel against the tests' own DingTalk, over real HTTP on 127.0.0.1: signed
callbacks in, answers out through the session webhook (or the OpenAPI once that is gone), in
parts; a callback posted again answered once; forged and stale callbacks refused; "too fast"
waited out with one copy of each part; typed approvals only the asker can give; strangers told once."""

from __future__ import annotations

import asyncio
import base64
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

import httpx
import pytest

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.app.tools import workspaces
from ember.channels.dingtalk.channel import DingTalkChannel
from ember.channels.dingtalk.config import DingTalkSpec
from ember.config.settings import Settings
from ember.core.messages import Role
from ember.models.base import ModelClient
from ember.models.openai_compat import OpenAICompatibleModel
from ember.tools.base import ToolRegistry
from tests.chatplatform import answered, asking_model, called_back, sending_model, settling, writing_tool
from tests.dingtalkserver import APP_KEY, APP_SECRET, FakeDingTalk, serving_dingtalk, signed
from tests.gatewayproc import EMBER_SOURCE
from tests.loopback import wait_until
from tests.modelserver import Reply, serving
from tests.test_attachments import png
from tests.test_telegram import answering

ANA, BEN, STRANGER = "staff-ana", "staff-ben", "staff-stranger"
TEAM = "cidTEAM0001"
LONG = "\n\n".join(f"Part {n}: " + "words " * 300 for n in range(1, 5))  # over DingTalk's 5,000 characters


@pytest.fixture
def dingtalk() -> Iterator[FakeDingTalk]:
    with serving_dingtalk() as fake:
        yield fake


def spec(fake: FakeDingTalk, **fields: Any) -> DingTalkSpec:
    return DingTalkSpec(**{"app_key": APP_KEY, "app_secret": APP_SECRET, "api_base_url": fake.origin,
                           "oapi_base_url": fake.origin, "allowed_users": [ANA, BEN], **fields})


@asynccontextmanager
async def agent(settings: Settings, model: ModelClient, fake: FakeDingTalk, *,
                tools: ToolRegistry | None = None) -> AsyncIterator[tuple[Runtime, httpx.AsyncClient]]:
    runtime = await build_runtime(settings, model, tools=tools or ToolRegistry())
    async with called_back(runtime, DingTalkChannel(spec(fake), chat_services(runtime))) as http:
        yield runtime, http


async def post(http: httpx.AsyncClient, message: dict[str, Any], **headers: str) -> httpx.Response:
    body = json.dumps(message).encode()
    return await http.post("/channels/dingtalk/events", content=body, headers={**signed(body), **headers})


async def settled(fake: FakeDingTalk, runtime: Runtime, chat_id: str, *, answers: int = 1) -> list[str]:
    await answered(runtime, "dingtalk", chat_id, answers=answers)
    return fake.texts(chat_id)


async def test_a_long_answer_goes_through_the_session_webhook_in_parts_once(
        settings: Settings, dingtalk: FakeDingTalk) -> None:
    async with agent(settings, answering(LONG, delay_s=0), dingtalk) as (runtime, http):
        message = dingtalk.message("tell me everything", sender=ANA)
        assert (await post(http, message)).status_code == 200
        again = await post(http, message)  # DingTalk posts a callback again when unsure it arrived
        assert again.status_code == 200
        texts = await settled(dingtalk, runtime, f"user:{ANA}")
        history = await runtime.sessions.history(f"dingtalk:user:{ANA}")
    assert len(texts) >= 2 and all(len(t) <= 5_000 for t in texts)
    assert "\n\n".join(texts).replace("\n\n", " ").split() == LONG.replace("\n\n", " ").split()
    assert set(dingtalk.ways(f"user:{ANA}")) == {"webhook"}
    assert [m.role for m in history] == [Role.USER, Role.ASSISTANT]


async def test_forged_and_stale_callbacks_are_refused(settings: Settings, dingtalk: FakeDingTalk) -> None:
    async with agent(settings, answering("never"), dingtalk) as (runtime, http):
        body = json.dumps(dingtalk.message("hi", sender=ANA)).encode()
        forged = await http.post("/channels/dingtalk/events", content=body, headers=signed(body, secret="not-it"))
        stale = await http.post("/channels/dingtalk/events", content=body,
                                headers=signed(body, at_ms=(time.time() - 7200) * 1000))
        bare = await http.post("/channels/dingtalk/events", content=body)
        await asyncio.sleep(0.3)
        history = await runtime.sessions.history(f"dingtalk:user:{ANA}")
    assert [r.status_code for r in (forged, stale, bare)] == [401, 401, 401]
    assert forged.json()["error"]["code"] == "invalid_signature" and history == [] and dingtalk.shown == []


async def test_too_fast_is_waited_out_and_each_part_shows_once(settings: Settings, dingtalk: FakeDingTalk) -> None:
    dingtalk.refusals["webhook"] = [130101, 130101, 130101]
    async with agent(settings, answering(LONG, delay_s=0), dingtalk) as (runtime, http):
        await post(http, dingtalk.message("tell me everything", sender=ANA))
        texts = await settled(dingtalk, runtime, f"user:{ANA}")
    assert "\n\n".join(texts).replace("\n\n", " ").split() == LONG.replace("\n\n", " ").split()
    assert dingtalk.refusals["webhook"] == []


async def test_in_a_group_only_the_asker_can_approve_by_typing(settings: Settings, dingtalk: FakeDingTalk) -> None:
    ran: list[str] = []
    async with agent(settings, asking_model(), dingtalk, tools=ToolRegistry([writing_tool(ran)])) as (runtime, http):
        await post(http, dingtalk.message("write my note", sender=ANA, group=TEAM))
        chat = f"group:{TEAM}"
        async with asyncio.timeout(20):
            while not any("/approve" in t for t in dingtalk.texts(chat)):
                await asyncio.sleep(0.05)
        request = next(t for t in dingtalk.texts(chat) if "/approve" in t)
        short = request.rsplit("/deny ", 1)[1].strip()
        await post(http, dingtalk.message(f"/approve {short}", sender=BEN, group=TEAM, nick="Ben"))
        assert dingtalk.texts(chat)[-1] == "This request is not yours to answer." and ran == []
        await post(http, dingtalk.message(f"/approve {short}", sender=ANA, group=TEAM))
        texts = await settled(dingtalk, runtime, chat)
    assert ran == ["notes.txt"] and "Allowed once." in texts and texts[-1] == "Result: wrote notes.txt"


async def test_a_stranger_is_told_once_and_nothing_is_kept(settings: Settings, dingtalk: FakeDingTalk) -> None:
    async with agent(settings, answering("never"), dingtalk) as (runtime, http):
        for text in ("hello?", "anyone?"):
            await post(http, dingtalk.message(text, sender=STRANGER))
        await asyncio.sleep(0.3)
        history = await runtime.sessions.history(f"dingtalk:user:{STRANGER}")
    [told] = dingtalk.texts(f"user:{STRANGER}")
    assert "DingTalk staff id: staff-stranger" in told and history == []


async def test_a_picture_reaches_a_seeing_model_a_voice_message_is_its_text_and_an_unread_file_is_refused(
        settings: Settings, dingtalk: FakeDingTalk) -> None:
    with serving() as model:
        model.push(Reply(text="A grey square."), Reply(text="Calling Ada."))
        seeing = OpenAICompatibleModel(model="test-model", base_url=model.base_url, api_key=None, vision=True)
        async with agent(settings, seeing, dingtalk) as (runtime, http):
            await post(http, dingtalk.file_message(png(), sender=ANA))
            voice = dingtalk.message("", sender=ANA)
            voice |= {"msgtype": "audio", "content": {"duration": 2, "downloadCode": "dcv", "recognition": "Call Ada"}}
            del voice["text"]
            await post(http, voice)
            texts = await settled(dingtalk, runtime, f"user:{ANA}", answers=2)
            await post(http, dingtalk.file_message(b"MZ\x90\x00 an exe", sender=BEN, kind="file",
                                                   file_name="setup.exe"))
            history = await runtime.sessions.history(f"dingtalk:user:{BEN}")
    assert texts == ["A grey square.", "Calling Ada."]
    [image] = [p for p in model.requests[0]["messages"][-1]["content"] if p["type"] == "image_url"]
    assert image["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(png()).decode()
    assert model.requests[1]["messages"][-1]["content"] == "Call Ada"
    assert dingtalk.texts(f"user:{BEN}")[0].startswith("I could not take that file: setup.exe is not a type")
    assert history == []


def test_kill_9_before_the_answer_still_answers_once_through_the_openapi(
        tmp_path: Path, dingtalk: FakeDingTalk) -> None:
    """Killed while the model is still answering: after the restart the turn is resumed and its
    answer sent once, through the OpenAPI (the session webhook died with the process)."""
    home, origin = tmp_path / "home", tmp_path / "origin"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    command = [sys.executable, "-m", "tests.chat_child", "dingtalk", str(home), dingtalk.origin, str(origin)]
    child = subprocess.Popen(command, cwd=EMBER_SOURCE, env={**env, "PYTHONPATH": EMBER_SOURCE}, stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_until(lambda: (origin.exists() and origin.read_text() != "") or child.poll() is not None,
                   timeout_s=60, what="the child to serve")
        body = json.dumps(dingtalk.message("a hard question", sender=ANA)).encode()
        assert httpx.post(origin.read_text() + "/channels/dingtalk/events", content=body, headers=signed(body),
                          timeout=10).status_code == 200
        time.sleep(1.0)  # the turn is under way, its model slow
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert dingtalk.shown == []

    async def restarted() -> list[str]:
        async with agent(Settings(home=home), answering("The answer, after the restart."), dingtalk) as (runtime, _):
            return await settled(dingtalk, runtime, f"user:{ANA}")

    assert asyncio.run(restarted()) == ["The answer, after the restart."]
    assert dingtalk.ways(f"user:{ANA}") == ["openapi"]


def test_channels_lists_the_robot_and_doctor_checks_its_secret_without_sending(
        tmp_path: Path, dingtalk: FakeDingTalk) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}, "EMBER_HOME": str(home)}
    ember = str(Path(sys.executable).with_name("ember"))
    (home / "ember.toml").write_text(f'[dingtalk]\napp_key = "{APP_KEY}"\napi_base_url = "{dingtalk.origin}"\n')

    def run(*args: str, secret: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ember, *args], env={**env, "EMBER_DINGTALK_APP_SECRET": secret}, capture_output=True,
                              text=True, timeout=120)

    [robot] = [row for row in json.loads(run("channels", "--json", secret=APP_SECRET).stdout)
               if row["channel"] == "dingtalk"]
    assert robot["state"] == "POST /channels/dingtalk/events, all allowed users"
    good = run("doctor", secret=APP_SECRET)
    assert f"dingtalk: app {APP_KEY} got an access token" in good.stdout
    bad = run("doctor", secret="wrong-secret")
    assert bad.returncode == 1 and "FAIL  dingtalk: DingTalk refused the app key and secret" in bad.stdout
    assert APP_SECRET not in good.stdout + good.stderr and "wrong-secret" not in bad.stdout + bad.stderr
    assert dingtalk.shown == []  # nothing was sent


async def test_stream_mode_reads_the_socket_acks_each_frame_and_connects_again_when_told(
        settings: Settings, dingtalk: FakeDingTalk) -> None:
    runtime = await build_runtime(settings, answering(lambda q: f"Re: {q}", delay_s=0), tools=ToolRegistry())
    channel = DingTalkChannel(spec(dingtalk, mode="stream"), chat_services(runtime))
    assert channel.routes() == []  # nothing for DingTalk to call back
    settling(runtime, channel)
    async with running(runtime, recover=True):
        hello = dingtalk.message("hello", sender=ANA)
        frames = [dingtalk.stream(hello), dingtalk.stream(hello)]  # sent twice: one turn
        await settled(dingtalk, runtime, f"user:{ANA}")
        ping = dingtalk.system("ping")
        async with asyncio.timeout(10):
            while ping not in dingtalk.acks:
                await asyncio.sleep(0.05)
        dingtalk.system("disconnect")
        async with asyncio.timeout(20):
            while dingtalk.connections < 2:
                await asyncio.sleep(0.05)
        frames.append(dingtalk.stream(dingtalk.message("again", sender=ANA)))
        texts = await settled(dingtalk, runtime, f"user:{ANA}", answers=2)
        async with asyncio.timeout(10):  # the fake reads acknowledgements on its own loop
            while not all(f in dingtalk.acks for f in frames):
                await asyncio.sleep(0.05)
    assert texts == ["Re: hello", "Re: again"] and all(dingtalk.acks[f]["code"] == 200 for f in frames)
    assert json.loads(dingtalk.acks[ping]["data"]) == json.loads(
        next(f["data"] for f in dingtalk.frames if f["headers"]["messageId"] == ping))  # a ping's data comes back
    assert dingtalk.connections == 2


async def test_the_models_picture_follows_the_answer_and_a_file_dingtalk_cannot_take_is_named(
        settings: Settings, dingtalk: FakeDingTalk) -> None:
    # The built-in tools, send_file among them.
    runtime = await build_runtime(settings, sending_model("chart.png", "notes.md"))
    folder = workspaces(settings, None).for_identity(runtime.identities.resolve("dingtalk", ANA)).root
    (folder / "chart.png").write_bytes(png(4, 4))
    (folder / "notes.md").write_text("- buy milk")
    async with called_back(runtime, DingTalkChannel(spec(dingtalk), chat_services(runtime))) as http:
        await post(http, dingtalk.message("the chart, please", sender=ANA))
        texts = await settled(dingtalk, runtime, f"user:{ANA}")
    assert texts == ["Here you are.\n\n[notes.md (text/markdown, 10 bytes): this chat cannot show files]"]
    assert dingtalk.sent_files == [(f"user:{ANA}", "sampleImageMsg", ("chart.png", png(4, 4)))]
