"""Voice into text: a voice note or a recording becomes its message's text, through an
OpenAI-compatible `/v1/audio/transcriptions` endpoint (`[model_roles] transcribe`), or, on the
demo, a scripted transcript that says it is one."""

from __future__ import annotations

from typing import Protocol

import openai
from openai import AsyncOpenAI

from ember.core.attachments import AttachmentContent
from ember.core.errors import ModelError
from ember.models.openai_compat import typed

DEMO_TRANSCRIPT = ("(A scripted demo transcript, not what was said: configure [model_roles] transcribe to hear "
                   "voice notes.) What can you do?")
_EXTENSIONS = {"audio/ogg": "ogg", "audio/mpeg": "mp3", "audio/wav": "wav", "audio/webm": "webm", "audio/mp4": "m4a"}


class Transcriber(Protocol):
    name: str

    async def transcribe(self, audio: AttachmentContent) -> str:
        """The words spoken; ModelError when the endpoint fails."""
        ...


class OpenAITranscriber:
    def __init__(self, *, model: str, base_url: str, api_key: str | None, timeout_s: float = 120.0) -> None:
        self.name = model
        self._base_url = base_url
        self._client = AsyncOpenAI(base_url=base_url, api_key=api_key or "not-needed", timeout=timeout_s,
                                   max_retries=2)

    async def transcribe(self, audio: AttachmentContent) -> str:
        # The endpoint reads the format from the file name's extension.
        name = audio.name if audio.name and "." in audio.name else f"voice.{_EXTENSIONS.get(audio.media_type, 'ogg')}"
        try:
            result = await self._client.audio.transcriptions.create(
                model=self.name, file=(name, audio.data, audio.media_type))
        except openai.OpenAIError as exc:
            raise typed(exc, f"transcription model {self.name} at {self._base_url} failed", self._base_url) from exc
        text = result.text.strip() if isinstance(result.text, str) else ""
        if not text:
            raise ModelError(f"transcription model {self.name} heard no words in {audio.label}")
        return text

    async def aclose(self) -> None:
        await self._client.close()


class DemoTranscriber:
    """The demo's: no model hears anything offline, and its transcript says so."""

    name = "demo-transcribe"

    async def transcribe(self, audio: AttachmentContent) -> str:
        return DEMO_TRANSCRIPT
