"""Ember's own API: sessions, their committed history, turns streamed as typed
Server-Sent Events (`delta`, `tool_call`, `tool_result`, `approval_request`,
`final`, `error`), and the answers to approval requests.

Every route sees only the caller's sessions: another identity's session does
not exist for it (404, never 403, so keys cannot be probed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.channels.gateway.http import (
    KEEPALIVE_S,
    SESSION_HEADER,
    SSE_HEADERS,
    SSE_KEEPALIVE,
    ApiError,
    checked_client_id,
    checked_key,
    evaluation_requested,
    next_event,
    read_json,
    sse,
)
from ember.channels.gateway.metrics import GatewayMetrics, TurnClock
from ember.channels.gateway.schemas import ApprovalAnswer, MessageRequest, SessionChange
from ember.channels.gateway.turns import (
    CHANNEL,
    IN_FLIGHT_TEXT,
    InFlight,
    TurnRequest,
    TurnRouter,
    UnknownAgent,
    namespace,
    session_key,
)
from ember.channels.gateway.uploads import Intake, uploads_weight
from ember.core.attachments import Attachment
from ember.core.delivery import Delivery, interleaved
from ember.core.errors import BusUnavailable
from ember.core.events import OutboundEvent, OutboundKind
from ember.core.messages import Message
from ember.core.tools import ApprovalRequest, Decision
from ember.core.turn import TurnControl
from ember.runtime.approvals import ApprovalBroker, Resolution
from ember.store.protocols import Inbox, SessionBrowser


def approval_payload(request: ApprovalRequest, identity: str) -> dict[str, Any]:
    action = request.action
    return {"id": request.id, "session": request.session_key.removeprefix(namespace(identity)),
            "tool": action.tool, "risk": action.risk.value, "subject": action.subject, "summary": action.summary,
            "timeout_s": request.timeout_s,
            "explanation": {"text": explained.text, "risk": explained.risk, "reason": explained.reason}
            if (explained := request.explanation) else None}


def event_payload(event: OutboundEvent, identity: str) -> dict[str, Any]:
    payload: dict[str, Any] = {"turn_id": event.turn_id, "text": event.text}
    if event.delivery_id is not None:
        payload["delivery_id"] = event.delivery_id
    if event.attachments:  # fetched from the session's attachments route
        payload["attachments"] = [attachment.to_dict() for attachment in event.attachments]
    if event.tool_call is not None:
        payload.update(call_id=event.tool_call.id, name=event.tool_call.name)
        if event.kind is OutboundKind.TOOL_CALL:
            payload["arguments"] = event.tool_call.arguments
    if event.approval is not None:
        payload.update(approval_payload(event.approval, identity))
    return payload


def message_payload(message: Message) -> dict[str, Any]:
    return {**message.to_json_dict(), "turn_id": message.turn_id, "kind": "message"}


def failure_payload(failure: Delivery, identity: str) -> dict[str, Any]:
    """How a turn that never answered ended, in the place of its answer."""
    asked = failure.reply_to or ""
    return {"seq": None, "role": "assistant", "content": failure.text, "tool_calls": [], "tool_call_id": None,
            "name": None, "attachments": [], "turn_id": failure.turn_id, "kind": "error",
            "message_id": asked.removeprefix(f"{identity}:") if asked.startswith(f"{identity}:") else None}


class NativeApi:
    def __init__(self, router: TurnRouter, sessions: SessionBrowser, approvals: ApprovalBroker,
                 metrics: GatewayMetrics, *, intake: Intake, approvers: frozenset[str] = frozenset(),
                 deliveries: Inbox | None = None, turns: TurnControl | None = None) -> None:
        self._router = router
        self._deliveries = deliveries
        self._turns = turns
        self._approvers = approvers
        self._sessions = sessions
        self._approvals = approvals
        self._metrics = metrics
        self._max_body_bytes = intake.max_body_bytes
        self._files = intake.allowance(uploads_weight)
        self._intake = intake

    def routes(self) -> list[Route]:
        return [
            Route("/api/sessions", self.list_sessions, methods=["GET"]),
            Route("/api/sessions/{key}/messages", self.messages, methods=["GET", "POST"]),
            Route("/api/sessions/{key}/stop", self.stop, methods=["POST"]),
            Route("/api/sessions/{key}", self.session, methods=["PATCH", "DELETE"]),
            Route("/api/approvals", self.pending_approvals, methods=["GET"]),
            Route("/api/approvals/{id}", self.answer_approval, methods=["POST"]),
        ]

    def _approval_scope(self, identity: str) -> str:
        """The sessions whose requests `identity` sees and answers: its own, or every gateway
        session for a configured approver."""
        return f"{CHANNEL}:" if identity in self._approvers else namespace(identity)

    async def pending_approvals(self, request: Request) -> Response:
        identity = request.state.identity
        pending = await self._approvals.pending(self._approval_scope(identity))
        return JSONResponse({"approvals": [approval_payload(r, identity) for r in pending]})

    async def answer_approval(self, request: Request) -> Response:
        identity = request.state.identity
        body = await read_json(request, ApprovalAnswer, self._max_body_bytes)
        approval_id = request.path_params["id"]
        outcome = await self._approvals.resolve(approval_id, Decision(body.decision), by=identity,
                                                scope=self._approval_scope(identity))
        if outcome is Resolution.NOT_FOUND:
            raise ApiError(404, f"no approval request {approval_id[:64]!r}; `GET /api/approvals` lists yours",
                           code="approval_not_found")
        if outcome is Resolution.EXPIRED:
            raise ApiError(410, "this approval request expired: nobody answered in time, or its turn ended "
                                "without it (stopped, or not resumed after Ember restarted); the call was not made",
                           code="approval_expired")
        if outcome is Resolution.ALREADY_DECIDED:
            raise ApiError(409, "this approval request was already answered", code="approval_decided")
        return JSONResponse({"id": approval_id, "decision": body.decision})

    async def list_sessions(self, request: Request) -> Response:
        """The caller's sessions, newest first; `?archived=true` lists those put away too."""
        prefix = namespace(request.state.identity)
        archived = request.query_params.get("archived", "false")
        if archived not in ("true", "false"):
            raise ApiError(400, f"archived must be true or false; it was {archived[:32]!r}",
                           code="invalid_parameter", param="archived")
        rows = await self._sessions.list_sessions(prefix, archived=archived == "true")
        return JSONResponse({"sessions": [
            {"key": row.key.removeprefix(prefix), "messages": row.message_count, "updated_at": row.updated_at,
             "title": row.title, "archived": row.archived}
            for row in rows
        ]})

    async def session(self, request: Request) -> Response:
        """PATCH renames a session or puts it away or back; DELETE puts it away (its history is kept)."""
        key = checked_key(request.path_params["key"], "session")
        if request.method == "DELETE":
            change = SessionChange(archived=True)
        else:
            change = await read_json(request, SessionChange, self._max_body_bytes)
        title = None if change.title is None else " ".join(change.title.split())
        if not await self._sessions.label(session_key(request.state.identity, key), title=title,
                                          archived=change.archived):
            raise ApiError(404, f"no session {key!r}", code="session_not_found")
        return JSONResponse({"key": key, "title": title, "archived": change.archived})

    async def messages(self, request: Request) -> Response:
        # One route for both methods, so a 405 on it names both in its Allow header.
        return await (self.send(request) if request.method == "POST" else self.history(request))

    async def history(self, request: Request) -> Response:
        key = checked_key(request.path_params["key"], "session")
        identity = request.state.identity
        full_key = session_key(identity, key)
        messages = await self._sessions.history(full_key)
        if not messages:
            raise ApiError(404, f"no session {key!r}", code="session_not_found")
        failures = await self._deliveries.failures(full_key) if self._deliveries is not None else []
        return JSONResponse({"key": key, "messages": [
            message_payload(entry) if isinstance(entry, Message) else failure_payload(entry, identity)
            for entry in interleaved(messages, failures)]})

    async def stop(self, request: Request) -> Response:
        """Stop the turn running in the session; its stream ends with the error that says so."""
        key = checked_key(request.path_params["key"], "session")
        full_key = session_key(request.state.identity, key)
        turn_id = await self._turns.stop_turn(full_key) if self._turns is not None else None
        if turn_id is None:
            if not await self._sessions.history(full_key):
                raise ApiError(404, f"no session {key!r}", code="session_not_found")
            raise ApiError(409, f"no turn is running in session {key!r}", code="no_running_turn")
        return JSONResponse({"key": key, "turn_id": turn_id, "status": "stopping"}, status_code=202)

    async def send(self, request: Request) -> Response:
        key = checked_key(request.path_params["key"], "session")
        body = await read_json(request, MessageRequest, self._max_body_bytes, self._files)
        if not body.text.strip() and not body.attachments:
            raise ApiError(422, "the message is empty", code="empty_message", param="text")
        files = self._intake.uploaded(body.attachments)
        if body.message_id is not None:
            checked_client_id(body.message_id, "message_id")
        if body.agent is not None and body.agent not in self._router.agents:
            raise ApiError(400, str(UnknownAgent(body.agent, self._router.agents)), code="unknown_agent", param="agent")
        evaluation = evaluation_requested(request)
        identity = request.state.identity
        if self._router.in_flight(identity, body.message_id):
            raise ApiError(409, IN_FLIGHT_TEXT, code="in_flight")
        text = await self._intake.heard(body.text, files)
        attachments = await self._intake.keep(session_key(identity, key), files)
        stream = self._stream(identity, key, body.model_copy(update={"text": text}), attachments,
                              self._metrics.clock("native"), evaluation)
        return StreamingResponse(stream, media_type="text/event-stream", headers={**SSE_HEADERS, SESSION_HEADER: key})

    async def _stream(self, identity: str, key: str, body: MessageRequest, attachments: tuple[Attachment, ...],
                      clock: TurnClock, evaluation: bool) -> AsyncIterator[bytes]:
        try:
            async with self._router.turn(TurnRequest(identity, key, body.text, stream=True, can_approve=True,
                                                     client_id=body.message_id, evaluation=evaluation,
                                                     agent=body.agent, attachments=attachments)) as queue:
                while True:
                    event = await next_event(queue, KEEPALIVE_S)
                    if event is None:
                        yield SSE_KEEPALIVE
                        continue
                    if event.kind is OutboundKind.DELTA:
                        clock.delta()
                    yield sse(event.kind.value, event_payload(event, identity))
                    if event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
                        clock.closed(event.kind.value)
                        return
        except InFlight:  # a twin request got in between the handler's check and here
            yield sse(OutboundKind.ERROR.value, {"turn_id": None, "text": IN_FLIGHT_TEXT, "code": "in_flight"})
        except BusUnavailable as exc:  # the message was not handed over: the client sends it again
            yield sse(OutboundKind.ERROR.value, {"turn_id": None, "text": str(exc), "code": "bus_unavailable"})
        finally:
            clock.abandoned()
