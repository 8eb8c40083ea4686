"""Fusing the lexical and the dense scores into one ranking, and the rerank seam.

For each memory of the person:

    score = lexical / best lexical + 0.5 * mm(own similarity) + 1.0 * mm(window similarity)

where `mm` scales a similarity between the lowest and highest of that
person's memories (e5 similarities bunch up between 0.75 and 0.95, so raw
values say little), `own` is the memory's vector and `window` the vector of
the memory read between its neighbours (an archived message in its
conversation). Score fusion beat reciprocal rank fusion on LoCoMo by 0.05 of
turn R@10 (bench/memory_locomo.py). The fused score is then weighed by
strength, so a faded memory ranks below an equally relevant fresh one.

A query that names one person ("what did Caroline paint?") raises the
memories whose subject is that person: the facts about them and, in a group
chat, what they said. Their name is one word among many to BM25; the bonus
took turn R@10 on LoCoMo from 0.850 to 0.871 offline.

At equal relevance a fact (stated, remembered or consolidated) ranks above an
archived chat line: it is what the line meant, without the chat around it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ember.core.memory import ROLE_SUBJECTS, Recalled
from ember.memory.vectors import DenseScores

LEXICAL_WEIGHT = 1.0
OWN_WEIGHT = 0.5
WINDOW_WEIGHT = 1.0
# How much strength counts: a memory at strength 0 keeps (1 - STRENGTH_WEIGHT) of its score.
STRENGTH_WEIGHT = 0.2
# Added to the fused score of a memory whose subject the query names.
NAMED_SUBJECT_BONUS = 0.4
# Added to a fact's: what was kept as a fact outranks the chat line it came from, or one like it.
FACT_BONUS = 0.1
_WORD = re.compile(r"[^\W_]+")


@dataclass(frozen=True, slots=True)
class Candidate:
    num: int
    score: float
    matched_words: bool  # the text index found it
    similarity: float  # the better of its two cosine similarities to the query; 0 without vectors


class Reranker(Protocol):
    """Reorders fused hits (a cross-encoder, say); must not add any."""

    def rerank(self, query: str, hits: list[Recalled]) -> list[Recalled]: ...


def _scaled(values: np.ndarray) -> np.ndarray:
    low, high = float(values.min()), float(values.max())
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


def fuse(lexical: Sequence[tuple[int, float]], dense: DenseScores | None, depth: int) -> list[Candidate]:
    """The `depth` best memories by fused score, best first."""
    best_lexical = max((score for _, score in lexical), default=0.0)
    lexical_part = {num: LEXICAL_WEIGHT * score / best_lexical for num, score in lexical} if best_lexical > 0 else {
        num: LEXICAL_WEIGHT for num, _ in lexical}
    if dense is None:
        ranked = sorted(lexical_part.items(), key=lambda item: -item[1])[:depth]
        return [Candidate(num, score, True, 0.0) for num, score in ranked]
    fused = OWN_WEIGHT * _scaled(dense.own) + WINDOW_WEIGHT * _scaled(dense.window)
    without_vector = []
    for num, part in lexical_part.items():
        row = dense.rows.get(num)
        if row is None:
            without_vector.append((num, part))  # its embedding is still pending
        else:
            fused[row] += part
    take = min(depth, len(fused))
    top = np.argpartition(-fused, take - 1)[:take] if take else np.zeros(0, dtype=np.int64)
    similarity = np.maximum(dense.own, dense.window)
    candidates = [Candidate(int(dense.nums[i]), float(fused[i]), int(dense.nums[i]) in lexical_part,
                            float(similarity[i])) for i in top]
    candidates += [Candidate(num, part, True, 0.0) for num, part in without_vector]
    candidates.sort(key=lambda c: -c.score)
    return candidates[:depth]


def named_subject(query: str, subjects: Iterable[str | None]) -> str | None:
    """The one subject among `subjects` that the query names, if exactly one is named.

    Subjects are normalised keys ("mary-ann_smith"); every word of one must be a word of the query.
    """
    words = set(_WORD.findall(query.casefold()))
    named = {subject for subject in subjects if subject and subject not in ROLE_SUBJECTS
             and (parts := _WORD.findall(subject)) and words.issuperset(parts)}
    return named.pop() if len(named) == 1 else None
