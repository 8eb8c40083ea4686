"""Folding old messages of a session into an episodic summary (I5).

The worker never writes a stale session: it reloads under the session lease,
asks the model outside the lease, and advances `last_consolidated` forward
only, by compare-and-set, never into the middle of a tool-call chain.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ember.core.leases import SessionLeases
from ember.core.messages import Message, Role, Session
from ember.core.thinking import strip_thinking
from ember.memory.service import MemoryService
from ember.memory.transcript import render_transcript
from ember.models.base import ModelClient, complete
from ember.store.sessions import SessionStore

log = logging.getLogger(__name__)

SUMMARY_INSTRUCTION = (
    "Summarise the conversation excerpt below for your own future reference. Keep facts, "
    "decisions, names, numbers and open tasks; drop small talk. Answer with the summary only."
)


def should_consolidate(unconsolidated: int, threshold: int) -> bool:
    """Whether a session with `unconsolidated` messages past its boundary is due."""
    return unconsolidated >= threshold


@dataclass(frozen=True, slots=True)
class Chunk:
    """Messages [start, end) by seq, to be replaced by one summary."""

    start: int
    end: int
    messages: tuple[Message, ...]


def plan_chunk(session: Session, keep_recent: int) -> Chunk | None:
    """The oldest unconsolidated messages, leaving `keep_recent` verbatim.

    The end moves back past trailing tool results and assistant tool-call
    messages, so the boundary never splits a call from its results.
    """
    window = session.messages
    end = len(window) - keep_recent
    while end > 0 and (window[end - 1].role is Role.TOOL or window[end - 1].has_tool_calls):
        end -= 1
    if end <= 0:
        return None
    boundary = window[end].seq if end < len(window) else session.next_seq
    assert boundary is not None, "stored messages always have a seq"
    return Chunk(start=session.last_consolidated, end=boundary, messages=tuple(window[:end]))


class ConsolidationWorker:
    def __init__(self, sessions: SessionStore, leases: SessionLeases, model: ModelClient,
                 memory: MemoryService, *, keep_recent: int) -> None:
        self._sessions = sessions
        self._leases = leases
        self._model = model
        self._memory = memory
        self._keep_recent = keep_recent

    async def consolidate(self, session_key: str) -> bool:
        """True when the boundary moved; False when there was nothing to do or a
        concurrent consolidation got there first."""
        async with self._leases.hold(session_key):
            session = await self._sessions.load(session_key)
        chunk = plan_chunk(session, self._keep_recent)
        if chunk is None:
            return False
        summary = await self.summarize(chunk.messages)
        async with self._leases.hold(session_key):
            moved = await self._sessions.advance_boundary(
                session_key, expected=chunk.start, new=chunk.end, summary=summary
            )
        if moved:
            self._memory.note_new_memory(session_key)
        else:
            log.info("consolidation of %s skipped: the boundary moved since %d", session_key, chunk.start)
        self._memory.clear_snapshot(session_key)
        return moved

    async def summarize(self, messages: tuple[Message, ...]) -> str:
        reply = await complete(
            self._model,
            [Message.system(SUMMARY_INSTRUCTION), Message.user(render_transcript(messages))],
        )
        summary = strip_thinking(reply.text).strip()
        if not summary:
            raise ValueError("the model returned an empty summary")
        return summary
