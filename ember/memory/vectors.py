"""The dense half of recall: each identity's vectors as one matrix in memory.

The matrix is loaded from the store on first use and topped up with the rows
added since (by any process: every search compares the stored count and
highest row number with the cached ones, one indexed query). A purge shrinks
the count and reloads the whole matrix. A vector that cannot be read is
quarantined and its memory queued for a new embedding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ember.store.memories import SqlMemoryStore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Matrix:
    nums: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    vectors: np.ndarray | None = None
    count: int = 0
    highest: int = 0


class VectorIndex:
    def __init__(self, store: SqlMemoryStore, model: str, dimensions: int) -> None:
        self._store = store
        self._model = model
        self._dimensions = dimensions
        self._matrices: dict[str, _Matrix] = {}

    async def nearest(self, identity: str, query: np.ndarray, limit: int) -> list[tuple[int, float]]:
        """(num, cosine similarity) of the identity's closest vectors, best first."""
        matrix = await self._current(identity)
        if matrix.vectors is None or not len(matrix.nums):
            return []
        scores = matrix.vectors @ query.astype(np.float32)
        take = min(limit, len(scores))
        top = np.argpartition(-scores, take - 1)[:take]
        top = top[np.argsort(-scores[top])]
        return [(int(matrix.nums[i]), float(scores[i])) for i in top]

    def forget(self, identity: str | None = None) -> None:
        """Drop cached matrices (all, or one identity's)."""
        if identity is None:
            self._matrices.clear()
        else:
            self._matrices.pop(identity, None)

    async def _current(self, identity: str) -> _Matrix:
        count, highest = await self._store.vector_state(identity, self._model)
        matrix = self._matrices.get(identity)
        if matrix is not None and (matrix.count, matrix.highest) == (count, highest):
            return matrix
        if matrix is None or count < matrix.count or highest < matrix.highest:
            matrix = self._matrices[identity] = _Matrix()
        await self._top_up(identity, matrix)
        return matrix

    async def _top_up(self, identity: str, matrix: _Matrix) -> None:
        rows = await self._store.vectors_after(identity, self._model, matrix.highest)
        nums, vectors = [], []
        for num, blob in rows:
            vector = np.frombuffer(blob, dtype=np.float32) if len(blob) == 4 * self._dimensions else None
            if vector is None or not np.isfinite(vector).all():
                log.warning("memory vector %d is unreadable; it is set aside and its memory re-embedded", num)
                await self._store.quarantine_vector(num)
                continue
            nums.append(num)
            vectors.append(vector)
        if nums:
            added = np.vstack(vectors)
            matrix.vectors = added if matrix.vectors is None else np.vstack([matrix.vectors, added])
            matrix.nums = np.concatenate([matrix.nums, np.asarray(nums, dtype=np.int64)])
        matrix.count = len(matrix.nums)
        matrix.highest = int(matrix.nums[-1]) if len(matrix.nums) else 0
        # Rows added while these were read are picked up next time: the state is re-read then.
