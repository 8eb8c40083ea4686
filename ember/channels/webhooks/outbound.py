"""The `outbound` channel: answers POSTed as signed JSON to `[outbound.NAME]` targets.

An answer's route names its target (`ReplyRoute("outbound", "ops")`). It is
signed the Standard Webhooks way with the outbox's delivery id as
`webhook-id`, so a receiver that dedupes shows each answer once however often
it is re-sent. 5xx, 408, 429 and network failures are retried with backoff
(429's Retry-After honoured); any other 4xx is recorded as given up. The
address rules of `web_fetch` apply unless the host is allowed there.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from ember import __version__
from ember.channels.webhooks.config import OutboundSpec
from ember.channels.webhooks.signing import sign_standard
from ember.core.channels import ChannelCapabilities, DeliveryRefused
from ember.core.events import OutboundEvent, OutboundKind
from ember.tools.web import AddressRefused, checked_target

CHANNEL = "outbound"
MAX_RETRY_AFTER_S = 60.0
_RETRIED_STATUS = frozenset({408, 425, 429})

log = logging.getLogger(__name__)


class TargetUnavailable(Exception):
    """This attempt failed in a way worth another (5xx, 429, timeout, no connection)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def payload(event: OutboundEvent, message_id: str, now: float) -> bytes:
    return json.dumps({
        "type": "ember.answer" if event.kind is OutboundKind.FINAL else "ember.error",
        "delivery_id": message_id,
        "turn_id": event.turn_id,
        "reply_to": event.reply_to,
        "text": event.text,
        "timestamp": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"),
    }, ensure_ascii=False).encode()


def _origin(url: str) -> str:
    """What logs and records show of a target's URL: its path may hold a token (chat webhooks' do)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    return min(float(value), MAX_RETRY_AFTER_S) if value.isdigit() else None


class OutboundWebhooks:
    name = CHANNEL
    capabilities = ChannelCapabilities(confirms_delivery=True)

    def __init__(self, targets: Mapping[str, OutboundSpec], *, allow_private: bool = False,
                 allowed_hosts: frozenset[str] = frozenset(), backoff_base_s: float = 0.5,
                 clock: Callable[[], float] = time.time) -> None:
        self._targets = dict(targets)
        self._keys = {name: spec.key() for name, spec in targets.items()}
        self._allow_private = allow_private
        self._allowed_hosts = allowed_hosts
        self._backoff_base_s = backoff_base_s
        self._clock = clock
        self._clients: dict[str, httpx.AsyncClient] = {}

    async def start(self) -> None:
        # One client per target: a pooled connection never carries one host's TLS session to another.
        self._clients = {name: httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=spec.timeout_s,
                                                 headers={"User-Agent": f"Ember/{__version__} webhooks"})
                         for name, spec in self._targets.items()}

    async def stop(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients = {}

    async def deliver(self, event: OutboundEvent) -> None:
        if event.kind not in (OutboundKind.FINAL, OutboundKind.ERROR):
            return  # a target gets answers, not drafts or tool steps
        spec = self._targets.get(event.chat_id)
        if spec is None:
            raise DeliveryRefused(f"no [outbound.{event.chat_id}] target is configured")
        message_id = event.delivery_id or f"{event.turn_id}:{event.kind}"
        retrying = AsyncRetrying(stop=stop_after_attempt(spec.max_attempts), wait=self._wait,
                                 retry=retry_if_exception_type(TargetUnavailable), reraise=True)
        async for attempt in retrying:
            with attempt:
                await self._post(event.chat_id, spec, event, message_id)

    def _wait(self, state: RetryCallState) -> float:
        failure = state.outcome.exception() if state.outcome else None
        if isinstance(failure, TargetUnavailable) and failure.retry_after_s is not None:
            return failure.retry_after_s
        return min(self._backoff_base_s * 2 ** (state.attempt_number - 1), 30.0)

    async def _post(self, name: str, spec: OutboundSpec, event: OutboundEvent, message_id: str) -> None:
        try:
            target = await checked_target(spec.url, allow_private=self._allow_private,
                                          allowed_hosts=self._allowed_hosts)
        except AddressRefused:
            raise DeliveryRefused(f"[outbound.{name}] {_origin(spec.url)} is not a public address; allow its host "
                                  "in web_fetch_allowed_hosts to send there") from None
        except Exception:  # the host did not resolve: maybe a passing DNS failure
            raise TargetUnavailable(f"[outbound.{name}] could not resolve {_origin(spec.url)}") from None
        now = self._clock()
        body = payload(event, message_id, now)
        headers = {"Content-Type": "application/json", "Host": target.url.netloc.decode("ascii"),
                   "webhook-id": message_id, "webhook-timestamp": str(int(now))}
        key = self._keys[name]
        if key is not None:
            headers["webhook-signature"] = sign_standard(key, message_id, int(now), body)
        sni = {"sni_hostname": target.host.rstrip(".")} if target.url.scheme == "https" else {}
        client = self._clients[name]
        failures = []
        for address in target.addresses:
            request = client.build_request("POST", target.request_url(address), content=body, headers=headers,
                                           extensions=sni)
            try:
                response = await client.send(request)
                break
            except httpx.ConnectError as exc:
                failures.append(f"{address}: {exc or type(exc).__name__}")
            except httpx.TransportError as exc:
                raise TargetUnavailable(f"{_origin(spec.url)}: {type(exc).__name__}") from None
        else:
            raise TargetUnavailable(f"could not connect to {target.host} ({'; '.join(failures)})")
        if response.is_success:
            return
        status = (f"[outbound.{name}] {_origin(spec.url)} answered "
                  f"{response.status_code} {response.reason_phrase}").rstrip()
        if response.status_code >= 500 or response.status_code in _RETRIED_STATUS:
            log.info("%s; delivery %s will be tried again", status, message_id)
            raise TargetUnavailable(status, _retry_after(response))
        raise DeliveryRefused(status)
