"""Approvals answered by typing, for platforms without buttons (the WeCom app, Official Accounts, the
smart bot, QQ): a request is shown with a short id, and `/approve ID`, `/always ID` or `/deny ID` answers it.

Only the request's person (their identity, as `Identities` resolves the sender) or a configured approver
may answer. Short ids count up per channel across restarts (QQ shows a prefix of the request's id
instead); the last ones are kept in memory, and a request's own id works as well.
"""

from __future__ import annotations

import re

from ember.channels.chat.inbound import remember
from ember.channels.chat.services import ChatServices
from ember.core.events import OutboundEvent
from ember.core.tools import Decision
from ember.runtime.approvals import Resolution

_COMMAND = re.compile(r"[/／](approve|always|deny)\s+(\S+)", re.IGNORECASE)
DECISIONS = {"approve": Decision.APPROVE_ONCE, "always": Decision.APPROVE_SESSION, "deny": Decision.DENY}
DECIDED = {Decision.APPROVE_ONCE: "Allowed once.", Decision.APPROVE_SESSION: "Allowed for the rest of this "
           "conversation.", Decision.DENY: "Denied."}


def command(text: str) -> tuple[str, str] | None:
    """(verb, id) when `text` is an approval command, else None."""
    found = _COMMAND.fullmatch(text.strip())
    return (found[1].lower(), found[2]) if found else None


def hint(short: str) -> str:
    return (f"\n\n/always {short} allows it for the rest of this conversation.\n"
            f"Reply /approve {short} or /deny {short}")


class ApprovalCommands:
    def __init__(self, channel: str, services: ChatServices, approvers: frozenset[str]) -> None:
        self._channel = channel
        self._approvals = services.approvals
        self._rows = services.approval_rows
        self._identities = services.identities
        self._messages = services.messages
        self._approvers = approvers
        self._short_ids: dict[str, str] = {}  # "7" -> the approval request's id

    async def short_id(self, event: OutboundEvent) -> str:
        """A new short id for the request `event` carries."""
        assert event.approval is not None
        short = str(await self._messages.next_counter(self._channel, "approval"))
        remember(self._short_ids, short, event.approval.id)
        return short

    async def answer(self, sender: str, verb: str, ref: str) -> str:
        """Resolve the request `ref` names, if `sender` may; the text that answers the command."""
        approval_id = self._short_ids.get(ref, ref)
        row = await self._rows.get(approval_id)
        if row is None:
            return f"No approval request {ref} is waiting (those from before a restart have expired)."
        if self._identities.resolve(self._channel, sender) != row.identity and sender not in self._approvers:
            return "This request is not yours to answer."
        decision = DECISIONS[verb]
        outcome = await self._approvals.resolve(approval_id, decision, by=f"{self._channel}:{sender}",
                                                scope=row.session_key)
        if outcome is Resolution.RESOLVED:
            return DECIDED[decision]
        if outcome is Resolution.EXPIRED:
            return "This request expired before it was answered (it timed out, or Ember restarted); nothing ran."
        return "This request was answered already."
