"""Photos and documents sent to the Telegram bot: fetched through the Bot API (getFile, then the
file), kept in the chat's session, and shown to a model that sees images as an image part; a file
too large or not what it claims is refused in the chat, and nothing of it is kept."""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest

from ember.app.tools import workspaces
from ember.config.settings import Settings
from ember.core.messages import Role
from ember.models.openai_compat import OpenAICompatibleModel
from ember.models.spec import ModelSpec
from ember.models.transcription import OpenAITranscriber
from ember.pipeline.voice import NO_SPEAKER, SPEECH_FAILED, TURNED_OFF, TURNED_ON
from tests.modelserver import SPOKEN_PREFIX, ModelServer, Reply, serving
from tests.telegramserver import FakeTelegram, serving_telegram
from tests.test_attachments import png
from tests.test_telegram import ANA, agent, all_confirmed, settled


@pytest.fixture
def telegram() -> Iterator[tuple[FakeTelegram, str]]:
    with serving_telegram() as served:
        yield served


@pytest.fixture
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


def seeing(model: ModelServer) -> OpenAICompatibleModel:
    return OpenAICompatibleModel(model="test-model", base_url=model.base_url, api_key=None, vision=True)


def kept_files(settings: Settings) -> list[Any]:
    with sqlite3.connect(settings.home / "ember.db") as db:
        return db.execute("SELECT session_key, media_type FROM attachments").fetchall()


async def test_a_photo_reaches_a_seeing_model_as_an_image_and_a_document_as_its_text(
        settings: Settings, telegram: tuple[FakeTelegram, str], model: ModelServer) -> None:
    fake, base_url = telegram
    model.push(Reply(text="A grey picture."), Reply(text="Two lemons."))
    photo = png(40, 30)
    async with agent(settings, seeing(model), base_url) as (runtime, _):
        fake.file_message(ANA, ANA, photo, photo=True, caption="what is this?")
        await settled(fake, runtime, ANA)
        fake.file_message(ANA, ANA, b"- oat milk\n- 2 lemons\n", file_name="list.md", mime_type="text/markdown")
        texts = await settled(fake, runtime, ANA, answers=2)
        history = await runtime.sessions.history(f"telegram:{ANA}")
    first, second = (request["messages"][-1]["content"] for request in model.requests)
    assert first == [{"type": "text", "text": "what is this?"},
                     {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(photo)
                                                         .decode()}}]
    assert [part["type"] for part in second] == ["text"] and "- 2 lemons" in second[0]["text"]
    assert texts[-2:] == ["A grey picture.", "Two lemons."]
    assert fake.fetched == ["f1", "f3"]  # the largest size of the photo, never its thumbnail
    questions = [m for m in history if m.role is Role.USER]
    assert [a.name for m in questions for a in m.attachments] == [f"photo-{5001}.jpg", "list.md"]
    assert [a.media_type for m in questions for a in m.attachments] == ["image/png", "text/markdown"]


async def test_a_voice_note_is_heard_as_the_message_and_the_model_is_told_it_was_spoken(
        settings: Settings, telegram: tuple[FakeTelegram, str], model: ModelServer) -> None:
    fake, base_url = telegram
    model.transcript = "What is on my list today?"
    model.push(Reply(text="Nothing yet."))
    ears = OpenAITranscriber(model="whisper-test", base_url=model.base_url, api_key=None)
    async with agent(settings, seeing(model), base_url, transcriber=ears) as (runtime, _):
        fake.file_message(ANA, ANA, b"OggS\x00\x02" + bytes(300), voice=True)
        texts = await settled(fake, runtime, ANA)
        [question, _] = await runtime.sessions.history(f"telegram:{ANA}")
    assert texts == ["Nothing yet."] and model.transcribed == [("voice-5001.ogg", "audio/ogg", 306, "whisper-test")]
    assert question.content == "What is on my list today?" and question.attachments[0].media_type == "audio/ogg"
    parts = model.requests[-1]["messages"][-1]["content"]
    assert parts[0]["text"] == "What is on my list today?" and "a recording" in parts[1]["text"]


@pytest.mark.parametrize(("sent", "said", "fetched"), [
    ({"data": b"x" * 100, "file_size": 50_000_000, "file_name": "huge.zip"}, "huge.zip is 50000000 bytes", []),
    ({"data": b"just text", "file_name": "cat.png", "mime_type": "image/png"}, "cat.png says it is image/png",
     ["f1"]),
])
async def test_a_file_too_large_or_in_disguise_is_refused_in_the_chat_and_nothing_is_kept(
        settings: Settings, telegram: tuple[FakeTelegram, str], model: ModelServer, sent: dict[str, Any],
        said: str, fetched: list[str]) -> None:
    fake, base_url = telegram
    async with agent(settings, seeing(model), base_url) as (runtime, _):
        fake.file_message(ANA, ANA, sent.pop("data"), **sent)
        async with asyncio.timeout(20):
            while not fake.texts(ANA):
                await asyncio.sleep(0.05)
        await all_confirmed(fake)
        assert await runtime.sessions.history(f"telegram:{ANA}") == []
    [told] = fake.texts(ANA)
    assert told.startswith("I could not take that file: ") and said in told
    assert fake.fetched == fetched  # a file over the limit is not even fetched
    assert model.requests == [] and kept_files(settings) == []


