"""How memory turns texts into vectors, at a bounded cost that never delays a turn.

- A turn's query is embedded on a thread of its own (and, for e5, by an engine
  of its own), so it never waits behind the background's passages. A query is
  bounded to its first and last characters: a pasted megabyte is still a question.
- Passages are embedded on one thread at the lowest scheduling priority, in the
  batches the caller hands over, each text bounded to its head: a turn
  running meanwhile takes the cores first, and one long message costs a
  bounded amount however long it is.
- Each distinct text is embedded once: vectors are kept by the text's digest,
  the most recently used ones, so a message that is a neighbour of the next
  one, or a greeting said a hundred times, is not embedded again. With a
  symmetric embedder, queries and passages share them: the message a turn
  recalls for is embedded for its own memory then, not again in the background.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ember.memory.embeddings import Embedder, lower_thread_priority
from ember.store.memory_rows import NEIGHBOUR_CHARS

QUERY_HEAD_CHARS = 600
QUERY_TAIL_CHARS = 300
# A neighbour's context is its head of this length, so it digests as the neighbour's own vector does.
PASSAGE_CHARS = NEIGHBOUR_CHARS
CACHED_PASSAGES = 4_096
CACHED_QUERIES = 256
# How much the two messages around an archived one weigh in its window vector, beside its own.
NEIGHBOUR_WEIGHT = 1.0
FAR_WEIGHT = 0.5


def window_vector(own: np.ndarray, adjacent: Sequence[np.ndarray], far: Sequence[np.ndarray] = ()) -> np.ndarray:
    """A message read between its neighbours, made of their vectors: no text is embedded twice."""
    window = own.astype(np.float32)
    for vectors, weight in ((adjacent, NEIGHBOUR_WEIGHT), (far, FAR_WEIGHT)):
        if len(vectors) and weight:
            window = window + weight * np.sum(vectors, axis=0)
    return (window / (np.linalg.norm(window) or 1.0)).astype(np.float32)


def vector_blob(vector: np.ndarray) -> bytes:
    """A vector as the store keeps it: float32 bytes."""
    return np.ascontiguousarray(vector, dtype=np.float32).tobytes()


def bounded_query(text: str) -> str:
    """The part of a message that a search embeds and looks up: its start and its end."""
    if len(text) <= QUERY_HEAD_CHARS + QUERY_TAIL_CHARS:
        return text
    return f"{text[:QUERY_HEAD_CHARS]}\n…\n{text[-QUERY_TAIL_CHARS:]}"


def bounded_passage(text: str) -> str:
    """The part of a memory its vector is made from: its beginning, where its gist usually is."""
    return text[:PASSAGE_CHARS]


class _Recent:
    """Vectors by digest, the least recently used dropped first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._vectors: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def get(self, key: bytes) -> np.ndarray | None:
        vector = self._vectors.get(key)
        if vector is not None:
            self._vectors.move_to_end(key)
        return vector

    def put(self, key: bytes, vector: np.ndarray) -> None:
        self._vectors[key] = vector
        self._vectors.move_to_end(key)
        if len(self._vectors) > self._size:
            self._vectors.popitem(last=False)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class Encoder:
    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._query_thread = ThreadPoolExecutor(1, thread_name_prefix="ember-query-embed")
        self._passage_thread = ThreadPoolExecutor(1, thread_name_prefix="ember-embed",
                                                  initializer=lower_thread_priority)
        self._passages = _Recent(CACHED_PASSAGES)
        self._queries = self._passages if embedder.symmetric else _Recent(CACHED_QUERIES)

    def prepare(self) -> None:
        """The embedder gets ready on the background's thread, at its low priority."""
        self._passage_thread.submit(self.embedder.prepare)

    async def query(self, text: str) -> np.ndarray:
        bounded = bounded_query(text.strip())
        key = _digest(bounded)
        vector = self._queries.get(key)
        if vector is None:
            loop = asyncio.get_running_loop()
            vector = (await loop.run_in_executor(self._query_thread, self.embedder.embed_queries, [bounded]))[0]
            self._queries.put(key, vector)
        return vector

    async def passages(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Each of `texts` -> its vector; only those not embedded recently are embedded now, in one call."""
        found: dict[str, np.ndarray] = {}
        missing: dict[str, bytes] = {}
        for text in texts:
            key = _digest(bounded_passage(text.strip()))
            vector = self._passages.get(key)
            if vector is not None:
                found[text] = vector
            else:
                missing[text] = key
        if missing:
            loop = asyncio.get_running_loop()
            made = await loop.run_in_executor(self._passage_thread, self.embedder.embed_passages,
                                              [bounded_passage(text.strip()) for text in missing])
            for (text, key), vector in zip(missing.items(), made):
                self._passages.put(key, vector)
                found[text] = vector
        return found

    def close(self) -> None:
        """Stop the threads once what they run now returns (a call in progress cannot be cut short)."""
        self._query_thread.shutdown(wait=False, cancel_futures=True)
        self._passage_thread.shutdown(wait=False, cancel_futures=True)
