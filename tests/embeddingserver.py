"""An OpenAI-compatible `/v1/embeddings` endpoint of the tests' own, speaking real HTTP.

Its vectors are feature hashes of words (texts sharing words are close), so
a search through it finds by words, which a test can predict. It can be told
to answer the next requests with an HTTP error (a 429 with Retry-After, a 500,
a 400), or to answer slowly; every request is recorded with its headers.

    with embedding_server() as server:
        server.fail(429, retry_after="0.1")
        ... ProviderEmbedder("mock-embed", base_url=server.base_url, api_key="k") ...
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.loopback import LoopbackServer, started

DIMENSIONS = 64
_WORD = re.compile(r"\w+")


def vector_of(text: str, dimensions: int = DIMENSIONS) -> list[float]:
    vector = np.zeros(dimensions)
    for word in _WORD.findall(text.lower()):
        digest = hashlib.sha256(word.encode()).digest()
        vector[int.from_bytes(digest[:4], "big") % dimensions] += 1.0
    return (vector * 3.0).tolist()  # not normalised: the client must normalise


@dataclass(slots=True)
class EmbeddingServer:
    origin: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    failures: deque[tuple[int, str | None]] = field(default_factory=deque)
    delay_s: float = 0.0

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    def fail(self, status: int, *, retry_after: str | None = None, times: int = 1) -> None:
        self.failures.extend([(status, retry_after)] * times)

    @property
    def texts(self) -> list[str]:
        return [text for request in self.requests for text in request["input"]]

    async def embeddings(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append({"input": body["input"] if isinstance(body["input"], list) else [body["input"]],
                              "model": body.get("model"), "authorization": request.headers.get("authorization")})
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.failures:
            status, retry_after = self.failures.popleft()
            headers = {"retry-after": retry_after} if retry_after else {}
            return JSONResponse({"error": {"message": f"scripted HTTP {status}", "type": "test", "code": None}},
                                status_code=status, headers=headers)
        texts = self.requests[-1]["input"]
        data = [{"object": "embedding", "index": i, "embedding": vector_of(text)} for i, text in enumerate(texts)]
        data.reverse()  # the API promises an index per vector, not their order
        return JSONResponse({"object": "list", "data": data, "model": body.get("model"),
                             "usage": {"prompt_tokens": len(texts), "total_tokens": len(texts)}})


@contextmanager
def embedding_server() -> Iterator[EmbeddingServer]:
    server = EmbeddingServer()
    app = Starlette(routes=[Route("/v1/embeddings", server.embeddings, methods=["POST"])])
    with started(LoopbackServer(app, "embedding-server")) as loopback:
        server.origin = loopback.origin
        yield server
