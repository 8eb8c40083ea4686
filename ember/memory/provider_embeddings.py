"""Embeddings from an OpenAI-compatible `/v1/embeddings` endpoint: OpenAI, Ollama, vLLM, ...

`embedding_model = "openai:MODEL"`. Texts go in batches; an endpoint that is
down or rate limited is retried as a chat model is (models/retry.py), and its
errors are the same typed ModelErrors. The calls block: memory/encoder.py makes
them on its own threads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import openai

from ember.core.errors import ModelError
from ember.models.openai_compat import typed
from ember.models.retry import call_with_retries

PROVIDER_PREFIX = "openai:"
# A provider's cosine similarities spread wider than e5's: unrelated texts score about 0.0-0.25.
DEFAULT_RELEVANCE_FLOOR = 0.3
BATCH = 64


class ProviderEmbedder:
    symmetric = True  # /v1/embeddings takes no query or passage form

    def __init__(self, model: str, *, base_url: str, api_key: str | None, relevance_floor: float | None = None,
                 timeout_s: float = 30.0, attempts: int = 3) -> None:
        self.name = PROVIDER_PREFIX + model
        self.dimensions: int | None = None
        self.relevance_floor = DEFAULT_RELEVANCE_FLOOR if relevance_floor is None else relevance_floor
        self._model = model
        self._base_url = base_url
        self._attempts = attempts
        # Retries are call_with_retries'; an endpoint without a key (Ollama, vLLM) still wants one sent.
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key or "unused", timeout=timeout_s,
                                     max_retries=0)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._embed(texts)

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        return self._embed(texts)

    def prepare(self) -> None:
        pass

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        rows: list[list[float]] = []
        for start in range(0, len(texts), BATCH):
            batch = list(texts[start:start + BATCH])
            rows += call_with_retries(lambda batch=batch: self._call(batch), self._attempts)
        matrix = np.asarray(rows, dtype=np.float32)
        if matrix.ndim != 2 or not np.isfinite(matrix).all():
            raise ModelError(f"embedding model {self._model}: the endpoint sent vectors that are not numbers")
        if self.dimensions is None:
            self.dimensions = matrix.shape[1]
        elif matrix.shape[1] != self.dimensions:
            raise ModelError(f"embedding model {self._model}: vectors of {matrix.shape[1]} dimensions, after "
                             f"{self.dimensions}; a different model answers under this name")
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return matrix / np.where(norms == 0, 1.0, norms)

    def _call(self, batch: list[str]) -> list[list[float]]:
        try:
            reply = self._client.embeddings.create(model=self._model, input=batch, encoding_format="float")
        except openai.OpenAIError as exc:
            raise typed(exc, f"embedding model {self._model} at {self._base_url}", self._base_url) from exc
        if len(reply.data) != len(batch):
            raise ModelError(f"embedding model {self._model}: {len(reply.data)} vectors for {len(batch)} texts")
        return [item.embedding for item in sorted(reply.data, key=lambda item: item.index)]
