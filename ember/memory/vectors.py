"""The dense half of recall: each identity's vectors as matrices in memory.

Two matrices per identity, row for row: each memory's own vector, and its
window vector (an archived message read between its neighbours; for other
memories, the memory's own vector again). They are loaded from the store on
first use and topped up with the rows written since, by any process: every
search compares the stored count and highest revision with the cached ones
(one indexed query). A row written again (a message whose window grew) is
replaced in place; a purge shrinks the count and reloads everything. A vector
that cannot be read is quarantined and its memory queued for a new embedding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ember.store.memories import SqlMemoryStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DenseScores:
    """Cosine similarities of every vector of one identity to a query, row for row."""

    nums: np.ndarray
    own: np.ndarray
    window: np.ndarray
    rows: dict[int, int]  # num -> position in the arrays


@dataclass(slots=True)
class _Matrix:
    rows: dict[int, int] = field(default_factory=dict)  # num -> row
    nums: list[int] = field(default_factory=list)
    num_array: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # nums, made once per top-up
    own: np.ndarray | None = None
    window: np.ndarray | None = None
    count: int = 0
    rev: int = 0


class VectorIndex:
    def __init__(self, store: SqlMemoryStore, model: str, dimensions: int) -> None:
        self._store = store
        self._model = model
        self._dimensions = dimensions
        self._matrices: dict[str, _Matrix] = {}

    async def scores(self, identity: str, query: np.ndarray) -> DenseScores | None:
        """Every stored vector of the identity scored against `query`; None when it has none yet."""
        matrix = await self._current(identity)
        if matrix.own is None or matrix.window is None or not matrix.nums:
            return None
        q = query.astype(np.float32)
        return DenseScores(matrix.num_array, matrix.own @ q, matrix.window @ q, matrix.rows)

    async def _current(self, identity: str) -> _Matrix:
        count, rev = await self._store.vector_state(identity, self._model)
        matrix = self._matrices.get(identity)
        if matrix is not None and (matrix.count, matrix.rev) == (count, rev):
            return matrix
        if matrix is None or count < matrix.count or rev < matrix.rev:
            matrix = self._matrices[identity] = _Matrix()
        await self._top_up(identity, matrix)
        if matrix.count != count:  # rows were deleted as others were added: the matrix holds stale ones
            matrix = self._matrices[identity] = _Matrix()
            await self._top_up(identity, matrix)
        return matrix

    async def _top_up(self, identity: str, matrix: _Matrix) -> None:
        own_rows, window_rows, nums = [], [], []
        for num, rev, blob, window_blob in await self._store.vectors_after(identity, self._model, matrix.rev):
            matrix.rev = max(matrix.rev, rev)
            own = self._read(blob)
            window = self._read(window_blob) if window_blob is not None else own
            if own is None or window is None:
                log.warning("memory vector %d is unreadable; it is set aside and its memory re-embedded", num)
                await self._store.quarantine_vector(num)
                continue
            row = matrix.rows.get(num)
            if row is not None:
                assert matrix.own is not None and matrix.window is not None
                matrix.own[row], matrix.window[row] = own, window
                continue
            matrix.rows[num] = len(matrix.nums) + len(nums)
            nums.append(num)
            own_rows.append(own)
            window_rows.append(window)
        if nums:
            matrix.own = _stacked(matrix.own, own_rows)
            matrix.window = _stacked(matrix.window, window_rows)
            matrix.nums += nums
            matrix.num_array = np.asarray(matrix.nums, dtype=np.int64)
        matrix.count = len(matrix.nums)

    def _read(self, blob: bytes) -> np.ndarray | None:
        if len(blob) != 4 * self._dimensions:
            return None
        vector = np.frombuffer(blob, dtype=np.float32)
        return vector if np.isfinite(vector).all() else None


def _stacked(existing: np.ndarray | None, rows: list[np.ndarray]) -> np.ndarray:
    added = np.vstack(rows)
    return added if existing is None else np.vstack([existing, added])
