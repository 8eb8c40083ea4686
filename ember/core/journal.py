"""What a turn did, told as it happens: typed events through the TurnObserver seam, and the
journal that keeps them all for the turn's trace row (OpenTelemetry is the other observer:
runtime/telemetry.py). Both read the same events, so neither can be told less than the other."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, assert_never

from ember.core.redact import redact


@dataclass(frozen=True, slots=True)
class ModelCalled:
    """A model call answered. `passed_over`: the models a router tried or skipped before `model`, each with why."""

    model: str
    started: float  # time.perf_counter() when it was made
    input_tokens: int
    output_tokens: int
    tool_calls: int
    passed_over: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class ToolCalled:
    """A tool call returned (an error included: its result then starts with "Error:")."""

    call_id: str
    name: str
    arguments: str
    started: float  # time.perf_counter() when it was made
    result: str

    @property
    def failed(self) -> bool:
        return self.result.startswith("Error:")


@dataclass(frozen=True, slots=True)
class ApprovalEvent:
    """A tool call's approval decision."""

    call_id: str
    tool: str
    subject: str
    decision: str
    decided_by: str
    decided_at: float
    reason: str = ""
    explanation: str | None = None  # the model's explanation the person was shown, if any


@dataclass(frozen=True, slots=True)
class ToolProgress:
    """A running tool's progress (another agent's answer as it streams in)."""

    tool: str
    note: str


@dataclass(frozen=True, slots=True)
class Routed:
    """Which chain answers the turn ("simple" or "main", with `[model_roles] simple` set), and why."""

    chain: str
    why: str


@dataclass(frozen=True, slots=True)
class Delegated:
    """A delegated task's turn ended: its own trace holds its steps; here, what it cost (its own
    delegations' included) and how it ended ("ok", "failed", "answered before": a resumed parent
    asked again for a task already done)."""

    turn_id: str
    agent: str | None
    status: str
    model_calls: int
    input_tokens: int
    output_tokens: int


TurnEvent = ModelCalled | ToolCalled | ApprovalEvent | ToolProgress | Routed | Delegated


class TurnObserver(Protocol):
    def stage(self, name: str) -> AbstractContextManager[None]:
        """Around one stage of the turn (context, inference, response): timed, and a span."""
        ...

    def event(self, event: TurnEvent) -> None: ...


class Spans(Protocol):
    """Where turns and background jobs are traced beyond Ember's own table (OpenTelemetry)."""

    observer: TurnObserver

    def turn(self, turn_id: str, session_key: str) -> AbstractContextManager[None]: ...

    def job(self, kind: str, job_id: str, session_key: str | None,
            turn_id: str | None) -> AbstractContextManager[None]: ...


@dataclass(frozen=True, slots=True)
class Observers:
    """Several observers as one: each is told everything, in order."""

    observers: tuple[TurnObserver, ...]

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        with ExitStack() as stack:
            for observer in self.observers:
                stack.enter_context(observer.stage(name))
            yield

    def event(self, event: TurnEvent) -> None:
        for observer in self.observers:
            observer.event(event)


def _arguments(raw: str) -> Any:
    try:
        return redact(json.loads(raw or "{}"))
    except json.JSONDecodeError:
        return redact(raw)


@dataclass(slots=True)
class TurnJournal:
    """Appended to by the stages as the turn runs; stored whole in the turn's trace.

    Arguments and texts are redacted when recorded: a trace never holds a secret.
    """

    stages: list[dict[str, Any]] = field(default_factory=list)
    model_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    approvals: list[dict[str, Any]] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)
    routing: list[dict[str, str]] = field(default_factory=list)
    delegations: list[dict[str, Any]] = field(default_factory=list)
    _started: float = field(default_factory=time.perf_counter)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.stages.append({"stage": name, "duration_ms": _ms_since(started)})

    def event(self, event: TurnEvent) -> None:
        match event:
            case ModelCalled():
                call: dict[str, Any] = {
                    "model": event.model, "duration_ms": _ms_since(event.started),
                    "input_tokens": event.input_tokens, "output_tokens": event.output_tokens,
                    "tool_calls": event.tool_calls}
                if event.passed_over:
                    call["passed_over"] = [redact(reason) for reason in event.passed_over]
                self.model_calls.append(call)
            case ToolCalled():
                self.tool_calls.append({
                    "call_id": event.call_id, "name": event.name, "arguments": _arguments(event.arguments),
                    "duration_ms": _ms_since(event.started), "result_chars": len(event.result),
                    "error": event.failed})
            case ApprovalEvent():
                entry = {"call_id": event.call_id, "tool": event.tool, "subject": redact(event.subject),
                         "decision": event.decision, "decided_by": event.decided_by,
                         "decided_at": event.decided_at, "reason": event.reason}
                if event.explanation:
                    entry["explanation"] = redact(event.explanation)
                self.approvals.append(entry)
            case ToolProgress():
                self.progress.append({"tool": event.tool, "at_ms": _ms_since(self._started),
                                      "note": redact(event.note)})
            case Routed():
                self.routing.append({"chain": event.chain, "why": event.why})
            case Delegated():
                self.delegations.append({
                    "turn_id": event.turn_id, "agent": event.agent, "status": event.status,
                    "model_calls": event.model_calls, "input_tokens": event.input_tokens,
                    "output_tokens": event.output_tokens})
            case _:
                assert_never(event)

    def as_dict(self) -> dict[str, Any]:
        return {"stages": self.stages, "model_calls": self.model_calls, "tool_calls": self.tool_calls,
                "approvals": self.approvals, **({"progress": self.progress} if self.progress else {}),
                **({"routing": self.routing} if self.routing else {}),
                **({"delegations": self.delegations} if self.delegations else {})}


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
