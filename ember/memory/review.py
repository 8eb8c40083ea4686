"""Memory review: after a tool-heavy turn, keep the durable facts it revealed."""

from __future__ import annotations

from ember.core.leases import SessionLeases
from ember.core.memory import NewMemory, SourceRank
from ember.core.messages import Message, Role, Session
from ember.core.thinking import strip_thinking
from ember.memory.protocols import ReviewedMemory
from ember.memory.transcript import render_transcript
from ember.models.base import ModelClient, complete
from ember.store.protocols import SessionStore

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
    lines = strip_thinking(text).splitlines()
    return [line[2:].strip() for line in lines if line.startswith("- ") and line[2:].strip()]


async def load_last_turn(sessions: SessionStore, leases: SessionLeases,
                         session_key: str) -> tuple[Session, list[Message]]:
    """Under the lease: a load may write a repair, which must not race a turn."""
    async with leases.hold(session_key):
        session = await sessions.load(session_key)
    return session, last_turn(session.messages)


class MemoryReviewer:
    def __init__(self, sessions: SessionStore, leases: SessionLeases, model: ModelClient,
                 memory: ReviewedMemory) -> None:
        self._sessions = sessions
        self._leases = leases
        self._model = model
        self._memory = memory

    async def review(self, session_key: str) -> int:
        """Store the new facts of the session's last turn; returns how many."""
        session, turn = await load_last_turn(self._sessions, self._leases, session_key)
        if not turn or session.metadata.get("evaluation"):
            return 0
        reply = await complete(self._model, [Message.system(REVIEW_INSTRUCTION), Message.user(render_transcript(turn))])
        identity = await self._memory.turn_owner(session, turn[0].turn_id)
        outcomes = await self._memory.remember_many([
            NewMemory(identity=identity, content=fact, source=f"review of session {session_key}",
                      source_rank=SourceRank.CONSOLIDATED, session_key=session_key)
            for fact in parse_facts(reply.text)])
        return sum(outcome.created for outcome in outcomes)
