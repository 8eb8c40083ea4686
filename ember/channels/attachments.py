"""Where the files of a channel's messages go: checked by their bytes, a voice note heard (its
transcript joins the message's text), a document's text read (off the event loop: a PDF takes a
while), kept once in their session, passed on by reference."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ember.core.attachments import Attachment, AttachmentContent, AttachmentRefused, checked, with_text
from ember.models.transcription import Transcriber
from ember.store.protocols import SessionBrowser

NO_TRANSCRIBER = "voice notes need a transcription model: name one in [model_roles] transcribe"


class FileShelf:
    def __init__(self, sessions: SessionBrowser, max_bytes: int, transcriber: Transcriber | None = None) -> None:
        self._sessions = sessions
        self.max_bytes = max_bytes  # a message's files together (attachment_max_bytes)
        self._transcriber = transcriber

    def checked(self, data: bytes, *, declared: str | None, name: str | None) -> AttachmentContent:
        """AttachmentRefused says why a file is not taken."""
        return checked(data, declared=declared, name=name, max_bytes=self.max_bytes)

    async def transcripts(self, files: Sequence[AttachmentContent]) -> str:
        """What the files' recordings say ("" when there are none). AttachmentRefused when no model
        can hear them; ModelError when the model failed."""
        recordings = [f for f in files if f.is_audio]
        if not recordings:
            return ""
        if self._transcriber is None:
            raise AttachmentRefused(NO_TRANSCRIBER, code="transcription_unavailable")
        return "\n\n".join([await self._transcriber.transcribe(f) for f in recordings])

    async def keep(self, key: str, files: Sequence[AttachmentContent]) -> tuple[Attachment, ...]:
        """Store the files in the session (documents with their text) and give their references."""
        if not files:
            return ()
        if any(not f.is_image for f in files):
            files = await asyncio.to_thread(lambda: [with_text(f) for f in files])
        await self._sessions.keep_attachments(key, files)
        return tuple(f.reference() for f in files)
