"""Long-term memory over HTTP: the caller's memories listed, searched, added, corrected
and forgotten, in the records `ember memory ... --json` prints.

Memory belongs to a person, not to a key: the caller's key name is resolved
through `[identities]`, so two keys bound to one person share one memory.
Another person's memory does not exist for a caller (404, never 403).
"""

from __future__ import annotations

import unicodedata

from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.gateway.http import ApiError, known_params, query_limit, read_json
from ember.channels.gateway.schemas import (
    MAX_LIST_LIMIT,
    MAX_QUERY_CHARS,
    MemoryCorrection,
    MemoryWrite,
)
from ember.channels.gateway.turns import CHANNEL
from ember.core.errors import MemoryInputError, MemoryNotFound
from ember.core.memory import MemoryKind, memory_identity
from ember.memory.identity import Identities
from ember.memory.service import MAX_LIMIT as MAX_SEARCH_LIMIT
from ember.memory.service import MemoryService

_FLAGS = {"true": True, "false": False}
_LIST_PARAMS = ("kind", "all", "limit", "agent")
_SEARCH_PARAMS = ("q", *_LIST_PARAMS)


def _kinds(params: QueryParams) -> tuple[MemoryKind, ...]:
    try:
        return tuple(MemoryKind(value) for value in params.getlist("kind"))
    except ValueError:
        names = ", ".join(kind.value for kind in MemoryKind)
        raise ApiError(400, f"kind must be one of {names}", code="invalid_parameter", param="kind") from None


def _include_inactive(params: QueryParams) -> bool:
    raw = params.get("all", "false")
    if raw not in _FLAGS:
        raise ApiError(400, f"all must be true or false; it was {raw[:32]!r}", code="invalid_parameter", param="all")
    return _FLAGS[raw]


def _query(params: QueryParams) -> str:
    query = params.get("q", "")
    if not query.strip():
        raise ApiError(400, "say what to look for: /api/memory/search?q=<words>", code="missing_query", param="q")
    if len(query) > MAX_QUERY_CHARS:
        raise ApiError(400, f"a query is at most {MAX_QUERY_CHARS} characters; this one has {len(query)}",
                       code="invalid_query", param="q")
    # What the document's pattern says ([\p{L}\p{N}]), so a query it rules out is refused, not searched.
    if not any(unicodedata.category(char)[0] in "LN" for char in query):
        raise ApiError(400, "a query needs a letter or a digit to search for; this one has none",
                       code="invalid_query", param="q")
    return query


class MemoryApi:
    """`own_memory_agents`: the named agents that keep a memory of their own with each person, which
    `?agent=NAME` reaches (the caller's with that agent) on every route."""

    def __init__(self, memory: MemoryService, identities: Identities, *, max_body_bytes: int,
                 own_memory_agents: frozenset[str] = frozenset()) -> None:
        self._memory = memory
        self._identities = identities
        self._max_body_bytes = max_body_bytes
        self._own_memory_agents = own_memory_agents

    def routes(self) -> list[Route]:
        return [
            Route("/api/memory", self.memories, methods=["GET", "POST"]),
            Route("/api/memory/search", self.search, methods=["GET"]),
            Route("/api/memory/{id}", self.one, methods=["PATCH", "DELETE"]),
        ]

    def _person(self, request: Request) -> str:
        """The identity whose memory the caller's key reaches: theirs, or theirs with `?agent=`."""
        person = self._identities.resolve(CHANNEL, request.state.identity)
        agent = request.query_params.get("agent")
        if agent is None:
            return person
        if agent not in self._own_memory_agents:
            known = ", ".join(sorted(self._own_memory_agents)) or "none"
            raise ApiError(400, f"no agent {agent[:40]!r} keeps a memory of its own (those that do: {known})",
                           code="unknown_agent", param="agent")
        return memory_identity(person, {"agent": agent, "memory": "own"})

    async def memories(self, request: Request) -> Response:
        # One route for both methods, so a 405 on it names both in its Allow header.
        return await (self.add(request) if request.method == "POST" else self.list_memories(request))

    async def list_memories(self, request: Request) -> Response:
        params = known_params(request, _LIST_PARAMS)
        records = await self._memory.store.list(
            self._person(request), kinds=_kinds(params), include_inactive=_include_inactive(params),
            limit=query_limit(params, 100, MAX_LIST_LIMIT))
        return JSONResponse([record.to_json_dict() for record in records])

    async def search(self, request: Request) -> Response:
        params = known_params(request, _SEARCH_PARAMS)
        query, kinds = _query(params), _kinds(params)
        include_inactive, limit = _include_inactive(params), query_limit(params, 10, MAX_SEARCH_LIMIT)
        try:
            hits = await self._memory.search(self._person(request), query, limit=limit,
                                             include_inactive=include_inactive, kinds=kinds)
        except MemoryInputError as exc:  # a query with no words in it, only punctuation say
            raise ApiError(400, str(exc), code="invalid_query", param="q") from exc
        return JSONResponse([hit.to_json_dict() for hit in hits])

    async def add(self, request: Request) -> Response:
        body = await read_json(request, MemoryWrite, self._max_body_bytes)
        try:
            outcome = await self._memory.remember(
                self._person(request), body.content, subject=body.subject, key=body.key,
                source=f"{CHANNEL}:{request.state.identity}")
        except MemoryInputError as exc:  # blank content
            raise ApiError(422, str(exc), code="invalid_memory", param="content") from exc
        return JSONResponse(outcome.record.to_json_dict(), status_code=201 if outcome.created else 200)

    async def one(self, request: Request) -> Response:
        memory_id = request.path_params["id"]
        if memory_id == "search":
            # The search route's own path, which only GET serves: a wrong method, not an unknown memory.
            raise HTTPException(405, headers={"Allow": "GET, HEAD"})
        try:
            if request.method == "PATCH":
                return await self.correct(request, memory_id)
            record = await self._memory.forget(self._person(request), memory_id)
        except MemoryNotFound:
            raise ApiError(404, f"no memory {memory_id[:64]!r}", code="memory_not_found") from None
        return JSONResponse(record.to_json_dict())

    async def correct(self, request: Request, memory_id: str) -> Response:
        """A fact the person corrects: the new text supersedes it (its history keeps both)."""
        body = await read_json(request, MemoryCorrection, self._max_body_bytes)
        try:
            outcome = await self._memory.store.revise(self._person(request), memory_id, body.content)
        except MemoryNotFound:
            raise  # a 404, as for DELETE
        except MemoryInputError as exc:  # blank content, or not an active fact
            raise ApiError(422, str(exc), code="invalid_memory", param="content") from exc
        return JSONResponse(outcome.record.to_json_dict())
