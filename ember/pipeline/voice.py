"""Spoken replies. `/voice on` and `/voice off`, typed in any chat, turn them on and off for its
session (kept in the session's metadata, committed with the command's answer); while they are on,
each answer is spoken by the speech model (`[model_roles] speech`) and sent with its text as a
recording, which a chat platform plays as a voice message. Answering the command calls no model."""

from __future__ import annotations

import logging
import re

from ember.core.attachments import Attachment
from ember.core.errors import ModelError
from ember.core.messages import Session
from ember.models.speech import Speaker
from ember.tools.send_file import FileKeeper

log = logging.getLogger(__name__)

VOICE = "voice"  # the session metadata's flag
_COMMAND = re.compile(r"[/／]voice\s+(on|off)", re.IGNORECASE)
NO_SPEAKER = "Spoken replies need a speech model: name one in [model_roles] speech (an endpoint with /v1/audio/speech)."
TURNED_ON = ("Spoken replies are on: each answer in this conversation comes as a voice message too. "
             "/voice off ends them.")
TURNED_OFF = "Spoken replies are off."
SPEECH_FAILED = "\n\n(No voice message this time: the speech model failed.)"


def voice_command(text: str) -> bool | None:
    """True for `/voice on`, False for `/voice off`, None for anything else."""
    found = _COMMAND.fullmatch(text.strip())
    return None if found is None else found[1].lower() == "on"


class SpokenReplies:
    def __init__(self, speaker: Speaker | None, keeper: FileKeeper) -> None:
        self._speaker = speaker
        self._keeper = keeper

    def switch(self, session: Session, on: bool) -> str:
        """Set the session's flag (its next commit keeps it); what the person is told."""
        if on and self._speaker is None:
            return NO_SPEAKER
        session.metadata[VOICE] = on
        return TURNED_ON if on else TURNED_OFF

    async def recording(self, session: Session, text: str) -> tuple[tuple[Attachment, ...], str]:
        """The answer spoken and kept in the session, where the session asked for it; or, when the
        speech model failed, a note for the answer's end: it costs the answer its recording, never
        the answer."""
        if self._speaker is None or not session.metadata.get(VOICE) or not text.strip():
            return (), ""
        try:
            audio = await self._speaker.speak(text)
        except ModelError as exc:
            log.warning("the answer in %s goes without its recording: %s", session.key, exc)
            return (), SPEECH_FAILED
        await self._keeper.keep_attachments(session.key, [audio])
        return (audio.reference(),), ""
