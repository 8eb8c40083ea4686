"""Session titles: after a session's first exchange, the background model names it in a few
words, for the page's session list. A person's own name for a session always wins: the title
is written only where the session has none, and a failed or unusable answer leaves the list
showing the session's first words, as before."""

from __future__ import annotations

import logging

from ember.core.messages import Message, Role
from ember.core.redact import redact_text
from ember.core.thinking import strip_thinking
from ember.memory.transcript import render_transcript
from ember.models.base import ModelClient, complete
from ember.store.protocols import SessionTitles

TITLE_INSTRUCTION = (
    "Below is the start of a conversation between a user and an assistant. Write a title for it: "
    "three to six words in the user's language, no quotes, no final full stop. Answer with the title only."
)
MAX_TITLE_CHARS = 60
DECORATION = "\"'“”‘’「」《》*#`.。 "  # around a title, or its final full stop
EXCHANGE_CHARS = 1_500  # of each message the model reads

log = logging.getLogger(__name__)


def clean_title(answer: str) -> str | None:
    """The title in a model's answer: its first line, without quotes and a trailing full stop;
    None when nothing usable is left."""
    lines = [line.strip() for line in strip_thinking(answer).splitlines() if line.strip()]
    if not lines:
        return None
    title = lines[0].removeprefix("Title:").strip(DECORATION)
    # A title is derived, and shown in every session list: it never repeats a key the message held.
    title = " ".join(redact_text(title).split())
    if not title or title.upper() == "NONE":
        return None
    return title if len(title) <= MAX_TITLE_CHARS else title[:MAX_TITLE_CHARS - 1].rstrip() + "…"


class SessionTitler:
    def __init__(self, sessions: SessionTitles, model: ModelClient) -> None:
        self._sessions = sessions
        self._model = model

    async def title(self, session_key: str) -> str | None:
        """Name the session from its first exchange; the title written, or None."""
        history = await self._sessions.history(session_key)
        first = [m for m in history[:10] if m.role in (Role.USER, Role.ASSISTANT) and not m.tool_calls][:2]
        if len(first) < 2:
            return None  # nothing answered yet
        transcript = render_transcript(first, max_chars_per_message=EXCHANGE_CHARS)
        reply = await complete(self._model, [Message.system(TITLE_INSTRUCTION), Message.user(transcript)])
        title = clean_title(reply.text)
        if title is None:
            log.info("the background model gave no usable title for %s", session_key)
            return None
        return title if await self._sessions.name_if_untitled(session_key, title) else None
