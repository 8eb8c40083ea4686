"""Forgetting: a memory's strength halves with time, more slowly each time it is recalled.

strength = 0.5 ** (days since last reinforced / half-life), where the half-life
starts by what the memory is (a fact the person stated lasts longest) and
doubles with every recall (spaced repetition, after Ebbinghaus). Below the
threshold a memory is archived: never injected again, still found with --all.
Archival messages (the history itself) and skills do not fade.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.core.memory import MemoryKind, MemoryRecord, SourceRank

DAY_S = 86_400.0
FADING_KINDS = (MemoryKind.FACT, MemoryKind.EPISODIC)


@dataclass(frozen=True, slots=True)
class ForgettingPolicy:
    stated_fact_half_life_days: float = 365.0
    consolidated_fact_half_life_days: float = 90.0
    inferred_fact_half_life_days: float = 30.0
    episode_half_life_days: float = 60.0
    archive_below: float = 0.1

    def half_life_s(self, record: MemoryRecord, recalls: int | None = None) -> float:
        if record.kind is MemoryKind.EPISODIC:
            days = self.episode_half_life_days
        elif record.source_rank is SourceRank.USER_STATED:
            days = self.stated_fact_half_life_days
        elif record.source_rank is SourceRank.CONSOLIDATED:
            days = self.consolidated_fact_half_life_days
        else:
            days = self.inferred_fact_half_life_days
        count = record.recall_count if recalls is None else recalls
        return days * DAY_S * 2.0 ** min(count, 20)

    def strength(self, record: MemoryRecord, now: float) -> float:
        if record.kind not in FADING_KINDS:
            return 1.0
        anchor = max(record.last_recalled_at or 0.0, record.created_at)
        return 0.5 ** (max(0.0, now - anchor) / self.half_life_s(record))

    def fades_out(self, record: MemoryRecord, now: float) -> bool:
        return record.kind in FADING_KINDS and self.strength(record, now) < self.archive_below
