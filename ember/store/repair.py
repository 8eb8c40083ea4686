"""Planning the repair that makes a stored window protocol-valid (I3).

Pure: given the parsed window, say which synthetic tool results close an
interrupted tool call and which rows must be set aside. The store writes the
plan back, so the repair happens once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ember.core.messages import Message, Role


@dataclass(slots=True)
class RepairPlan:
    synthetic: list[Message] = field(default_factory=list)
    quarantine: list[tuple[Message, str]] = field(default_factory=list)

    @property
    def needed(self) -> bool:
        return bool(self.synthetic or self.quarantine)


def plan_repair(window: list[Message], next_seq: int, interrupted_text: str) -> RepairPlan:
    """Every assistant `tool_calls` message must be followed by one result per
    call, and every tool result must follow its call.

    Missing results are written into the free seqs right after the chain (the
    end of the session, or the gap a quarantined row left). A chain with no
    room to close is set aside whole, as is a result without its call.
    """
    plan = RepairPlan()
    i = 0
    while i < len(window):
        message = window[i]
        if message.role is Role.TOOL:
            plan.quarantine.append((message, "tool result without its tool call"))
            i += 1
            continue
        if not message.has_tool_calls:
            i += 1
            continue
        call_ids = [call.id for call in message.tool_calls]
        answered: set[str] = set()
        j = i + 1
        while j < len(window):
            candidate = window[j]
            if candidate.role is not Role.TOOL or candidate.tool_call_id not in call_ids:
                break
            if candidate.tool_call_id in answered:
                break
            answered.add(candidate.tool_call_id or "")
            j += 1
        missing = [call_id for call_id in call_ids if call_id not in answered]
        if missing:
            last_seq = window[j - 1].seq or 0
            room = (window[j].seq or 0) - last_seq - 1 if j < len(window) else len(missing)
            if room >= len(missing):
                plan.synthetic.extend(
                    replace(Message.tool_result(call_id, interrupted_text, turn_id=message.turn_id), seq=last_seq + 1 + k)
                    for k, call_id in enumerate(missing)
                )
            else:
                plan.quarantine.extend((m, "tool call chain whose results were lost") for m in window[i:j])
        i = j
    return plan
