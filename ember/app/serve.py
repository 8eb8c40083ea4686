"""`ember serve`: the gateway, the agent loop and the background runner in one process."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.routing import BaseRoute

from ember.app.models import configured_transcriber
from ember.app.runtime import Runtime, configured_runtime, require_shared_bus, running
from ember.app.settings_view import DEMO_MODEL, settings_view
from ember.channels.attachments import FileShelf
from ember.channels.chat.services import ChatServices
from ember.channels.gateway.app import GatewayOptions, GatewayServices, create_app
from ember.channels.gateway.auth import ApiKeys
from ember.channels.gateway.limits import RedisRateLimiter
from ember.channels.gateway.sampling import SamplingLimits
from ember.channels.gateway.turns import CHANNEL, SharedTurnRouter, TurnRouter
from ember.channels.webhooks.inbound import WebhookChannel
from ember.channels.webhooks.outbound import OutboundWebhooks
from ember.config.settings import Settings
from ember.core.attachments import DEFAULT_MAX_BYTES as DEFAULT_ATTACHMENT_BYTES
from ember.core.errors import ConfigError, EmberError
from ember.models.base import ModelClient
from ember.models.demo import DEMO_NAME
from ember.models.transcription import Transcriber
from ember.store.conversations import SqlConversationIndex
from ember.store.usage import SqlUsageStore
from ember.tools.web import file_fetcher

if TYPE_CHECKING:
    from ember.channels.a2a import A2AServer


class ListenError(EmberError):
    """The gateway cannot take its address (in use, not permitted, unknown)."""


@dataclass(frozen=True, slots=True)
class Listening:
    host: str
    port: int
    identities: int
    model_problem: str = ""  # why a configured model could not be reached at start ("": it could)


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Said on stderr, so a person at the terminal knows the pause is on purpose.
        if self.should_exit:
            print("ember serve: stopping now, without waiting", file=sys.stderr, flush=True)
        else:
            grace = self.config.timeout_graceful_shutdown
            print(f"ember serve: stopping; open requests and running turns get up to {grace:g} s to finish, "
                  "then the background jobs are put back for the next start (Ctrl-C again stops at once)",
                  file=sys.stderr, flush=True)
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # SIGINT/SIGTERM stop gracefully, and the process then exits 0: uvicorn's own
        # handler re-raises the signal afterwards, which makes a clean stop look like a kill.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_keys(settings: Settings, host: str) -> ApiKeys:
    """The configured keys, refusing an open gateway on a non-loopback address."""
    keys = ApiKeys.parse(secret.get_secret_value() for secret in settings.api_keys)
    if keys.open and not is_loopback(host):
        raise ConfigError(f"no API keys are configured, so the gateway serves loopback only, not {host}. "
                          "Set EMBER_API_KEYS=name=<long secret> to listen on other addresses.")
    return keys


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before anything else starts, so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY on accepted sockets only
    # when the listener's protocol says TCP, and streamed deltas must not wait for Nagle.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # Reuse: a restart after a crash must not wait for the old connections' TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def model_label(settings: Settings, model: ModelClient) -> str:
    """The answering model as a person should read it; the demo model says it is scripted."""
    if not settings.model_configured:
        return DEMO_MODEL
    return model.name


def webhook_channels(settings: Settings, runtime: Runtime) -> list[BaseRoute]:
    """Register the webhook channels `settings` configures; the routes to serve for them."""
    if settings.outbound:
        runtime.channels.register(OutboundWebhooks(
            settings.outbound, allow_private=settings.web_fetch_allow_private,
            allowed_hosts=frozenset(settings.web_fetch_allowed_hosts)))
    if not settings.webhooks:
        return []
    webhooks = WebhookChannel(runtime.bus, runtime.deliveries.store, settings.webhooks,
                              max_body_bytes=settings.gateway_max_body_bytes)
    runtime.channels.register(webhooks)
    return list(webhooks.routes())


def chat_services(runtime: Runtime, attachment_max_bytes: int = DEFAULT_ATTACHMENT_BYTES,
                  transcriber: Transcriber | None = None) -> ChatServices:
    """What every chat platform's channel is given of `runtime`."""
    from ember.store.approvals import SqlApprovalStore
    from ember.store.channel_messages import SqlChannelMessages

    return ChatServices(runtime.bus, runtime.deliveries.store, SqlChannelMessages(runtime.db), runtime.approvals,
                        SqlApprovalStore(runtime.db), runtime.identities,
                        FileShelf(runtime.sessions, attachment_max_bytes, transcriber))


