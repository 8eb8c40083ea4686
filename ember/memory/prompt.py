"""What of a search's hits a prompt carries, and how it reads: the best first, within a budget
of tokens, shown by day.

LoCoMo through the gateway (bench/memory_prompt.py) chose the shape: as many lines as fit
beat fewer lines each with the one before it (0.850 against 0.831 of questions with their
evidence in the prompt, both at 1,000 tokens), and nods ("ok", "noted.") are left out. Each
day's date is written once, above its lines in the order they were said: a date on every line
cost 6 of e5's tokens a line, a fifth of a typical chat line.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from ember.core.language import estimated_tokens
from ember.core.memory import ROLE_SUBJECTS, MemoryKind, MemoryRecord, Recalled, normalized, says_something

# A memory the text index did not find is put in a prompt only this much above the relevance floor.
PROMPT_SIMILARITY_MARGIN = 0.04
# Hits searched for beyond what a prompt may carry: some are in the profile, the window or said twice.
PROMPT_SPARE_HITS = 8
# What a day's heading costs: "[2026-12-07]" and its line.
DAY_TOKENS = 8


@dataclass(frozen=True, slots=True)
class PromptMemory:
    """What a turn's prompt carries: stable profile facts, the session's latest summaries (oldest
    first), then what the message recalled."""

    profile: tuple[MemoryRecord, ...] = ()
    recalled: tuple[MemoryRecord, ...] = ()
    episodes: tuple[MemoryRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class RecallBudget:
    profile_facts: int = 30
    recalled_tokens: int = 1000
    recalled_max: int = 28

    @property
    def search_limit(self) -> int:
        return self.recalled_max + PROMPT_SPARE_HITS


def chosen(hits: Sequence[Recalled], budget: RecallBudget, floor: float, shown: Collection[str],
           exclude: Callable[[MemoryRecord], bool]) -> tuple[list[MemoryRecord], list[str]]:
    """The hits the prompt carries, best first, and the ids of every memory it recalled (those
    `shown` in the profile too): each line once, until the next would not fit."""
    recalled: list[MemoryRecord] = []
    used_ids: list[str] = []
    used, said, days = 0, set(), set()
    for hit in hits:
        record = hit.record
        if not hit.matched_words and hit.similarity < floor + PROMPT_SIMILARITY_MARGIN:
            continue
        if record.id in shown:
            used_ids.append(record.id)
            continue
        line = normalized(record.content)
        if exclude(record) or line in said or _is_nod(record):
            continue
        day = _day_of(record)
        cost = estimated_tokens(_shown(record)) + (0 if day in days else DAY_TOKENS)
        if used + cost > budget.recalled_tokens or len(recalled) >= budget.recalled_max:
            break
        recalled.append(record)
        used_ids.append(record.id)
        said.add(line)
        days.add(day)
        used += cost
    return recalled, used_ids


def recalled_text(records: Iterable[MemoryRecord]) -> str:
    """The recalled memories as the prompt shows them: by day, oldest first, each day's date once."""
    lines: list[str] = []
    for record in sorted(records, key=lambda r: (r.created_at, r.seq_start or 0)):
        heading = f"[{_day_of(record)}]"
        if heading not in lines:
            lines.append(heading)
        lines.append(_shown(record))
    return "\n".join(lines)


def _day_of(record: MemoryRecord) -> str:
    return dt.datetime.fromtimestamp(record.created_at, dt.UTC).strftime("%Y-%m-%d")


def _shown(record: MemoryRecord) -> str:
    # An archived message of a named author already starts with the name.
    said = f"{record.subject} said: " if record.kind is MemoryKind.ARCHIVAL and record.subject in ROLE_SUBJECTS else ""
    return f"- {said}{record.content}"


def _is_nod(record: MemoryRecord) -> bool:
    """A chat line that says next to nothing ("ok"), without the "Caroline: " its named author's
    lines begin with. A fact is kept however short."""
    if record.kind is not MemoryKind.ARCHIVAL:
        return False
    said = record.content if record.subject in ROLE_SUBJECTS else record.content.split(": ", 1)[-1]
    return not says_something(said)
