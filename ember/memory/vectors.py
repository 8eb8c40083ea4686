"""The dense half of recall: each identity's vectors as matrices in memory.

Two matrices per identity, row for row: each memory's own vector, and its
window vector (an archived message read between its neighbours; for other
memories, the memory's own vector again). They are loaded from the store on
first use and topped up with the rows written since, by any process: every
search compares the stored count and highest revision with the cached ones
(one indexed query). A row written again (a message whose window grew) is
replaced in place; a purge shrinks the count and reloads everything. A vector
that cannot be read is quarantined and its memory queued for a new embedding.

Below `ann_min_rows` vectors a search scores them all. From there on, an
approximate index per matrix (memory/ann.py), built in the background while
the full scan goes on, proposes the rows near the query; those, the rows the
text index found and a fixed sample are scored exactly. The sample keeps the
lowest similarity, by which fusion scales the others, close to the true one.
The index is trained again in the background when the rows have doubled.

Where the database scores vectors itself (PostgreSQL with pgvector),
DatabaseVectors has it score each of a person's vectors, as the full scan
above would, and the process holds none: a cluster's gateway and workers stay
the same size however much their people remember. A person with
`ann_min_rows` or more is served by a VectorIndex as here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ember.memory.ann import NearestRows
from ember.store.protocols import VectorRows

log = logging.getLogger(__name__)

ANN_CANDIDATES = 100  # rows proposed per matrix
SAMPLE_ROWS = 1_024
MIN_ROOM = 256  # rows a matrix first has room for
THREAD_ROWS = 512  # rows from which a top-up is decoded on a thread (a turn's adds a few)
PAST_EVERY_REV = 2**31 - 1  # a revision no vector has yet: asked for the rows after it, the store sends none


@dataclass(frozen=True, slots=True)
class DenseScores:
    """Cosine similarities of every vector of one identity to a query, row for row."""

    nums: np.ndarray
    own: np.ndarray
    window: np.ndarray
    rows: dict[int, int]  # num -> position in the arrays


@dataclass(frozen=True, slots=True)
class _Rows:
    """Vectors read from the store, decoded: row i of `own` and `window` is memory `nums[i]`'s."""

    nums: list[int]
    own: np.ndarray
    window: np.ndarray
    unreadable: list[int]
    rev: int  # the highest revision read, the unreadable rows' included


class DenseIndex(Protocol):
    """The dense half of recall for one embedding model: each identity's vectors scored against a query."""

    async def scores(self, identity: str, query: np.ndarray, also: Collection[int] = ()) -> DenseScores | None:
        """The identity's vectors near `query` and those of the memories `also` names, scored
        against it (every vector, below `ann_min_rows`); None when it has none yet."""
        ...

    async def prepare(self, identity: str) -> None:
        """Build what the identity's searches need now, rather than in the background."""
        ...

    async def close(self) -> None: ...


async def _set_aside(store: VectorRows, unreadable: Sequence[int]) -> None:
    for num in unreadable:
        log.warning("memory vector %d is unreadable; it is set aside and its memory re-embedded", num)
        await store.quarantine_vector(num)


@dataclass(slots=True)
class _Matrix:
    rows: dict[int, int] = field(default_factory=dict)  # num -> row
    nums: list[int] = field(default_factory=list)
    num_array: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # nums, made once per top-up
    # Room for more rows than `nums` has: rows past them are spare (_appended).
    own_rows: np.ndarray | None = None
    window_rows: np.ndarray | None = None
    count: int = 0
    rev: int = 0
    near_own: NearestRows | None = None
    near_window: NearestRows | None = None
    building: asyncio.Task[None] | None = None
    rewritten: set[int] = field(default_factory=set)  # rows written again while an index was built

    @property
    def own(self) -> np.ndarray | None:
        return None if self.own_rows is None else self.own_rows[:len(self.nums)]

    @property
    def window(self) -> np.ndarray | None:
        return None if self.window_rows is None else self.window_rows[:len(self.nums)]


