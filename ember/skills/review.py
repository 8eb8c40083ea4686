"""Skill review: after a tool-heavy turn, note the tool sequence that answered it.

These notes are the raw material the skills store (SKILL.md files) will be
distilled from; for now they are kept as procedural memories.
"""

from __future__ import annotations

from ember.core.leases import SessionLeases
from ember.core.memory import MemoryKind, SourceRank
from ember.memory.review import load_last_turn
from ember.memory.service import MemoryService
from ember.store.sessions import SessionStore


class SkillReviewer:
    def __init__(self, sessions: SessionStore, leases: SessionLeases, memory: MemoryService) -> None:
        self._sessions = sessions
        self._leases = leases
        self._memory = memory

    async def review(self, session_key: str) -> str | None:
        session, turn = await load_last_turn(self._sessions, self._leases, session_key)
        tools = [call.name for message in turn for call in message.tool_calls]
        if not turn or not tools:
            return None
        request = " ".join(turn[0].content.split())[:120]
        note = f"For {request!r}: {' -> '.join(tools)}"
        await self._memory.remember(await self._memory.turn_owner(session, turn[0].turn_id), note,
                                    kind=MemoryKind.PROCEDURAL, source=f"skill review of session {session_key}",
                                    source_rank=SourceRank.INFERRED, session_key=session_key)
        return note
