"""HTTP plumbing shared by the gateway's routes: errors in the OpenAI shape, bounded
JSON bodies, Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse

from ember.channels.gateway.schemas import CLIENT_ID_PATTERN, SESSION_KEY_PATTERN
from ember.core.events import OutboundEvent

T = TypeVar("T", bound=BaseModel)

SESSION_HEADER = "X-Ember-Session"
IDEMPOTENCY_HEADER = "Idempotency-Key"
# Marks a new session as an evaluation run: nothing of it becomes anyone's memory.
EVALUATION_HEADER = "X-Ember-Evaluation"
KEEPALIVE_S = 15.0
_SESSION_KEY = re.compile(SESSION_KEY_PATTERN)
_CLIENT_ID = re.compile(CLIENT_ID_PATTERN)
_WHOLE_NUMBER = re.compile(r"[0-9]{1,9}")

_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 502: "server_error",
                500: "server_error"}


class ApiError(Exception):
    """An error the client caused or must know about, sent as `{"error": {...}}`."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def response(self) -> JSONResponse:
        detail = {"message": self.message, "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                  "code": self.code, "param": self.param}
        return JSONResponse({"error": detail}, status_code=self.status, headers=self.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes; the limit is {limit}", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the body is over the limit of {limit} bytes", code="body_too_large")
    return bytes(body)


async def read_json(request: Request, model: type[T], limit: int, files: FileAllowance[T] | None = None) -> T:
    """The request body as `model`: JSON only, at most `limit` bytes, validated. With `files`, the
    files it carries (their base64, as `files.weight` measures it) may add up to `files.allowance`."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise ApiError(415, f"send the body as application/json (got {content_type or 'no content type'})",
                       code="unsupported_media_type")
    body = await read_body(request, limit + (files.allowance if files else 0))
    try:
        # pydantic's own parser: deep nesting and lone surrogates are errors, not crashes.
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0]["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {errors[0]['msg']}", code="invalid_json") from exc
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc']) or 'body'}: {err['msg']}" for err in errors[:5]
        )
        first = ".".join(map(str, errors[0]["loc"])) if errors else ""
        raise ApiError(422, f"invalid request: {problems}", code="invalid_request", param=first or None) from exc
    if files is not None and len(body) - files.weight(parsed) > limit:
        raise ApiError(413, f"the body is over the limit of {limit} bytes, its files aside", code="body_too_large")
    return parsed


@dataclass(frozen=True, slots=True)
class FileAllowance(Generic[T]):
    """How much more than the limit a body may weigh for the files it carries."""

    allowance: int
    weight: Callable[[T], int]


def sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"{head}data: {payload}\n\n".encode()


SSE_KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def next_event(queue: asyncio.Queue[OutboundEvent], wait_s: float) -> OutboundEvent | None:
    """The next event, or None after `wait_s` (time for a keep-alive)."""
    try:
        async with asyncio.timeout(wait_s):
            return await queue.get()
    except TimeoutError:
        return None


def checked_key(key: str, where: str) -> str:
    if not _SESSION_KEY.fullmatch(key):
        raise ApiError(400, f"{where} {key[:64]!r} is not a session key: use 1-128 letters, digits and . _ @ + -",
                       code="invalid_session_key")
    return key


def known_params(request: Request, known: tuple[str, ...]) -> QueryParams:
    """The query parameters, when all are known: a misspelt one (`?limt=5`) is an error, not ignored."""
    params = request.query_params
    for name in params:
        if name not in known:
            raise ApiError(400, f"unknown parameter {name[:32]!r}; this route takes {', '.join(known)}",
                           code="invalid_parameter", param=name[:64])
    return params


def query_limit(params: QueryParams, default: int, most: int) -> int:
    """The `limit` query parameter: `default` when absent, else a whole number from 1 to `most` (400 otherwise)."""
    return query_int(params, "limit", default, 1, most)


def query_int(params: QueryParams, name: str, default: int, least: int, most: int) -> int:
    """The query parameter `name`: `default` when absent, else a whole number from `least` to `most`."""
    raw = params.get(name)
    if raw is None:
        return default
    if not _WHOLE_NUMBER.fullmatch(raw.removeprefix("-")) or not least <= int(raw) <= most:
        raise ApiError(400, f"{name} must be a whole number from {least} to {most}; it was {raw[:32]!r}",
                       code="invalid_parameter", param=name)
    return int(raw)


def evaluation_requested(request: Request) -> bool:
    value = request.headers.get(EVALUATION_HEADER)
    if value is None or value.lower() == "false":
        return False
    if value.lower() == "true":
        return True
    raise ApiError(400, f"the {EVALUATION_HEADER} header is true or false, not {value[:32]!r}",
                   code="invalid_evaluation_header")


def checked_client_id(client_id: str, where: str) -> str:
    if not _CLIENT_ID.fullmatch(client_id):
        raise ApiError(400, f"{where} {client_id[:64]!r} is not a message id: "
                            "use 1-128 letters, digits and . _ : @ + -", code="invalid_message_id")
    return client_id
