"""Folding old messages of a session into an episodic summary (I5).

The worker never writes a stale session: it reloads under the session lease,
asks the model outside the lease, and advances `last_consolidated` forward
only, by compare-and-set, never into the middle of a tool-call chain.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, Field, ValidationError

from ember.core.leases import SessionLeases
from ember.core.memory import MAX_CONTENT_CHARS, NewMemory, SourceRank, shared_identity
from ember.core.messages import Message, Role, Session
from ember.core.thinking import strip_thinking
from ember.memory.transcript import render_transcript
from ember.models.base import ModelClient, complete
from ember.store.protocols import SessionStore

log = logging.getLogger(__name__)

SUMMARY_INSTRUCTION = (
    "Summarise the conversation excerpt below for your own future reference. Keep facts, decisions, names, "
    "numbers and open tasks; drop small talk. Also list the durable facts about the user it states (not "
    "guesses, not what tools printed). Answer with JSON only, in this form:\n"
    '{"summary": "...", "facts": [{"subject": "user", "key": "home_city", "content": "The user lives in Lyon."}]}\n'
    "`key` names the attribute so a later fact about it replaces this one; facts may be an empty list."
)


class ExtractedFact(BaseModel):
    subject: str | None = Field(default=None, max_length=200)
    key: str | None = Field(default=None, max_length=200)
    content: str = Field(min_length=1, max_length=MAX_CONTENT_CHARS)


@dataclass(frozen=True, slots=True)
class Consolidated:
    summary: str
    facts: tuple[ExtractedFact, ...] = ()


MAX_FACTS = 50


def parse_consolidation(reply: str) -> Consolidated:
    """The model's JSON answer, each fact validated on its own (a bad one is
    dropped, not the summary); a model that answers in prose gives a summary
    without facts."""
    text = strip_thinking(reply).strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    candidate = fenced.group(1) if fenced else text
    try:
        data = json.loads(candidate) if candidate.startswith("{") else None
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("summary"), str) and data["summary"].strip():
        facts = []
        for item in data.get("facts") or []:
            try:
                facts.append(ExtractedFact.model_validate(item))
            except ValidationError as exc:
                log.warning("consolidation: a fact was left out: %s", exc.errors()[0]["msg"])
        return Consolidated(data["summary"].strip(), tuple(facts[:MAX_FACTS]))
    if not text:
        raise ValueError("the model returned an empty summary")
    return Consolidated(text)


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


class SessionOwners(Protocol):
    async def owner(self, session: Session) -> str:
        """The identity whose memory the session's summary joins."""
        ...


class ConsolidationWorker:
    def __init__(self, sessions: SessionStore, leases: SessionLeases, model: ModelClient, owners: SessionOwners, *,
                 keep_recent: int) -> None:
        self._sessions = sessions
        self._leases = leases
        self._model = model
        self._owners = owners
        self._keep_recent = keep_recent

    async def consolidate(self, session_key: str) -> bool:
        """True when the boundary moved; False when there was nothing to do or a
        concurrent consolidation got there first."""
        async with self._leases.hold(session_key):
            session = await self._sessions.load(session_key)
        chunk = plan_chunk(session, self._keep_recent)
        if chunk is None:
            return False
        done = await self.summarize(chunk.messages)
        identity = await self._owners.owner(session)
        # A group's conversation yields its summary only: a fact in it may be anyone's.
        shared = identity == shared_identity(session.key)
        facts = [] if session.metadata.get("evaluation") or shared else [
            NewMemory(identity=identity, content=fact.content, subject=fact.subject, key=fact.key,
                      source=f"consolidation of session {session_key}, messages {chunk.start}–{chunk.end - 1}",
                      source_rank=SourceRank.CONSOLIDATED, session_key=session_key,
                      seq_start=chunk.start, seq_end=chunk.end)
            for fact in done.facts]
        async with self._leases.hold(session_key):
            moved = await self._sessions.advance_boundary(
                session_key, expected=chunk.start, new=chunk.end, summary=done.summary, facts=facts,
                identity=identity)
        if not moved:
            log.info("consolidation of %s skipped: the boundary moved since %d", session_key, chunk.start)
        return moved

    async def summarize(self, messages: tuple[Message, ...]) -> Consolidated:
        reply = await complete(
            self._model,
            [Message.system(SUMMARY_INSTRUCTION), Message.user(render_transcript(messages))],
        )
        return parse_consolidation(reply.text)
