"""A turn's trace as a person reads it (`ember trace show`)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ember.core.traces import TurnTrace


def _clock(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def _ms(value: float) -> str:
    return f"{value:,.1f} ms"


def trace_json(trace: TurnTrace, children: Mapping[str, TurnTrace]) -> dict[str, Any]:
    """The trace as `--json` prints it: each delegation with its turn's own trace, where it was kept."""
    detail = dict(trace.detail)
    if "delegations" in detail:
        detail["delegations"] = [{**d, "trace": trace_json(children[d["turn_id"]], children)}
                                 if d["turn_id"] in children else d for d in detail["delegations"]]
    return {"turn_id": trace.turn_id, "session": trace.session_key, "status": trace.status, "error": trace.error,
            "started_at": trace.started_at, "finished_at": trace.finished_at, **detail}


def show_trace(trace: TurnTrace, out: Console, children: Mapping[str, TurnTrace] | None = None) -> None:
    """`children`: the delegated turns' traces (delegated_traces), shown under the turn that asked."""
    out.print(Group(*_parts(trace, children or {})))


def _parts(trace: TurnTrace, children: Mapping[str, TurnTrace]) -> list[RenderableType]:
    took = (trace.finished_at - trace.started_at) * 1000 if trace.finished_at else 0.0
    parts: list[RenderableType] = [Text.from_markup(
        f"[bold]turn {trace.turn_id}[/bold]  session {trace.session_key}  status [bold]{trace.status}[/bold]  "
        f"started {_clock(trace.started_at)}  took {_ms(took)}")]
    if trace.error:
        parts.append(Text(f"error: {trace.error}", style="red"))
    detail = trace.detail
    if asked := detail.get("delegated_by"):
        parts.append(Text(f"delegated by turn {asked['turn_id']}: {asked['task']}"))
    if stages := detail.get("stages"):
        parts.append(Text("stages: " + " · ".join(f"{s['stage']} {_ms(s['duration_ms'])}" for s in stages)))
    if calls := detail.get("model_calls"):
        table = Table("model call", "model", "duration", "tokens in / out", "tool calls", title=None)
        for n, call in enumerate(calls, 1):
            table.add_row(str(n), call["model"], _ms(call["duration_ms"]),
                          f"{call['input_tokens']} / {call['output_tokens']}", str(call["tool_calls"]))
        parts.append(table)
        parts += [Text(f"  model call {n} passed over {reason}")
                  for n, call in enumerate(calls, 1) for reason in call.get("passed_over", ())]
    approvals = {a["call_id"]: a for a in detail.get("approvals", [])}
    if tools := detail.get("tool_calls"):
        table = Table("tool", "arguments", "duration", "result", "approval")
        for call in tools:
            table.add_row(call["name"], _compact(call["arguments"]), _ms(call["duration_ms"]),
                          f"{call['result_chars']} chars" + (" (error)" if call["error"] else ""),
                          _approval(approvals.pop(call["call_id"], None)))
        parts.append(table)
    # Decided, but the call never ran (e.g. the turn was stopped).
    parts += [Text(f"approval for {a['tool']}: {_approval(a)}") for a in approvals.values()]
    for delegation in detail.get("delegations", []):
        parts.append(Text(f"delegated to {delegation['agent'] or 'an agent'}: {delegation['status']}, "
                          f"{delegation['model_calls']} model calls, {delegation['input_tokens']} / "
                          f"{delegation['output_tokens']} tokens in / out (its own delegations' included)"))
        child = children.get(delegation["turn_id"])
        if child is not None:
            parts.append(Padding(Group(*_parts(child, children)), (0, 0, 0, 4)))
    return parts


def _approval(approval: dict[str, Any] | None) -> str:
    if approval is None:
        return "-"
    reason = f" ({approval['reason']})" if approval.get("reason") else ""
    return f"{approval['decision']} by {approval['decided_by']} at {_clock(approval['decided_at'])}{reason}"


def _compact(arguments: Any, limit: int = 80) -> str:
    text = json.dumps(arguments, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"
