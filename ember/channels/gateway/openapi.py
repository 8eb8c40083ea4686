"""The gateway's OpenAPI document, built from its wire shapes (gateway/schemas.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from ember.channels.gateway.schemas import (
    CLIENT_ID_PATTERN,
    MAX_LIST_LIMIT,
    MAX_QUERY_CHARS,
    MEMORY_QUERY_PATTERN,
    SESSION_KEY_PATTERN,
    ApprovalAnswer,
    ApprovalAnswered,
    ChatCompletion,
    ChatCompletionRequest,
    ErrorBody,
    Health,
    History,
    MemoryCorrection,
    MemoryHits,
    MemoryItem,
    MemoryList,
    MemoryWrite,
    MessageRequest,
    ModelList,
    PendingApprovals,
    SessionList,
    TurnStopping,
)
from ember.core.memory import MemoryKind
from ember.memory.service import MAX_LIMIT as MAX_SEARCH_LIMIT

_SCHEMAS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest, MessageRequest, ApprovalAnswer, ErrorBody, ChatCompletion, ModelList, SessionList,
    History, TurnStopping, Health, PendingApprovals, ApprovalAnswered, MemoryWrite, MemoryCorrection, MemoryItem,
    MemoryList, MemoryHits,
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


# One Server-Sent Event: its `event` type (absent on the OpenAI stream) and its JSON `data`.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}
_SSE = {"description": "Server-Sent Events: delta, tool_call, tool_result, approval_request, final, error",
        "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
_APPROVAL_PARAM = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_SESSION_PARAM = {
    "name": "key", "in": "path", "required": True,
    "schema": {"type": "string", "pattern": SESSION_KEY_PATTERN},
}
_MEMORY_PARAM = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_MEMORY_FILTERS = [
    {"name": "kind", "in": "query", "required": False, "style": "form", "explode": True,
     "description": "Only these tiers (repeat it for several); every tier by default",
     "schema": {"type": "array", "items": {"type": "string", "enum": [kind.value for kind in MemoryKind]}}},
    {"name": "all", "in": "query", "required": False, "schema": {"type": "boolean", "default": False},
     "description": "Include superseded, archived and pending memories"},
]
_QUERY_PARAM = {"name": "q", "in": "query", "required": True, "description": "What to look for",
                "schema": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS,
                           "pattern": MEMORY_QUERY_PATTERN}}


_EVALUATION_HEADER = {"name": "X-Ember-Evaluation", "in": "header", "required": False,
                      "schema": {"type": "string", "enum": ["true", "false"], "default": "false"},
                      "description": "true: the session this message starts is an evaluation run and leaves "
                                     "no memory (on a session that exists already it changes nothing)"}


def _limit_param(default: int, most: int) -> dict[str, Any]:
    return {"name": "limit", "in": "query", "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": most, "default": default}}


def _errors(*codes: int) -> dict[str, Any]:
    meaning = {400: "Bad request", 401: "Missing or wrong API key", 404: "Not found", 405: "Wrong method",
               409: "Already answered, or being answered",
               410: "Expired: nobody answered in time, or its turn ended without it",
               413: "Body too large", 415: "Body is not JSON", 422: "Invalid body", 429: "Too many requests",
               502: "The turn failed"}
    return {str(code): _json(ErrorBody, meaning[code]) for code in codes}


def _operation(summary: str, responses: dict[str, Any], *, body: type[BaseModel] | None = None,
               params: list[dict[str, Any]] | None = None, public: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    if params:
        op["parameters"] = params
    if public:
        op["security"] = []
    else:
        op["responses"] = {**responses, **_errors(401, 429)}
    return op


def openapi_document(title: str, version: str, agents: Sequence[str] = ()) -> dict[str, Any]:
    """`agents`: the named agents a message may ask for, which the document lists as the only values."""
    schemas: dict[str, Any] = {}
    for model in _SCHEMAS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    agent = schemas["MessageRequest"]["properties"]["agent"]
    agent["anyOf"] = [{"enum": list(agents)}, {"type": "null"}] if agents else [{"type": "null"}]
    paths = {**_conversation_paths(), **_memory_paths(), **{
        "/healthz": {"get": _operation("Liveness", {"200": _json(Health, "Alive")}, public=True)},
        "/metrics": {"get": _operation("Prometheus metrics", {"200": {
            "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})},
    }}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _conversation_paths() -> dict[str, Any]:
    """The OpenAI-compatible routes, sessions and approvals."""
    session_header = [{"name": "X-Ember-Session", "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": SESSION_KEY_PATTERN},
                       "description": "The session. Without it or the user field, the messages before the new "
                                      "one continue the caller's session holding them, or start one seeded "
                                      "with them; the response's X-Ember-Session names it"},
                      {"name": "Idempotency-Key", "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": CLIENT_ID_PATTERN}},
                      _EVALUATION_HEADER]
    body_errors = _errors(400, 413, 415, 422)
    return {
        "/v1/chat/completions": {"post": _operation(
            "OpenAI-compatible chat completion (stream or not); the server keeps the history",
            {"200": {"description": "A completion, or its stream of chunks",
                     "content": {"application/json": {"schema": _ref(ChatCompletion)},
                                 "text/event-stream": {"schema": _SSE_EVENT}}},
             **body_errors, **_errors(409, 502)},
            body=ChatCompletionRequest, params=session_header)},
        "/v1/models": {"get": _operation("The agents this gateway serves", {"200": _json(ModelList, "Agents")})},
        "/api/sessions": {"get": _operation("The caller's sessions", {"200": _json(SessionList, "Sessions")})},
        "/api/sessions/{key}/messages": {
            "get": _operation("A session's committed history",
                              {"200": _json(History, "Messages"), **_errors(400, 404)}, params=[_SESSION_PARAM]),
            "post": _operation("Send a message; the answer streams back as Server-Sent Events",
                               {"200": _SSE, **body_errors, **_errors(409)}, body=MessageRequest,
                               params=[_SESSION_PARAM, _EVALUATION_HEADER]),
        },
        "/api/sessions/{key}/stop": {"post": _operation(
            "Stop the turn running in a session; what it committed stays, and its history says it was stopped",
            {"202": _json(TurnStopping, "Stopping"), **_errors(400, 404, 409)}, params=[_SESSION_PARAM])},
        "/api/approvals": {"get": _operation("The caller's approval requests waiting for an answer",
                                             {"200": _json(PendingApprovals, "Pending requests")})},
        "/api/approvals/{id}": {"post": _operation(
            "Answer an approval request", {"200": _json(ApprovalAnswered, "Answered"), **body_errors,
                                           **_errors(404, 409, 410)},
            body=ApprovalAnswer, params=[_APPROVAL_PARAM])},
    }


def _memory_paths() -> dict[str, Any]:
    body_errors = _errors(400, 413, 415, 422)
    return {
        "/api/memory": {
            "get": _operation("The caller's memories, newest first (active ones unless all=true)",
                              {"200": _json(MemoryList, "Memories"), **_errors(400)},
                              params=[*_MEMORY_FILTERS, _limit_param(100, MAX_LIST_LIMIT)]),
            "post": _operation("Remember a fact the caller states",
                               {"201": _json(MemoryItem, "Remembered"),
                                "200": _json(MemoryItem, "Already remembered: the existing memory"), **body_errors},
                               body=MemoryWrite),
        },
        "/api/memory/search": {"get": _operation(
            "The caller's memories best matching q, by words and by meaning",
            {"200": _json(MemoryHits, "Hits, best first"), **_errors(400)},
            params=[_QUERY_PARAM, *_MEMORY_FILTERS, _limit_param(10, MAX_SEARCH_LIMIT)])},
        "/api/memory/{id}": {
            "patch": _operation(
                "Correct an active fact: a fact the caller states, of the same subject and key, supersedes it",
                {"200": _json(MemoryItem, "The fact as it reads now"), **body_errors, **_errors(404),
                 "405": _json(ErrorBody, "The id 'search': that path is the search route's")},
                body=MemoryCorrection, params=[_MEMORY_PARAM]),
            "delete": _operation(
                "Forget a memory: archived, never recalled again, still listed with all=true",
                {"200": _json(MemoryItem, "The archived memory"), **_errors(404),
                 "405": _json(ErrorBody, "The id 'search': that path is the search route's")},
                params=[_MEMORY_PARAM])},
    }
