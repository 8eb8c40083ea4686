"""Approvals answered on a chat platform: by a button (`decided`, for every platform with buttons),
or by typing, for platforms without them (the WeCom app, Official Accounts, the smart bot, QQ,
DingTalk, email): a request is shown with a short id, and `/approve ID`, `/always ID` or `/deny ID`
answers it.

Only the request's person (their identity, as `Identities` resolves the sender) or a configured approver
may answer. Short ids count up per channel across restarts (QQ shows a prefix of the request's id
instead); the last ones are kept in memory, and a request's own id works as well.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ember.channels.chat.inbound import remember
from ember.channels.chat.services import ChatServices
from ember.core.events import OutboundEvent
from ember.core.tools import Decision
from ember.runtime.approvals import Resolution

_COMMAND = re.compile(r"[/／](approve|always|deny)\s+(\S+)", re.IGNORECASE)
DECISIONS = {"approve": Decision.APPROVE_ONCE, "always": Decision.APPROVE_SESSION, "deny": Decision.DENY}
DECIDED = {Decision.APPROVE_ONCE: "Allowed once.", Decision.APPROVE_SESSION: "Allowed for the rest of this "
           "conversation.", Decision.DENY: "Denied."}


NOT_YOURS = "This request is not yours to answer."
EXPIRED = "This request expired before it was answered (it timed out, or Ember restarted); nothing ran."
ANSWERED = "This request was answered already."


async def decided(services: ChatServices, channel: str, approvers: Collection[str], approval_id: str,
                  decision: Decision, user: str) -> Resolution | None:
    """Resolve the request as `user` decided, if it is theirs to answer (or they are an approver);
    None when it is not (or there is no such request)."""
    row = await services.approval_rows.get(approval_id)
    if row is None or (services.identities.resolve(channel, user) != row.identity and user not in approvers):
        return None
    return await services.approvals.resolve(approval_id, decision, by=f"{channel}:{user}", scope=row.session_key)


def outcome_note(outcome: Resolution, done: str) -> str:
    """What a request's card says once answered: `done` when this answer resolved it."""
    return done if outcome is Resolution.RESOLVED else EXPIRED if outcome is Resolution.EXPIRED else ANSWERED


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
        self._services = services
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
        if await self._services.approval_rows.get(approval_id) is None:
            return f"No approval request {ref} is waiting (those from before a restart have expired)."
        decision = DECISIONS[verb]
        outcome = await decided(self._services, self._channel, self._approvers, approval_id, decision, sender)
        return NOT_YOURS if outcome is None else outcome_note(outcome, DECIDED[decision])