def chat_channels(settings: Settings, runtime: Runtime, public_url: str | None,
                  transcriber: Transcriber | None = None) -> list[BaseRoute]:
    """Register the chat platforms `settings` configures; the routes of those called back."""
    shared = chat_services(runtime, settings.attachment_max_bytes, transcriber)
    platforms = []
    if (telegram := settings.telegram_bot) is not None:
        from ember.channels.telegram.channel import TelegramChannel  # the SDK: only when configured

        platforms.append(TelegramChannel(telegram, shared, public_url=public_url))
    if settings.slack is not None:
        from ember.channels.slack.channel import SlackChannel  # the SDK: only when configured

        platforms.append(SlackChannel(settings.slack, shared))
    if settings.dingtalk is not None:
        from ember.channels.dingtalk.channel import DingTalkChannel

        platforms.append(DingTalkChannel(settings.dingtalk, shared))
    if settings.discord is not None:
        from ember.channels.discord.channel import DiscordChannel  # the SDK: only when configured

        platforms.append(DiscordChannel(settings.discord, shared))
    if settings.feishu is not None:
        from ember.channels.feishu.channel import FeishuChannel

        platforms.append(FeishuChannel(settings.feishu, shared))
    if settings.wecom is not None:
        from ember.channels.wecom.channel import WeComChannel

        platforms.append(WeComChannel(settings.wecom, shared))
    if settings.wechat is not None:
        from ember.channels.wecom.channel import WeChatOfficialChannel

        platforms.append(WeChatOfficialChannel(settings.wechat, shared))
    if settings.wecom_bot is not None:
        from ember.channels.wecom.bot import WeComBotChannel

        platforms.append(WeComBotChannel(settings.wecom_bot, shared))
    if settings.qq is not None:
        from ember.channels.qq.channel import QQChannel

        platforms.append(QQChannel(settings.qq, shared))
    if settings.email is not None:
        from ember.channels.email.channel import EmailChannel

        platforms.append(EmailChannel(settings.email, shared))
    routes: list[BaseRoute] = []
    for channel in platforms:
        runtime.channels.register(channel)
        routes += channel.routes()
    return routes


async def a2a_channel(settings: Settings, runtime: Runtime, public_url: str) -> A2AServer | None:
    """The A2A server's channel, registered, and its routes; None when a2a_enabled is off. Its tasks
    are in the store; a task file an earlier Ember kept in EMBER_HOME is copied in first, once."""
    if not settings.a2a_enabled:
        return None
    from ember.channels.a2a import CHANNEL as A2A  # the SDK: only when on
    from ember.channels.a2a import RPC_PATH, a2a_server, agent_card, task_owner
    from ember.store.a2a_tasks import SqlA2ATaskEvents, SqlA2ATaskStore, import_task_file

    if (old := settings.home_dir / "a2a.db").exists():
        await import_task_file(runtime.db, old)

    router = turn_router(settings, runtime, A2A)
    runtime.channels.register(router)
    card = agent_card(name=settings.agent_name, url=public_url.rstrip("/") + RPC_PATH, tools=runtime.tools.specs(),
                      description=f"{settings.agent_name}, a long-running agent on Ember: it answers, uses its "
                                  "tools with its person's approval, and remembers.")
    return a2a_server(router, runtime.approvals, card, SqlA2ATaskStore(runtime.db, task_owner),
                      SqlA2ATaskEvents(runtime.db))