async def test_a_file_a_tool_sends_follows_the_answer_once_and_a_disguised_one_is_refused_to_the_model(
        settings: Settings, telegram: tuple[FakeTelegram, str], model: ModelServer) -> None:
    fake, base_url = telegram
    chart = png(16, 8)
    model.push(Reply(tool_calls=(("send_file", json.dumps({"path": "fake.png"})),)),
               Reply(tool_calls=(("send_file", json.dumps({"path": "out/chart.png", "name": "June.png"})),)),
               Reply(text="Here is June's chart."))
    fake.rate_limits["sendPhoto"].append(1)  # Telegram says wait a second: sent once, after it
    async with agent(settings, seeing(model), base_url, builtin_tools=True) as (runtime, _):
        folder = workspaces(settings, None).for_identity(runtime.identities.resolve("telegram", str(ANA))).root
        (folder / "out").mkdir()
        (folder / "out" / "chart.png").write_bytes(chart)
        (folder / "fake.png").write_text("not a picture at all")
        fake.message(ANA, ANA, "send me June's chart")
        await settled(fake, runtime, ANA)
        async with asyncio.timeout(20):
            while not any(shown.file for shown in fake.visible(ANA)):
                await asyncio.sleep(0.05)
        await all_confirmed(fake)
        history = await runtime.sessions.history(f"telegram:{ANA}")
        [answer] = [m for m in history if m.role is Role.ASSISTANT and not m.tool_calls]
        again = await runtime.deliveries.store.answer_of(answer.turn_id or "")
        assert again is not None and again.attachments == answer.attachments
        await runtime.deliveries.send(again)  # a re-send after a restart shows nothing twice
        await settled(fake, runtime, ANA)
    refused, accepted = [m.content for m in history if m.role is Role.TOOL]
    assert refused.startswith("Error: fake.png cannot be sent") and "image/png" in refused
    assert accepted.startswith("June.png (image/png, ") and accepted.endswith("will be sent with your answer.")
    [text, photo] = fake.visible(ANA)
    assert text.text == "Here is June's chart." and photo.file is not None
    assert (photo.file.method, photo.file.name, photo.file.data) == ("sendPhoto", "June.png", chart)
    assert [(a.name, a.media_type, a.size) for a in answer.attachments] == [("June.png", "image/png", len(chart))]
    assert [w.ok for w in fake.writes_in(ANA) if w.method == "sendPhoto"] == [False, True]


def speaking(settings: Settings, model: ModelServer) -> Settings:
    """`settings` with a speech model ([model_roles] speech) on the model server."""
    return settings.model_copy(update={
        "models": {"chat": ModelSpec(base_url=model.base_url, model=model.model),
                   "tts": ModelSpec(base_url=model.base_url, model="tts-test", voice="nova")},
        "model_roles": {"main": ["chat"], "speech": ["tts"]}})


async def test_voice_on_sends_each_answer_as_a_voice_note_too_until_voice_off(
        settings: Settings, telegram: tuple[FakeTelegram, str], model: ModelServer) -> None:
    fake, base_url = telegram
    model.push(Reply(text="It is sunny."), Reply(text="Rain later."), Reply(text="Dry tomorrow."))
    async with agent(speaking(settings, model), seeing(model), base_url) as (runtime, _):
        for n, text in enumerate(["/voice on", "weather now?", "and tonight?", "/voice off", "tomorrow?"], 1):
            model.speech_fails = text == "and tonight?"
            fake.message(ANA, ANA, text)
            await settled(fake, runtime, ANA, answers=n)
        await all_confirmed(fake)
        history = await runtime.sessions.history(f"telegram:{ANA}")
    said = [(m.content, [a.media_type for a in m.attachments]) for m in history if m.role is Role.ASSISTANT]
    assert said == [(TURNED_ON, ["audio/ogg"]), ("It is sunny.", ["audio/ogg"]),
                    ("Rain later." + SPEECH_FAILED, []), (TURNED_OFF, []), ("Dry tomorrow.", [])]
    assert [(m, v, f) for m, v, _, f in model.spoken] == [("tts-test", "nova", "opus")] * 2
    voiced = [shown.file for shown in fake.visible(ANA) if shown.file]
    assert [(f.method, f.data) for f in voiced] == [("sendVoice", SPOKEN_PREFIX + t.encode())
                                                    for t in (TURNED_ON, "It is sunny.")]
    assert len(model.requests) == 3  # the commands are answered without the model


async def test_voice_on_without_a_speech_model_says_what_is_missing(
        settings: Settings, telegram: tuple[FakeTelegram, str], model: ModelServer) -> None:
    fake, base_url = telegram
    async with agent(settings, seeing(model), base_url) as (runtime, _):
        fake.message(ANA, ANA, "/voice on")
        assert await settled(fake, runtime, ANA) == [NO_SPEAKER]
    assert model.requests == []
