"""The caller's recent turns over HTTP, each with what its trace recorded: stages, model
calls, tool calls and approvals, as `ember trace show` prints them.

Turns belong to sessions, and sessions to the caller's key (`namespace`): another
identity's turn does not exist for a caller (404, never 403). Each record is built
from named fields of the trace, which was redacted when it was recorded (the turn's
error, kept as the exception said it, is redacted here); nothing else of the turn
(its messages, a tool's output) is added.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.gateway.http import ApiError, checked_key, known_params, query_limit
from ember.channels.gateway.turns import namespace, session_key
from ember.core.redact import redact_text
from ember.core.traces import TurnTrace, delegated_traces
from ember.store.protocols import TraceReader

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
_LIST_PARAMS = ("limit", "session")


class ActivityApi:
    def __init__(self, traces: TraceReader) -> None:
        self._traces = traces

    def routes(self) -> list[Route]:
        return [
            Route("/api/activity", self.turns, methods=["GET"]),
            Route("/api/activity/{turn_id}", self.turn, methods=["GET"]),
        ]

    async def turns(self, request: Request) -> Response:
        """The caller's latest turns, newest first; `?session=KEY`: of that session only."""
        params = known_params(request, _LIST_PARAMS)
        limit = query_limit(params, DEFAULT_LIMIT, MAX_LIMIT)
        identity, key = request.state.identity, params.get("session")
        prefix = namespace(identity)
        only = session_key(identity, checked_key(key, "session")) if key is not None else None
        traces = await self._traces.recent(limit, only, prefix=prefix)
        return JSONResponse({"turns": [_item(trace, prefix) for trace in traces]})

    async def turn(self, request: Request) -> Response:
        turn_id, prefix = request.path_params["turn_id"], namespace(request.state.identity)
        trace = await self._traces.get(turn_id)
        if trace is None or not trace.session_key.startswith(prefix):
            raise ApiError(404, f"no turn {turn_id[:64]!r}; `GET /api/activity` lists yours", code="turn_not_found")
        return JSONResponse(_detail(trace, prefix, await delegated_traces(trace, self._traces.get)))


def _detail(trace: TurnTrace, prefix: str, children: Mapping[str, TurnTrace]) -> dict[str, Any]:
    """The turn as its page shows it; each task it delegated with that turn's own detail (a
    delegated turn is its asker's: it is seen only through it)."""
    detail = trace.detail
    delegations = [{**_delegation(d), "turn": _detail(children[d["turn_id"]], prefix, children)
                    if d["turn_id"] in children else None} for d in detail.get("delegations", [])]
    return {
        **_item(trace, prefix),
        "stages": [{"stage": s["stage"], "duration_ms": s["duration_ms"]} for s in detail.get("stages", [])],
        "model_calls": [_model_call(call) for call in detail.get("model_calls", [])],
        "tool_calls": [_tool_call(call) for call in detail.get("tool_calls", [])],
        "approvals": [_approval(approval) for approval in detail.get("approvals", [])],
        "progress": [{"tool": p["tool"], "at_ms": p["at_ms"], "note": p["note"]}
                     for p in detail.get("progress", [])],
        "delegations": delegations,
    }


def _item(trace: TurnTrace, prefix: str) -> dict[str, Any]:
    """A turn as the list shows it: how it ended, how long it took, and what it did, counted."""
    detail = trace.detail
    model_calls, tool_calls = detail.get("model_calls", []), detail.get("tool_calls", [])
    delegated = detail.get("delegations", [])  # their tokens count: the turn's cost rolls theirs up
    took = round((trace.finished_at - trace.started_at) * 1000, 1) if trace.finished_at else None
    return {
        "turn_id": trace.turn_id, "session": trace.session_key.removeprefix(prefix), "status": trace.status,
        "error": None if trace.error is None else redact_text(trace.error), "started_at": trace.started_at,
        "finished_at": trace.finished_at or None, "duration_ms": took,
        "summary": {
            "model_calls": len(model_calls), "tool_calls": len(tool_calls),
            "tool_errors": sum(1 for call in tool_calls if call["error"]),
            "input_tokens": sum(entry["input_tokens"] for entry in [*model_calls, *delegated]),
            "output_tokens": sum(entry["output_tokens"] for entry in [*model_calls, *delegated]),
            "delegations": len(delegated),
            "approvals": len(detail.get("approvals", [])),
        },
    }


def _model_call(call: dict[str, Any]) -> dict[str, Any]:
    """`passed_over`: the models a router tried or skipped before this one answered, each with why."""
    return {"model": call["model"], "duration_ms": call["duration_ms"], "input_tokens": call["input_tokens"],
            "output_tokens": call["output_tokens"], "tool_calls": call["tool_calls"],
            "passed_over": list(call.get("passed_over", []))}


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """The trace keeps a tool's arguments (redacted) and the size of its result, not the result itself."""
    return {"call_id": call["call_id"], "name": call["name"], "arguments": call["arguments"],
            "duration_ms": call["duration_ms"], "result_chars": call["result_chars"],
            "status": "error" if call["error"] else "ok"}


def _delegation(delegation: dict[str, Any]) -> dict[str, Any]:
    """What a delegated task cost (its own delegations' included), and how it ended."""
    return {key: delegation[key] for key in ("turn_id", "agent", "status", "model_calls", "input_tokens",
                                             "output_tokens")}


def _approval(approval: dict[str, Any]) -> dict[str, Any]:
    return {"call_id": approval["call_id"], "tool": approval["tool"], "subject": approval["subject"],
            "decision": approval["decision"], "decided_by": approval["decided_by"],
            "decided_at": approval["decided_at"], "reason": approval.get("reason", ""),
            "explanation": approval.get("explanation")}