def gateway_options(settings: Settings, model: ModelClient, model_problem: str,
                    view: Mapping[str, Any] | None = None) -> GatewayOptions:
    """What the gateway's routes are told of the settings, and of the model as it stood at start."""
    return GatewayOptions(
        agent_id=settings.agent_name.lower().replace(" ", "-"),
        max_body_bytes=settings.gateway_max_body_bytes,
        attachment_max_bytes=settings.attachment_max_bytes,
        rate_per_minute=settings.gateway_rate_per_minute,
        rate_burst=settings.gateway_rate_burst,
        approvers=frozenset(settings.gateway_approvers),
        timezone=settings.timezone,
        agent_name=settings.agent_name,
        model_label=model_label(settings, model),
        model_problem=model_problem,
        sampling_limits=SamplingLimits(settings.gateway_max_tokens, settings.gateway_max_temperature),
        settings_view=view or {},
        own_memory_agents=frozenset(name for name, spec in settings.agents.items() if spec.memory == "own"),
        agents=tuple(sorted(settings.agents)),
        fetch_image=file_fetcher(allow_private=settings.web_fetch_allow_private,
                                 allowed_hosts=frozenset(settings.web_fetch_allowed_hosts),
                                 max_bytes=settings.attachment_max_bytes),
    )


def turn_router(settings: Settings, runtime: Runtime, channel: str) -> TurnRouter:
    """Gateways sharing a bus (Redis) look up in the store an answer whose event went astray."""
    agents = frozenset(settings.agents)
    if settings.redis_url is None:
        return TurnRouter(runtime.bus, channel, agents=agents)
    return SharedTurnRouter(runtime.bus, runtime.deliveries.store, channel, agents=agents)


def shared_rate_limiter(settings: Settings) -> RedisRateLimiter | None:
    """On Redis, every gateway counts a caller's requests together; else each process counts its own."""
    if settings.redis_url is None:
        return None
    return RedisRateLimiter(settings.redis_url.get_secret_value(), settings.redis_namespace,
                            settings.gateway_rate_per_minute, settings.gateway_rate_burst)


def gateway_services(runtime: Runtime, transcriber: Transcriber | None = None) -> GatewayServices:
    return GatewayServices(runtime.sessions, runtime.jobs, runtime.approvals, runtime.memory, runtime.identities,
                           SqlConversationIndex(runtime.db), runtime.usage, runtime.tasks, runtime.skills,
                           deliveries=runtime.deliveries.store, turns=runtime.loop, traces=runtime.traces,
                           usage_report=SqlUsageStore(runtime.db), transcriber=transcriber)


async def serve(settings: Settings, model: ModelClient, keys: ApiKeys, host: str, port: int,
                on_ready: Callable[[Listening], None], *, turns: bool = True) -> int:
    """Serve until SIGINT or SIGTERM; 0 after a clean stop, 1 if the start failed. `turns`: run the
    turns and background jobs here too; False leaves them to `ember worker` processes."""
    if not turns:
        require_shared_bus(settings, "ember serve --workers 0")
    from ember.app.model_probe import unreachable_models

    sock = bind(host, port)
    # Asked once, bounded: a dead model is said at start, and the gateway serves anyway.
    listening = Listening(host, sock.getsockname()[1], keys.count, await unreachable_models(settings))
    try:
        runtime = await configured_runtime(settings, model)
        router = turn_router(settings, runtime, CHANNEL)
        runtime.channels.register(router)
        channel_routes = webhook_channels(settings, runtime)
        transcriber = configured_transcriber(settings, demo=model.name == DEMO_NAME)
        channel_routes += chat_channels(settings, runtime, settings.gateway_public_url, transcriber)
        if turns:  # else the workers fire the scheduled tasks
            runtime.channels.register(runtime.scheduler())
        a2a = await a2a_channel(settings, runtime, settings.gateway_public_url or f"http://{host}:{listening.port}")
        if a2a is not None:
            channel_routes += a2a.routes

        limiter = shared_rate_limiter(settings)

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with running(runtime, recover=True, turns=turns):
                on_ready(listening)
                try:
                    yield
                finally:
                    if a2a is not None:
                        await a2a.aclose()
                    if limiter is not None:
                        await limiter.aclose()

        options = gateway_options(settings, model, listening.model_problem, settings_view(settings, runtime))
        app = create_app(router, gateway_services(runtime, transcriber), keys, options, lifespan=lifespan,
                         channel_routes=channel_routes, limiter=limiter)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=settings.gateway_shutdown_grace_s)
        server = _Server(config)
        await server.serve(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
