"""A turn's trace as a person reads it (`ember trace show`)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from ember.core.traces import TurnTrace


def _clock(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def _ms(value: float) -> str:
    return f"{value:,.1f} ms"


def show_trace(trace: TurnTrace, out: Console) -> None:
    took = (trace.finished_at - trace.started_at) * 1000 if trace.finished_at else 0.0
    out.print(f"[bold]turn {trace.turn_id}[/bold]  session {trace.session_key}  status [bold]{trace.status}[/bold]  "
              f"started {_clock(trace.started_at)}  took {_ms(took)}", markup=True, highlight=False)
    if trace.error:
        out.print(f"error: {trace.error}", style="red", markup=False)
    detail = trace.detail
    if stages := detail.get("stages"):
        out.print("stages: " + " · ".join(f"{s['stage']} {_ms(s['duration_ms'])}" for s in stages), markup=False)
    if calls := detail.get("model_calls"):
        table = Table("model call", "model", "duration", "tokens in / out", "tool calls", title=None)
        for n, call in enumerate(calls, 1):
            table.add_row(str(n), call["model"], _ms(call["duration_ms"]),
                          f"{call['input_tokens']} / {call['output_tokens']}", str(call["tool_calls"]))
        out.print(table)
        for n, call in enumerate(calls, 1):
            for reason in call.get("passed_over", ()):
                out.print(f"  model call {n} passed over {reason}", markup=False, highlight=False)
    approvals = {a["call_id"]: a for a in detail.get("approvals", [])}
    if tools := detail.get("tool_calls"):
        table = Table("tool", "arguments", "duration", "result", "approval")
        for call in tools:
            table.add_row(call["name"], _compact(call["arguments"]), _ms(call["duration_ms"]),
                          f"{call['result_chars']} chars" + (" (error)" if call["error"] else ""),
                          _approval(approvals.pop(call["call_id"], None)))
        out.print(table)
    for approval in approvals.values():  # decided, but the call never ran (e.g. the turn was stopped)
        out.print(f"approval for {approval['tool']}: {_approval(approval)}", markup=False)


def _approval(approval: dict[str, Any] | None) -> str:
    if approval is None:
        return "-"
    reason = f" ({approval['reason']})" if approval.get("reason") else ""
    return f"{approval['decision']} by {approval['decided_by']} at {_clock(approval['decided_at'])}{reason}"


def _compact(arguments: Any, limit: int = 80) -> str:
    text = json.dumps(arguments, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"
