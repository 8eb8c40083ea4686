"""The gateway's Starlette application: routes, the identity gate, errors as JSON."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ember import __version__
from ember.channels.attachments import FileShelf
from ember.channels.gateway.activity_api import ActivityApi
from ember.channels.gateway.auth import ApiKeys
from ember.channels.gateway.conversations import Conversations
from ember.channels.gateway.http import ApiError
from ember.channels.gateway.limits import Limiter, RateLimiter
from ember.channels.gateway.memory_api import MemoryApi
from ember.channels.gateway.metrics import GatewayMetrics
from ember.channels.gateway.native_api import NativeApi
from ember.channels.gateway.openai_api import OpenAIApi
from ember.channels.gateway.openapi import openapi_document
from ember.channels.gateway.sampling import DEFAULT_LIMITS, SamplingLimits
from ember.channels.gateway.skills_api import SkillsApi
from ember.channels.gateway.tasks_api import TasksApi
from ember.channels.gateway.turns import TurnRouter
from ember.channels.gateway.uploads import AttachmentsApi, FetchFile, Intake
from ember.channels.gateway.usage_api import UsageApi
from ember.core.attachments import DEFAULT_MAX_BYTES as DEFAULT_ATTACHMENT_BYTES
from ember.core.errors import BusUnavailable, StoreBusy, StoreUnavailable
from ember.core.turn import TurnControl
from ember.memory.identity import Identities
from ember.memory.service import MemoryService
from ember.models.transcription import Transcriber
from ember.runtime.approvals import ApprovalBroker
from ember.runtime.usage import UsageRecorder
from ember.skills.library import SkillLibrary
from ember.store.protocols import (
    ConversationIndex,
    Inbox,
    JobCounts,
    SessionBrowser,
    TaskBook,
    TraceReader,
    UsageReport,
)

STATIC_DIR = Path(__file__).parent / "static"
# Open to all: liveness for supervisors, and the page that asks for a key.
# Webhooks and chat platforms' callbacks are authenticated by their signatures, checked by their route.
# The A2A agent card is public: another agent reads it to learn how to authenticate.
PUBLIC_PATHS = frozenset({"/", "/healthz", "/.well-known/agent-card.json"})
PUBLIC_PREFIXES = ("/static/", "/webhooks/", "/channels/")

# The page runs only its own scripts and cannot be framed by another site. (blob: pictures and recordings
# are files the page fetched with its key: an <img> cannot send one.)
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data: blob:; media-src 'self' blob:; connect-src 'self'; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GatewayServices:
    """The runtime's parts the routes read and write, besides the turns."""

    sessions: SessionBrowser
    jobs: JobCounts
    approvals: ApprovalBroker
    memory: MemoryService
    identities: Identities
    conversations: ConversationIndex  # which session holds the conversation of a request naming none
    usage: UsageRecorder | None = None  # its counts reach /metrics
    tasks: TaskBook | None = None
    skills: SkillLibrary | None = None
    deliveries: Inbox | None = None  # the errors turns ended with, shown in the history
    turns: TurnControl | None = None  # stops a running turn
    traces: TraceReader | None = None  # what each turn did: /api/activity
    usage_report: UsageReport | None = None  # what the caller's model calls cost: /api/usage
    transcriber: Transcriber | None = None  # hears voice notes ([model_roles] transcribe)


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    agent_id: str
    max_body_bytes: int
    rate_per_minute: float
    rate_burst: int
    approvers: frozenset[str] = frozenset()  # identities that may answer anyone's approval requests
    timezone: str = "UTC"  # of tasks created without one
    agent_name: str = "Ember"
    model_label: str = ""  # the model that answers, as the page shows it
    sampling_limits: SamplingLimits = DEFAULT_LIMITS  # the most an OpenAI-route request may ask for
    model_problem: str = ""  # why that model did not answer when the gateway started ("": it did)
    settings_view: Mapping[str, Any] = field(default_factory=dict)  # /api/settings: read-only, never a secret
    agents: tuple[str, ...] = ()  # the named agents a caller may ask for (the page's picker)
    own_memory_agents: frozenset[str] = frozenset()  # named agents whose own memory `?agent=` reaches
    attachment_max_bytes: int = DEFAULT_ATTACHMENT_BYTES  # a message's files together
    fetch_image: FetchFile | None = None  # an image a message links to (None: links are refused)


