"""A turn's journal: what it did and how long each part took, for its trace."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.core.redact import redact


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

    def stage(self, name: str, started: float) -> None:
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

    def approval(self, call_id: str, tool: str, subject: str, decision: str, decided_by: str, decided_at: float,
                 reason: str = "") -> None:
        self.approvals.append({"call_id": call_id, "tool": tool, "subject": redact(subject), "decision": decision,
                               "decided_by": decided_by, "decided_at": decided_at, "reason": reason})

    def as_dict(self) -> dict[str, Any]:
        return {"stages": self.stages, "model_calls": self.model_calls, "tool_calls": self.tool_calls,
                "approvals": self.approvals}


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
