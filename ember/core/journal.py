"""What a turn did, told as it happens: the TurnObserver seam, and the journal that
keeps it all for the turn's trace row (OpenTelemetry is the other observer: runtime/telemetry.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ember.core.redact import redact


@dataclass(frozen=True, slots=True)
class ApprovalEvent:
    """A tool call's approval decision, as the observers are told it."""

    call_id: str
    tool: str
    subject: str
    decision: str
    decided_by: str
    decided_at: float
    reason: str = ""
    explanation: str | None = None  # the model's explanation the person was shown, if any


class TurnObserver(Protocol):
    def stage(self, name: str) -> AbstractContextManager[None]:
        """Around one stage of the turn (context, inference, response): timed, and a span."""
        ...

    def model_call(self, model: str, started: float, *, input_tokens: int, output_tokens: int,
                   tool_calls: int, passed_over: Sequence[str] = ()) -> None: ...

    def tool_call(self, call_id: str, name: str, arguments: str, started: float, result: str) -> None: ...

    def approval(self, event: ApprovalEvent) -> None: ...

    def tool_progress(self, tool: str, note: str) -> None:
        """A running tool's progress (another agent's answer as it streams in)."""
        ...


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

    def model_call(self, model: str, started: float, *, input_tokens: int, output_tokens: int,
                   tool_calls: int, passed_over: Sequence[str] = ()) -> None:
        for observer in self.observers:
            observer.model_call(model, started, input_tokens=input_tokens, output_tokens=output_tokens,
                                tool_calls=tool_calls, passed_over=passed_over)

    def tool_call(self, call_id: str, name: str, arguments: str, started: float, result: str) -> None:
        for observer in self.observers:
            observer.tool_call(call_id, name, arguments, started, result)

    def approval(self, event: ApprovalEvent) -> None:
        for observer in self.observers:
            observer.approval(event)

    def tool_progress(self, tool: str, note: str) -> None:
        for observer in self.observers:
            observer.tool_progress(tool, note)


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
    _started: float = field(default_factory=time.perf_counter)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.stages.append({"stage": name, "duration_ms": _ms_since(started)})

    def model_call(self, model: str, started: float, *, input_tokens: int, output_tokens: int,
                   tool_calls: int, passed_over: Sequence[str] = ()) -> None:
        """`passed_over`: the models a router tried or skipped before `model` answered, each with why."""
        call: dict[str, Any] = {"model": model, "duration_ms": _ms_since(started), "input_tokens": input_tokens,
                                "output_tokens": output_tokens, "tool_calls": tool_calls}
        if passed_over:
            call["passed_over"] = [redact(reason) for reason in passed_over]
        self.model_calls.append(call)

    def tool_call(self, call_id: str, name: str, arguments: str, started: float, result: str) -> None:
        self.tool_calls.append({"call_id": call_id, "name": name, "arguments": _arguments(arguments),
                                "duration_ms": _ms_since(started), "result_chars": len(result),
                                "error": result.startswith("Error:")})

    def approval(self, event: ApprovalEvent) -> None:
        entry = {"call_id": event.call_id, "tool": event.tool, "subject": redact(event.subject),
                 "decision": event.decision, "decided_by": event.decided_by, "decided_at": event.decided_at,
                 "reason": event.reason}
        if event.explanation:
            entry["explanation"] = redact(event.explanation)
        self.approvals.append(entry)

    def tool_progress(self, tool: str, note: str) -> None:
        self.progress.append({"tool": tool, "at_ms": _ms_since(self._started), "note": redact(note)})

    def as_dict(self) -> dict[str, Any]:
        return {"stages": self.stages, "model_calls": self.model_calls, "tool_calls": self.tool_calls,
                "approvals": self.approvals, **({"progress": self.progress} if self.progress else {})}


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