class VectorIndex:
    """Each identity's vectors as matrices in this process (the module's docstring)."""

    def __init__(self, store: VectorRows, model: str, dimensions: int | None, *,
                 ann_min_rows: int) -> None:
        """`dimensions` None: those of the first vector read (a provider's model says them with its first)."""
        self._store = store
        self._model = model
        self._dimensions = dimensions
        self._ann_min_rows = ann_min_rows
        self._matrices: dict[str, _Matrix] = {}

    async def scores(self, identity: str, query: np.ndarray, also: Collection[int] = ()) -> DenseScores | None:
        matrix = await self._current(identity)
        if matrix.own is None or matrix.window is None or not matrix.nums or query.shape[0] != matrix.own.shape[1]:
            return None
        q = query.astype(np.float32)
        self._build_when_due(identity, matrix)
        if matrix.near_own is None or matrix.near_window is None:
            return DenseScores(matrix.num_array, matrix.own @ q, matrix.window @ q, matrix.rows)
        step = max(1, matrix.count // SAMPLE_ROWS)
        positions = np.unique(np.concatenate([
            matrix.near_own.nearest(q, ANN_CANDIDATES), matrix.near_window.nearest(q, ANN_CANDIDATES),
            np.fromiter((row for num in also if (row := matrix.rows.get(num)) is not None), dtype=np.int64),
            np.arange(0, matrix.count, step)]))
        nums = matrix.num_array[positions]
        return DenseScores(nums, matrix.own[positions] @ q, matrix.window[positions] @ q,
                           {int(num): i for i, num in enumerate(nums)})

    async def prepare(self, identity: str) -> None:
        matrix = await self._current(identity)
        self._build_when_due(identity, matrix)
        if matrix.building is not None:
            await asyncio.shield(matrix.building)

    def _build_when_due(self, identity: str, matrix: _Matrix) -> None:
        if matrix.building is None and matrix.count >= self._ann_min_rows and (
                matrix.near_own is None or matrix.count >= 2 * matrix.near_own.trained_rows):
            matrix.building = asyncio.create_task(self._build_nearest(identity, matrix))

    async def close(self) -> None:
        tasks = [matrix.building for matrix in self._matrices.values() if matrix.building is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _build_nearest(self, identity: str, matrix: _Matrix) -> None:
        try:
            assert matrix.own is not None and matrix.window is not None
            size, own, window = matrix.count, matrix.own, matrix.window
            matrix.rewritten = set()
            near_own, near_window = await asyncio.gather(asyncio.to_thread(NearestRows, own[:size]),
                                                         asyncio.to_thread(NearestRows, window[:size]))
            if self._matrices.get(identity) is not matrix:
                return  # reloaded meanwhile: the next search builds for the new one
            # Rows added or written again while the index was trained.
            changed = np.asarray(sorted(row for row in matrix.rewritten if row < size), dtype=np.int64)
            added = np.arange(size, matrix.count)
            for near, vectors in ((near_own, matrix.own), (near_window, matrix.window)):
                if changed.size:
                    near.replace(changed, vectors[changed])
                if added.size:
                    near.add(added, vectors[added])
            matrix.near_own, matrix.near_window = near_own, near_window
            log.info("memory of %s: nearest-vector index ready over %d rows", identity, matrix.count)
        except Exception:
            log.exception("memory of %s: the nearest-vector index could not be built; every vector is scored",
                          identity)
        finally:
            matrix.building = None

    async def _current(self, identity: str) -> _Matrix:
        """The identity's matrix, caught up with the store: its state and what is new come in one read."""
        matrix = self._matrices.get(identity)
        after = matrix.rev if matrix is not None else 0
        (count, rev), written = await self._store.vectors_since(identity, self._model, after)
        if matrix is not None and (matrix.count, matrix.rev) == (count, rev):
            return matrix
        if matrix is None or count < matrix.count or rev < matrix.rev:
            if after:  # what was read is what came after a stale matrix: a new one needs every row
                written = (await self._store.vectors_since(identity, self._model, 0))[1]
            matrix = self._matrices[identity] = _Matrix()
        await self._top_up(matrix, written)
        if matrix.count != count:  # rows were deleted as others were added: the matrix holds stale ones
            matrix = self._matrices[identity] = _Matrix()
            await self._top_up(matrix, (await self._store.vectors_since(identity, self._model, 0))[1])
        return matrix

    async def _top_up(self, matrix: _Matrix, written: Sequence[tuple[int, int, bytes, bytes | None]]) -> None:
        # A whole matrix (a search after a restart) takes a tenth of a second to decode: off the event loop.
        rows = (await asyncio.to_thread(self._decoded, written) if len(written) >= THREAD_ROWS
                else self._decoded(written))
        matrix.rev = max(matrix.rev, rows.rev)
        await _set_aside(self._store, rows.unreadable)
        added: list[int] = []  # positions in `rows` of memories new to the matrix
        for i, num in enumerate(rows.nums):
            row = matrix.rows.get(num)
            if row is None:
                matrix.rows[num] = len(matrix.nums) + len(added)
                added.append(i)
                continue
            assert matrix.own is not None and matrix.window is not None
            matrix.own[row], matrix.window[row] = rows.own[i], rows.window[i]
            if matrix.building is not None:
                matrix.rewritten.add(row)
            for near, vectors in ((matrix.near_own, rows.own), (matrix.near_window, rows.window)):
                if near is not None:
                    near.replace(np.array([row]), vectors[i:i + 1])
        if added:
            used = len(matrix.nums)
            every = len(added) == len(rows.nums)  # a matrix's first load: no copy of what it adds
            own, window = (rows.own, rows.window) if every else (rows.own[added], rows.window[added])
            matrix.own_rows = _appended(matrix.own_rows, used, own)
            matrix.window_rows = _appended(matrix.window_rows, used, window)
            positions = np.arange(used, used + len(added))
            for near, vectors in ((matrix.near_own, own), (matrix.near_window, window)):
                if near is not None:
                    near.add(positions, vectors)
            matrix.nums += [rows.nums[i] for i in added]
            matrix.num_array = np.asarray(matrix.nums, dtype=np.int64)
        matrix.count = len(matrix.nums)

    def _decoded(self, written: Sequence[tuple[int, int, bytes, bytes | None]]) -> _Rows:
        """The rows' vectors as two matrices (a window missing: the memory's own vector), and the
        memories whose vectors cannot be read (the wrong size, or not finite)."""
        if self._dimensions is None:
            self._dimensions = next((len(blob) // 4 for _, _, blob, _ in written if blob and len(blob) % 4 == 0), None)
        width = 4 * (self._dimensions or 0)
        sized = [row for row in written if width and len(row[2]) == width and (row[3] is None or len(row[3]) == width)]
        shape = (len(sized), width // 4)
        own = np.frombuffer(b"".join(row[2] for row in sized), dtype=np.float32).reshape(shape)
        window = np.frombuffer(b"".join(row[2] if row[3] is None else row[3] for row in sized),
                               dtype=np.float32).reshape(shape)
        finite = np.isfinite(own).all(axis=1) & np.isfinite(window).all(axis=1)
        readable = {row[0] for row, ok in zip(sized, finite, strict=True) if ok}
        return _Rows(nums=[row[0] for row in sized if row[0] in readable], own=own[finite], window=window[finite],
                     unreadable=[num for num, _, _, _ in written if num not in readable],
                     rev=max((rev for _, rev, _, _ in written), default=0))


class DatabaseVectors:
    """Vectors the database scores (store.scores_vectors), nothing of them kept in the process, for
    each person with fewer than `ann_min_rows`. From there on a scan of every vector costs more than
    the process's nearest-vector index, which then serves them, as VectorIndex does on SQLite."""

    def __init__(self, store: VectorRows, model: str, dimensions: int | None, *, ann_min_rows: int) -> None:
        self._store = store
        self._model = model
        self._ann_min_rows = ann_min_rows
        self._many = VectorIndex(store, model, dimensions, ann_min_rows=ann_min_rows)

    async def scores(self, identity: str, query: np.ndarray, also: Collection[int] = ()) -> DenseScores | None:
        scored = await self._store.vector_scores(identity, self._model, query.astype(np.float32).tolist(),
                                                 most=self._ann_min_rows)
        if scored is None:
            return await self._many.scores(identity, query, also)
        nums, own, window, unreadable = scored
        await _set_aside(self._store, unreadable)
        if not nums:
            return None
        return DenseScores(np.asarray(nums, dtype=np.int64), np.asarray(own, dtype=np.float32),
                           np.asarray(window, dtype=np.float32), dict(zip(nums, range(len(nums)), strict=True)))

    async def prepare(self, identity: str) -> None:
        (count, _), _ = await self._store.vectors_since(identity, self._model, PAST_EVERY_REV)  # the count alone
        if count >= self._ann_min_rows:
            await self._many.prepare(identity)

    async def close(self) -> None:
        await self._many.close()


def _appended(buffer: np.ndarray | None, used: int, added: np.ndarray) -> np.ndarray:
    """`added` written after the first `used` rows of `buffer`, which grows by doubling: a top-up (a
    search after a turn added its messages) copies what it adds, not every row before it. Spare rows
    cost no memory until written (the allocator leaves their pages untouched)."""
    end = used + len(added)
    if buffer is None or end > buffer.shape[0]:
        grown = np.empty((max(2 * end, MIN_ROOM), added.shape[1]), dtype=np.float32)
        if buffer is not None:
            grown[:used] = buffer[:used]
        buffer = grown
    buffer[used:end] = added
    return buffer
