"""Contradictions among facts without a key: found by similarity, judged by the model.

A fact with a subject and key supersedes its predecessor at once (the store
does that). A fact without one may still say the opposite of an older fact
("I moved to Berlin" after "I live in Paris"). After new facts are written, a
background job takes each fact not yet checked, finds the person's active
facts closest to it, and asks the model whether the new one replaces each.
A replacement supersedes the older fact, unless the older one has the better
source: then the new fact is parked as pending. The same fact said in other
words is archived as a duplicate. Nothing here runs at query time.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Literal

from pydantic import BaseModel, ValidationError

from ember.core.memory import MemoryKind, MemoryRecord, MemoryStatus
from ember.core.messages import Message
from ember.core.thinking import strip_thinking
from ember.memory.service import MemoryService
from ember.models.base import ModelClient, complete

log = logging.getLogger(__name__)

# Closer than this in meaning (e5 cosine), or sharing words, makes an older fact a candidate.
CANDIDATE_SIMILARITY = 0.88
CANDIDATES_PER_FACT = 3
BATCH = 20

JUDGE_INSTRUCTION = (
    "You keep a person's long-term memory. Compare the NEW statement with the OLD one about the same person. "
    'Answer with JSON only: {"verdict": "replaces"} if the new one makes the old one no longer true, '
    '{"verdict": "same"} if they say the same thing, {"verdict": "compatible"} if both can be true.'
)


class Verdict(BaseModel):
    verdict: Literal["replaces", "same", "compatible"]


def parse_verdict(reply: str) -> str:
    """The verdict; anything unreadable counts as compatible (nothing is changed on a guess)."""
    text = strip_thinking(reply).strip()
    found = re.search(r"\{.*\}", text, re.DOTALL)
    try:
        return Verdict.model_validate(json.loads(found.group() if found else text)).verdict
    except (ValueError, ValidationError):
        log.warning("fact check: the model's answer was not a verdict: %.80r", text)
        return "compatible"


class FactReconciler:
    def __init__(self, memory: MemoryService, model: ModelClient) -> None:
        self._memory = memory
        self._model = model

    async def reconcile(self) -> int:
        """Check every fact not yet checked; returns how many older facts changed."""
        await self._memory.flush_embeddings()  # candidates are found by meaning too
        changed = 0
        while batch := await self._memory.store.unchecked_facts(BATCH):
            for fact in batch:
                changed += await self._check(fact)
                await self._memory.store.mark_checked(fact.identity, fact.id)
        return changed

    async def _check(self, fact: MemoryRecord) -> int:
        if fact.status is not MemoryStatus.ACTIVE:
            return 0
        hits = await self._memory.search(fact.identity, fact.content, limit=CANDIDATES_PER_FACT + 1,
                                         kinds=(MemoryKind.FACT,))
        older = [hit.record for hit in hits if hit.record.id != fact.id and hit.record.created_at <= fact.created_at
                 and (hit.similarity >= CANDIDATE_SIMILARITY or hit.matched_words)][:CANDIDATES_PER_FACT]
        for old in older:
            verdict = parse_verdict((await complete(self._model, [
                Message.system(JUDGE_INSTRUCTION), Message.user(f"OLD: {old.content}\nNEW: {fact.content}")])).text)
            if verdict == "same":
                await self._memory.store.set_status(fact.identity, fact.id, MemoryStatus.ARCHIVED)
                return 0
            if verdict == "replaces":
                if old.source_rank > fact.source_rank:
                    await self._memory.store.set_status(fact.identity, fact.id, MemoryStatus.PENDING)
                    return 0
                await self._memory.store.supersede_by(fact.identity, old.id, fact.id)
                return 1
        return 0
