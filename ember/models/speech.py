"""Text into voice: an answer spoken, for a person who turned spoken replies on (`/voice on`), through
an OpenAI-compatible `/v1/audio/speech` endpoint (`[model_roles] speech`), or, on the demo, a
scripted tone that says in its name that it is not speech."""

from __future__ import annotations

import io
import math
import struct
import wave
from typing import Protocol

import openai
from openai import AsyncOpenAI

from ember.core.attachments import AttachmentContent, AttachmentRefused, checked
from ember.core.errors import ModelError
from ember.models.openai_compat import typed

# The endpoint's limit on its input (OpenAI's: 4,096 characters); a longer answer is spoken up to it.
MAX_SPOKEN_CHARS = 4_096
MAX_AUDIO_BYTES = 25 * 1024 * 1024
DEMO_NAME = "scripted-demo-tone-not-speech.wav"


class Speaker(Protocol):
    name: str

    async def speak(self, text: str) -> AttachmentContent:
        """The text spoken, as a recording; ModelError when the endpoint fails."""
        ...


def spoken_part(text: str) -> str:
    """What of an answer is read out: up to the endpoint's limit, cut at a sentence or word where it can."""
    if len(text) <= MAX_SPOKEN_CHARS:
        return text
    head = text[:MAX_SPOKEN_CHARS]
    cut = max(head.rfind(". "), head.rfind("\n"))
    return head[: cut + 1] if cut > MAX_SPOKEN_CHARS // 2 else head.rsplit(" ", 1)[0]


class OpenAISpeaker:
    def __init__(self, *, model: str, base_url: str, api_key: str | None, voice: str,
                 timeout_s: float = 120.0) -> None:
        self.name = model
        self._voice = voice
        self._base_url = base_url
        self._client = AsyncOpenAI(base_url=base_url, api_key=api_key or "not-needed", timeout=timeout_s,
                                   max_retries=2)

    async def speak(self, text: str) -> AttachmentContent:
        # Opus in Ogg: what chat platforms play as a voice note.
        try:
            response = await self._client.audio.speech.create(model=self.name, voice=self._voice,
                                                              input=spoken_part(text), response_format="opus")
            data = await response.aread()
        except openai.OpenAIError as exc:
            raise typed(exc, f"speech model {self.name} at {self._base_url} failed", self._base_url) from exc
        try:
            return checked(data, declared="audio/ogg", name="reply.ogg", max_bytes=MAX_AUDIO_BYTES)
        except AttachmentRefused as exc:
            raise ModelError(f"speech model {self.name} did not answer with Ogg audio: {exc}") from exc

    async def aclose(self) -> None:
        await self._client.close()


class DemoSpeaker:
    """The demo's: no model speaks offline, so a short tone stands in, named for what it is."""

    name = "demo-speech"

    async def speak(self, text: str) -> AttachmentContent:
        return checked(_tone(), declared="audio/wav", name=DEMO_NAME, max_bytes=MAX_AUDIO_BYTES)


def _tone(seconds: float = 0.4, hz: int = 440, rate: int = 8_000) -> bytes:
    samples = b"".join(struct.pack("<h", int(8_000 * math.sin(2 * math.pi * hz * n / rate)))
                       for n in range(int(seconds * rate)))
    out = io.BytesIO()
    with wave.open(out, "wb") as recording:
        recording.setnchannels(1)
        recording.setsampwidth(2)
        recording.setframerate(rate)
        recording.writeframes(samples)
    return out.getvalue()
