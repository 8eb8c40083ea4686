"""`POST /webhooks/{name}`: a signed request becomes the agent's message.

The signature is the request's authentication (no bearer key). A verified
request is kept in the store before it is answered 202, so a crash after
the answer loses nothing; a replay of its message id is answered 200 from
there and never runs again. The turn's answer goes to the webhook's
`reply_to` target, or stays in the session's history.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.bus.base import InboundPublisher
from ember.channels.gateway.http import ApiError, read_body
from ember.channels.webhooks.config import WebhookSpec
from ember.channels.webhooks.outbound import CHANNEL as OUTBOUND
from ember.channels.webhooks.signing import SignatureError, verify_github, verify_standard
from ember.channels.webhooks.template import TemplateError, render
from ember.core.channels import ChannelCapabilities
from ember.core.events import InboundEvent, OutboundEvent, ReplyRoute
from ember.store.protocols import Inbox

CHANNEL = "webhook"
MAX_SESSION_CHARS = 128


def _session_name(text: str) -> str:
    """A rendered session template as a session name: one line, bounded."""
    name = " ".join("".join(c if c.isprintable() else " " for c in text).split())[:MAX_SESSION_CHARS]
    if not name:
        raise ApiError(422, "the session template gave an empty name for this payload", code="empty_session")
    return name


class WebhookChannel:
    name = CHANNEL
    capabilities = ChannelCapabilities()

    def __init__(self, bus: InboundPublisher, store: Inbox, webhooks: Mapping[str, WebhookSpec], *,
                 max_body_bytes: int, clock: Callable[[], float] = time.time) -> None:
        self._bus = bus
        self._store = store
        self._webhooks = dict(webhooks)
        self._keys = {name: spec.key() for name, spec in webhooks.items()}
        self._max_body_bytes = max_body_bytes
        self._clock = clock

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def deliver(self, event: OutboundEvent) -> None:
        """A webhook without `reply_to`: its answers are kept in the session's history only."""

    def routes(self) -> list[Route]:
        return [Route("/webhooks/{name}", self.receive, methods=["POST"])]

    async def receive(self, request: Request) -> Response:
        name = request.path_params["name"]
        spec = self._webhooks.get(name)
        if spec is None:
            raise ApiError(404, f"no webhook named {name[:64]!r} is configured", code="unknown_webhook")
        body = await read_body(request, self._max_body_bytes)
        try:
            if spec.scheme == "github":
                message_id = verify_github(self._keys[name], request.headers, body)
            else:
                message_id = verify_standard(self._keys[name], request.headers, body, now=self._clock())
        except SignatureError as exc:
            raise ApiError(401, f"webhook {name}: {exc}", code="invalid_signature") from exc
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        try:
            text = render(spec.message, payload).strip()
            session = _session_name(render(spec.session or name, payload))
        except TemplateError as exc:
            raise ApiError(422, f"webhook {name}: {exc}", code="missing_field") from None
        if not text:
            raise ApiError(422, f"webhook {name}: the message template gave an empty message", code="empty_message")
        event = InboundEvent(channel=CHANNEL, chat_id=f"{name}:{session}", sender_id=name, text=text,
                             message_id=message_id,
                             reply=ReplyRoute(OUTBOUND, spec.reply_to) if spec.reply_to else None)
        answer = {"message_id": message_id, "session": event.session_key}
        if not await self._store.accept(event):
            return JSONResponse({"status": "duplicate", **answer}, status_code=200)
        await self._bus.publish_inbound(event)
        return JSONResponse({"status": "accepted", **answer}, status_code=202)
