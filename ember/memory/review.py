"""Memory review: after a tool-heavy turn, keep the durable facts it revealed."""

from __future__ import annotations

from ember.core.messages import Message, Role
from ember.core.thinking import strip_thinking
from ember.memory.service import MemoryService
from ember.memory.transcript import render_transcript
from ember.models.base import ModelClient, complete
from ember.store.sessions import SessionStore

REVIEW_INSTRUCTION = (
    "Below is the latest exchange between a user and you. List the durable facts about the user, "
    "their projects or their preferences that are worth remembering in later conversations, one per "
    "line, each starting with '- '. If there are none, answer NONE."
)


def last_turn(messages: list[Message]) -> list[Message]:
    """The messages from the last user message on."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role is Role.USER:
            return messages[index:]
    return []


def parse_facts(text: str) -> list[str]:
    return [line[2:].strip() for line in strip_thinking(text).splitlines() if line.startswith("- ") and line[2:].strip()]


class MemoryReviewer:
    def __init__(self, sessions: SessionStore, model: ModelClient, memory: MemoryService) -> None:
        self._sessions = sessions
        self._model = model
        self._memory = memory

    async def review(self, session_key: str) -> int:
        """Store the facts of the session's last turn; returns how many."""
        turn = last_turn((await self._sessions.load(session_key)).messages)
        if not turn:
            return 0
        reply = await complete(self._model, [Message.system(REVIEW_INSTRUCTION), Message.user(render_transcript(turn))])
        facts = parse_facts(reply.text)
        for fact in facts:
            await self._memory.remember("fact", fact, session_key=session_key)
        return len(facts)
