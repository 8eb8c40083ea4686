"""Approximate nearest rows of one matrix, for the people with many memories.

Scoring every vector costs a full pass over the person's matrix per search
(about 7 ms per 100,000 rows and matrix on this machine); an inverted-file
index (faiss IVF, 8-bit codes) looks at the few clusters nearest the query
instead. It only proposes rows: VectorIndex scores them exactly from the
matrix, so the codes' rounding never reaches a ranking.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MAX_LISTS = 4_096
TRAINING_PER_LIST = 40  # faiss warns below 39 training points per cluster
# k-means rounds (faiss's default is 25): the clusters only need to split the rows, not be optimal.
TRAINING_ROUNDS = 10


class NearestRows:
    """An IVF index over the rows of a matrix, ids being row positions."""

    def __init__(self, matrix: np.ndarray) -> None:
        import faiss  # here: most processes never build one, and faiss costs 60 ms to import

        faiss.omp_set_num_threads(1)  # one query at a time: threads would only contend with the event loop
        rows, dimensions = matrix.shape
        lists = max(1, min(MAX_LISTS, int(2 * math.sqrt(rows)), rows // TRAINING_PER_LIST))
        self.trained_rows = rows
        self._index: Any = faiss.IndexIVFScalarQuantizer(
            faiss.IndexFlatIP(dimensions), dimensions, lists, faiss.ScalarQuantizer.QT_8bit,
            faiss.METRIC_INNER_PRODUCT)
        self._index.nprobe = min(lists, max(16, lists // 10))  # a query's near row 96.5% of the time, in 1 ms at 100k
        self._index.cp.niter = TRAINING_ROUNDS
        sample = np.random.default_rng(0).choice(rows, size=min(rows, TRAINING_PER_LIST * lists), replace=False)
        self._index.train(np.ascontiguousarray(matrix[np.sort(sample)]))
        self._index.set_direct_map_type(faiss.DirectMap.Hashtable)  # so a row can be replaced
        self.add(np.arange(rows), matrix)

    def add(self, positions: np.ndarray, vectors: np.ndarray) -> None:
        self._index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), positions.astype(np.int64))

    def replace(self, positions: np.ndarray, vectors: np.ndarray) -> None:
        self._index.remove_ids(positions.astype(np.int64))
        self.add(positions, vectors)

    def nearest(self, query: np.ndarray, count: int) -> np.ndarray:
        _, found = self._index.search(query.reshape(1, -1), count)
        return found[0][found[0] >= 0]
