"""Fusing the lexical and the dense lists into one ranking, and the rerank seam.

Reciprocal rank fusion: each list adds weight / (K + rank) for every memory it
holds, so neither list's raw scores (BM25 is unbounded, cosine similarities
bunch up) need calibrating. The fused score is then weighed by strength, so
a faded memory ranks below an equally relevant fresh one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ember.core.memory import MemoryRecord, Recalled

RRF_K = 60
LEXICAL_WEIGHT = 1.0
DENSE_WEIGHT = 1.0
# How much strength counts: a memory at strength 0 keeps (1 - STRENGTH_WEIGHT) of its score.
STRENGTH_WEIGHT = 0.2


@dataclass(frozen=True, slots=True)
class Candidates:
    """(num, score) lists, each best first."""

    lexical: Sequence[tuple[int, float]]
    dense: Sequence[tuple[int, float]]


class Reranker(Protocol):
    """Reorders fused hits (a cross-encoder, say); must not add any."""

    def rerank(self, query: str, hits: list[Recalled]) -> list[Recalled]: ...


def fuse(candidates: Candidates, records: Mapping[int, MemoryRecord],
         strength: Callable[[MemoryRecord], float]) -> list[Recalled]:
    """The records of both lists by fused score, best first; nums missing from `records` are left out."""
    scores: dict[int, float] = {}
    for weight, ranked in ((LEXICAL_WEIGHT, candidates.lexical), (DENSE_WEIGHT, candidates.dense)):
        for rank, (num, _) in enumerate(ranked):
            if num in records:
                scores[num] = scores.get(num, 0.0) + weight / (RRF_K + rank + 1)
    hits = [
        Recalled(records[num], score * (1.0 - STRENGTH_WEIGHT + STRENGTH_WEIGHT * strength(records[num])))
        for num, score in scores.items()
    ]
    hits.sort(key=lambda hit: (-hit.score, -hit.record.created_at))
    return hits
