"""Where the files of a channel's messages go: checked by their bytes, a voice note heard (its
transcript joins the message's text), a document's text read (off the event loop: a PDF takes a
while), kept once in their session, passed on by reference; and where an answer's files are read
back from to be sent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import httpx

from ember.core.attachments import (
    Attachment,
    AttachmentContent,
    AttachmentRefused,
    checked,
    with_content,
    with_text,
)
from ember.core.events import OutboundEvent
from ember.models.transcription import Transcriber
from ember.store.protocols import SessionBrowser

NO_TRANSCRIBER = "voice notes need a transcription model: name one in [model_roles] transcribe"


async def capped(response: httpx.Response, limit: int) -> bytes:
    """A streamed download's body; ValueError as soon as it passes `limit` bytes (attachment_max_bytes)."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > limit:
            raise ValueError(f"the file is over {limit} bytes (attachment_max_bytes)")
    return bytes(data)


def files_named(text: str, files: Sequence[Attachment],
                note: Callable[[Attachment], str] = lambda _: "this chat cannot show files") -> str:
    """An answer as a chat that cannot show its files gets it: its text, and a line naming each file
    (with `note`: why it is not shown, or where it is)."""
    return text + "".join(f"\n\n[{file.label}: {note(file)}]" for file in files)


def not_taken(reason: object) -> str:
    """What a chat is told of a message whose file was refused: nothing of that message is kept."""
    return f"I could not take that file: {reason}"


class FileShelf:
    def __init__(self, sessions: SessionBrowser, max_bytes: int, transcriber: Transcriber | None = None) -> None:
        self._sessions = sessions
        self.max_bytes = max_bytes  # a message's files together (attachment_max_bytes)
        self._transcriber = transcriber

    def checked(self, data: bytes, *, declared: str | None, name: str | None) -> AttachmentContent:
        """AttachmentRefused says why a file is not taken."""
        return checked(data, declared=declared, name=name, max_bytes=self.max_bytes)

    async def heard(self, text: str, files: Sequence[AttachmentContent]) -> str:
        """The message's text, with what its recordings say after it. AttachmentRefused when no model
        can hear them; ModelError when the model failed."""
        recordings = [f for f in files if f.is_audio]
        if recordings and self._transcriber is None:
            raise AttachmentRefused(NO_TRANSCRIBER, code="transcription_unavailable")
        spoken = [await self._transcriber.transcribe(f) for f in recordings] if self._transcriber else []
        return "\n\n".join(part for part in (text.strip() and text, *spoken) if part)

    async def keep(self, key: str, files: Sequence[AttachmentContent]) -> tuple[Attachment, ...]:
        """Store the files in the session (documents with their text) and give their references."""
        if not files:
            return ()
        if any(not f.is_image for f in files):
            files = await asyncio.to_thread(lambda: [with_text(f) for f in files])
        await self._sessions.keep_attachments(key, files)
        return tuple(f.reference() for f in files)

    async def outgoing(self, event: OutboundEvent,
                       can_send: Callable[[Attachment], bool]) -> tuple[str, list[AttachmentContent]]:
        """An answer as a chat that sends only some kinds of file shows it: its text, naming the files it
        cannot send, and the files it sends, with their bytes."""
        sendable = [f for f in event.attachments if can_send(f)]
        text = files_named(event.text, [f for f in event.attachments if f not in sendable])
        return text, await self.read(event.session_key, sendable) if sendable and event.session_key else []

    async def read(self, key: str, files: Sequence[Attachment]) -> list[AttachmentContent]:
        """The files an answer sends, with their bytes, in order; one the session no longer holds is left out."""
        stored = await self._sessions.attachments(key, [f.digest for f in files])
        return [content for f in files if isinstance(content := with_content(f, stored.get(f.digest)),
                                                       AttachmentContent)]