class IdentityGate:
    """Resolves the caller's identity from its bearer key and applies its rate
    limit; the routes find it in `request.state.identity`."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, limiter: Limiter) -> None:
        self._app = app
        self._keys = keys
        self._limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            await self._app(scope, receive, send)
            return
        identity = self._keys.identify(Headers(scope=scope).get("authorization"))
        # Failed attempts are limited per client address, so keys cannot be guessed at full speed.
        bucket = identity if identity is not None else f"unauthenticated {(scope.get('client') or ('?',))[0]}"
        if wait := await self._limiter.retry_after(bucket):
            seconds = math.ceil(wait)  # the message says what the header says
            error = ApiError(429, f"too many requests; retry in {seconds} s", code="rate_limited",
                             headers={"Retry-After": str(seconds)})
            await error.response()(scope, receive, send)
            return
        if identity is None:
            error = ApiError(401, "send a valid API key as 'Authorization: Bearer <key>'", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        scope.setdefault("state", {})["identity"] = identity
        await self._app(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    headers = dict(exc.headers or {})
    return ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=headers).response()


async def _store_down(request: Request, exc: Exception) -> Response:
    """The store was busy past its timeout, or failed: nothing was half done; the client may retry."""
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return ApiError(503, f"{exc}", code="store_unavailable", headers={"Retry-After": "1"}).response()


async def _bus_down(request: Request, exc: Exception) -> Response:
    """The message bus could not take the message: nothing was accepted; the client may retry."""
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return ApiError(503, f"{exc}", code="bus_unavailable", headers={"Retry-After": "1"}).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); see the server log").response()


def create_app(router: TurnRouter, services: GatewayServices, keys: ApiKeys, options: GatewayOptions, *,
               lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]] | None = None,
               channel_routes: Sequence[BaseRoute] = (), limiter: Limiter | None = None) -> Starlette:
    """`channel_routes`: the routes of other channels on the gateway's port (webhooks), which
    authenticate their requests themselves. `limiter`: the callers' rate limits (default: in
    this process, from `options`)."""
    metrics = GatewayMetrics()
    if services.usage is not None:
        services.usage.observe(metrics.count_usage)

    @asynccontextmanager
    async def watched(app: Starlette) -> AsyncIterator[None]:
        watcher = asyncio.create_task(metrics.watch_event_loop(), name="ember-loop-lag")
        try:
            async with lifespan(app) if lifespan is not None else nullcontext():
                yield
        finally:
            watcher.cancel()

    return Starlette(
        routes=[*_own_routes(services, keys, options, metrics), *_api_routes(router, services, options, metrics),
                *channel_routes, Mount("/static", StaticFiles(directory=STATIC_DIR), name="static")],
        middleware=[Middleware(IdentityGate, keys=keys,
                               limiter=limiter or RateLimiter(options.rate_per_minute, options.rate_burst))],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, StoreBusy: _store_down,
                            StoreUnavailable: _store_down, BusUnavailable: _bus_down, Exception: _unexpected},
        lifespan=watched,
    )


def _api_routes(router: TurnRouter, services: GatewayServices, options: GatewayOptions,
                metrics: GatewayMetrics) -> list[BaseRoute]:
    """The OpenAI-compatible routes and Ember's own API; the optional parts where their stores are given."""
    body = options.max_body_bytes
    intake = Intake(FileShelf(services.sessions, options.attachment_max_bytes, services.transcriber), body,
                    options.fetch_image)
    routes: list[BaseRoute] = [
        *OpenAIApi(router, metrics, Conversations(services.conversations), intake, agent_id=options.agent_id,
                   limits=options.sampling_limits).routes(),
        *NativeApi(router, services.sessions, services.approvals, metrics, intake=intake,
                   approvers=options.approvers, deliveries=services.deliveries, turns=services.turns).routes(),
        *AttachmentsApi(services.sessions).routes(),
        *MemoryApi(services.memory, services.identities, max_body_bytes=body,
                   own_memory_agents=options.own_memory_agents).routes(),
    ]
    if services.tasks is not None:
        tasks = TasksApi(services.tasks, services.identities, max_body_bytes=body, default_tz=options.timezone)
        routes += tasks.routes()
    if services.skills is not None:
        routes += SkillsApi(services.skills, services.identities, max_body_bytes=body).routes()
    if services.traces is not None:
        routes += ActivityApi(services.traces).routes()
    if services.usage_report is not None:
        routes += UsageApi(services.usage_report, services.sessions, services.identities).routes()
    return routes


def _own_routes(services: GatewayServices, keys: ApiKeys, options: GatewayOptions,
                metrics: GatewayMetrics) -> list[BaseRoute]:
    """The page, and what describes the gateway: health, metrics, the OpenAPI document, the caller."""
    document = openapi_document("Ember gateway", __version__, options.agents)

    async def me(request: Request) -> Response:
        """Who the caller is and what answers them, for the page's header."""
        identity = request.state.identity
        return JSONResponse({"identity": identity, "person": services.identities.resolve("http", identity),
                             "agent": options.agent_name, "model": options.model_label, "keys": not keys.open,
                             "model_problem": options.model_problem or None, "agents": list(options.agents)})

    async def settings_view(request: Request) -> Response:
        """The models, channels, tools and policy this gateway runs with, for the page's Settings view."""
        return JSONResponse(dict(options.settings_view))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics_text(request: Request) -> Response:
        return metrics.response(await services.jobs.counts())

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    async def page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)

    return [
        Route("/", page, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/api/me", me, methods=["GET"]),
        Route("/api/settings", settings_view, methods=["GET"]),
    ]
