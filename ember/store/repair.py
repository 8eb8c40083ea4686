"""Planning the repair that makes a stored window protocol-valid (I3).

Pure: given the parsed window, say which synthetic tool results close an
interrupted tool call and which rows must be set aside. The store writes the
plan back, so the repair happens once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from ember.core.messages import Message, Role


@dataclass(slots=True)
class RepairPlan:
    synthetic: list[Message] = field(default_factory=list)
    quarantine: list[tuple[Message, str]] = field(default_factory=list)

    @property
    def needed(self) -> bool:
        return bool(self.synthetic or self.quarantine)


def plan_repair(window: list[Message], interrupted_text: str) -> RepairPlan:
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
        # A Counter, not a set: a model may repeat a call id within one step.
        unanswered = Counter(call.id for call in message.tool_calls)
        j = i + 1
        while j < len(window) and window[j].role is Role.TOOL and unanswered[window[j].tool_call_id or ""] > 0:
            unanswered[window[j].tool_call_id or ""] -= 1
            j += 1
        missing = list(unanswered.elements())
        if missing:
            last_seq = window[j - 1].seq or 0
            room = (window[j].seq or 0) - last_seq - 1 if j < len(window) else len(missing)
            if room >= len(missing):
                plan.synthetic.extend(
                    replace(Message.tool_result(call_id, interrupted_text, turn_id=message.turn_id), seq=seq)
                    for seq, call_id in enumerate(missing, start=last_seq + 1)
                )
            else:
                plan.quarantine.extend((m, "tool call chain whose results were lost") for m in window[i:j])
        i = j
    return plan
