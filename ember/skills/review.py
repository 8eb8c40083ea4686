"""Skill review: after a tool-heavy turn, the background model reads what was
done (the request, the tool calls and their results, the answer) and may
propose a new skill or a better version of an existing one.

The proposal goes through the admission gate: refused with its reason, admitted
at once (only where the policy lets low-risk proposals in), or left pending for
a person. The session's review mark moves on only with a review that ended,
so the turns of a failed review are read again by the next one.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ember.core.leases import SessionLeases
from ember.core.messages import Message, Role
from ember.core.redact import redact_text
from ember.core.skills import Proposal, ProposalStatus, SkillRisk, new_proposal_id
from ember.core.thinking import strip_thinking
from ember.memory.protocols import ReviewedMemory
from ember.memory.transcript import render_transcript
from ember.models.base import ModelClient, ModelReply, complete
from ember.skills.format import MAX_DESCRIPTION_CHARS, SkillFormatError, parse_skill_md, render_skill_md
from ember.skills.gate import MAX_PROPOSAL_CHARS, assess, check_secrets, check_size, near_duplicate
from ember.skills.library import SkillLibrary
from ember.store.protocols import SessionStore

REVIEW_INSTRUCTION = """Below is work you just did for a user: their request, the tools you called with \
their results, and your answer. Decide whether it teaches a reusable procedure worth keeping as a skill: \
steps that would help with similar requests later, not facts about this user.

Answer with one JSON object and nothing else:
- {"action": "none"} if there is nothing reusable (the usual case), or if an existing skill already covers it;
- {"action": "create", "name": "lowercase-with-hyphens", "description": "what it does and when to use it", \
"body": "Markdown instructions: when to use it, the steps, the pitfalls", "reason": "why"} for a new skill;
- {"action": "patch", "name": "<an existing skill's name>", "description": "...", "body": "the whole improved \
instructions", "reason": "what it improves"} to improve an existing skill.
Never put credentials, personal data or one-off details in a skill."""

TRAJECTORY_CHARS = 12_000  # the latest part of the reviewed turns the model reads
EXISTING_CHARS = 3_000


class ReviewAnswer(BaseModel):
    """What the review model answers; `skill_md` may replace name/description/body with a whole SKILL.md."""

    model_config = ConfigDict(extra="ignore")

    action: Literal["none", "create", "patch"]
    name: str | None = None
    description: str | None = None
    body: str | None = None
    skill_md: str | None = None
    reason: str = ""


class ReviewFormatError(ValueError):
    """The model's answer is not the structure asked for: the review fails and is retried."""


def parse_answer(text: str) -> ReviewAnswer:
    text = strip_thinking(text).strip()
    if text.strip(" .!`'\"").lower() in ("none", "nothing"):  # what models say when told there may be nothing
        return ReviewAnswer(action="none")
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    candidate = fenced[1] if fenced else text[text.find("{"):text.rfind("}") + 1]
    try:
        return ReviewAnswer.model_validate(json.loads(candidate))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ReviewFormatError(f"the skill review's answer is not the JSON asked for: {str(exc)[:200]}") from None


class SkillReviewer:
    def __init__(self, sessions: SessionStore, leases: SessionLeases, model: ModelClient, memory: ReviewedMemory,
                 library: SkillLibrary, cost: Callable[[ModelReply], float | None] = lambda reply: None) -> None:
        self._sessions = sessions
        self._leases = leases
        self._model = model
        self._memory = memory
        self._library = library
        self._cost = cost

    async def review(self, session_key: str, job_id: str | None = None) -> Proposal | None:
        """Review the session's turns since its last review; the proposal made, if any."""
        async with self._leases.hold(session_key):  # a load may write a repair, which must not race a turn
            session = await self._sessions.load(session_key)
        store = self._library.store
        mark = await store.review_mark(session_key)
        turns = [m for m in session.messages if m.seq is None or m.seq >= mark]
        users = [m for m in turns if m.role is Role.USER]
        if session.metadata.get("evaluation") or not users or not any(m.has_tool_calls for m in turns):
            await store.finish_review(session_key, session.next_seq, None)
            return None
        identity = await self._memory.turn_owner(session, users[-1].turn_id)
        visible = await store.visible(identity)
        existing = "\n".join(f"- {s.name}: {s.description[:200]}" for s in visible)[:EXISTING_CHARS] or "(none yet)"
        transcript = render_transcript(turns, max_chars_per_message=1_500)[-TRAJECTORY_CHARS:]
        reply = await complete(self._model, [
            Message.system(REVIEW_INSTRUCTION),
            Message.user(f"Existing skills:\n{existing}\n\nThe work:\n{transcript}")])
        answer = parse_answer(reply.text)
        if answer.action == "none":
            await store.finish_review(session_key, session.next_seq, None)
            return None
        proposal = Proposal(
            id=new_proposal_id(), identity=identity, name=(answer.name or "")[:80], action=answer.action, text="",
            risk=SkillRisk.LOW, risk_reasons=(), status=ProposalStatus.PENDING, reason=answer.reason[:1_000],
            created_at=time.time(), session_key=session_key, turn_id=users[-1].turn_id, job_id=job_id,
            input_tokens=reply.input_tokens, output_tokens=reply.output_tokens, cost_usd=self._cost(reply))
        proposal = await self._gate(proposal, answer, identity)
        admit = None
        if proposal.status is ProposalStatus.PENDING and self._library.auto_admits(proposal.risk):
            admit = await self._library.admission(proposal, "policy")
        return await store.finish_review(session_key, session.next_seq, proposal, admit)

    async def _gate(self, proposal: Proposal, answer: ReviewAnswer, identity: str) -> Proposal:
        """The proposal as the gate leaves it: refused with the reason, or classed and pointed at the skill
        it changes (a near-copy of another skill becomes a new version of that one)."""
        try:
            text = answer.skill_md or render_skill_md(
                proposal.name, (answer.description or "")[:MAX_DESCRIPTION_CHARS + 1], answer.body or "")
        except SkillFormatError as exc:
            return _refused(proposal, answer.skill_md or answer.body or "", str(exc))
        try:
            check_size(text)
            check_secrets(text)
            doc = parse_skill_md(text)
        except SkillFormatError as exc:
            return _refused(proposal, text, str(exc))
        store = self._library.store
        current = await store.get(identity, doc.name)
        reason = proposal.reason
        if current is None:
            texts = [(skill.name, (await store.version(skill)).text)  # type: ignore[union-attr]
                     for skill in await store.visible(identity)]
            duplicate = near_duplicate(doc, texts)
            if duplicate is not None:
                name, score = duplicate
                text = text.replace(f"name: {doc.name}\n", f"name: {name}\n", 1)
                doc = parse_skill_md(text)
                current = await store.get(identity, name)
                reason = (f"{reason} (proposed as {proposal.name!r}, which is {score:.0%} like the existing {name!r}: "
                          "merged into it as a new version instead of a second skill)").strip()
        assessment = assess(doc)
        return replace(proposal, name=doc.name, text=text, reason=reason,
                       action="patch" if current is not None else "create",
                       base_version=current.version if current is not None else None,
                       risk=assessment.risk, risk_reasons=assessment.reasons)


def _refused(proposal: Proposal, text: str, why: str) -> Proposal:
    # What is kept of a refused proposal is redacted and bounded: it may be the secret itself.
    return replace(proposal, text=redact_text(text)[:MAX_PROPOSAL_CHARS], status=ProposalStatus.REFUSED,
                   reason=f"refused: {why}", decided_by="gate", decided_at=time.time())
