"""Approval requests in flight: sent through the turn's channel, answered by id.

A turn's approver publishes an APPROVAL_REQUEST to the channel the turn came
from and waits; the channel (the terminal's prompt, the gateway's
`POST /api/approvals/{id}`) resolves it. Silence past the timeout, or a channel
that cannot ask, is a denial. With an explainer, the approval model's plain-words
reading and risk rating of the call go with the request (tools/explain.py).

Each request is also a row (store/approvals.py), kept pending across a restart
for its timeout, counted from when it was asked: it is still listed, and a turn
resumed after the restart that makes the same call (tool and summary) takes the
request up again, same id, or the answer given to it meanwhile. An answer after
the timeout, or after the turn ended unresumed (stopped, or answered with the
notice), is told the request expired, never that it is unknown. Only the turn's
own scope (a session, or a caller's namespace of them) sees and answers a
request. Where several processes share the store (`SharedApprovalBroker`), the
turn may wait in a worker while the answer comes to a gateway: the gateway closes
the row, and the waiting turn, which reads its row every `SHARED_POLL_S`, takes
the decision from it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from dataclasses import dataclass, replace

from ember.bus.base import OutboundPublisher
from ember.bus.codec import decode_approval, encode_approval
from ember.core.approvals import ApprovalRow, ApprovalStatus, AskedBefore
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.tasks import CHANNEL as TASK_CHANNEL
from ember.core.tools import ApprovalRequest, Decision, ToolAction, Verdict
from ember.store.protocols import ApprovalLog
from ember.tools.explain import ApprovalExplainer

log = logging.getLogger(__name__)

SHARED_POLL_S = 0.25


class Resolution(enum.Enum):
    RESOLVED = "resolved"
    NOT_FOUND = "not_found"  # unknown, or not the caller's to answer
    ALREADY_DECIDED = "already_decided"
    EXPIRED = "expired"  # timed out, or its turn ended without it


@dataclass(slots=True)
class _Pending:
    request: ApprovalRequest
    answer: asyncio.Future[Verdict]


class ApprovalBroker:
    def __init__(self, bus: OutboundPublisher, timeout_s: float, explainer: ApprovalExplainer | None = None,
                 store: ApprovalLog | None = None) -> None:
        self._bus = bus
        self._timeout_s = timeout_s
        self._explainer = explainer
        self._store = store
        self._pending: dict[str, _Pending] = {}

    async def recover(self) -> None:
        """At start: the requests past their timeout are expired. The younger ones stay pending for
        the turns that resume (or, on a shared store, still wait in other processes)."""
        if self._store is None:
            return
        expired = await self._store.expire_pending(older_than_s=self._timeout_s)
        if expired:
            log.info("%d approval request(s) left by the last run are expired", expired)

    def for_turn(self, event: InboundEvent, turn_id: str, identity: str, *, resumed: bool = False) -> TurnApprover:
        return TurnApprover(self, event, turn_id, identity, resumed=resumed)

    async def turn_ended(self, turn_id: str, why: str) -> None:
        """`turn_id` ended without the answers it asked for (stopped, or not resumed): they are expired."""
        if self._store is not None:
            await self._store.expire_turn(turn_id, why)

    async def pending(self, scope: str) -> list[ApprovalRequest]:
        """The requests waiting within `scope`: this process's turns', and those kept in the store
        (turns waiting in other processes, or to be resumed after a restart)."""
        requests = [p.request for p in self._pending.values()]
        if self._store is not None:
            for payload in await self._store.pending_requests(since=time.time() - self._timeout_s):
                try:
                    request = decode_approval(payload)
                except ValueError:  # written by a newer Ember: its own process lists it
                    continue
                if request.id not in self._pending:
                    requests.append(request)
        return [request for request in requests if _within(request.session_key, scope)]

    async def resolve(self, approval_id: str, decision: Decision, *, by: str, scope: str) -> Resolution:
        """Answer a request if its session is within `scope` (a session key, or a
        namespace ending in ':'): another caller's request does not exist for it."""
        pending = self._pending.get(approval_id)
        if pending is not None and _within(pending.request.session_key, scope):
            if pending.answer.done():
                return Resolution.ALREADY_DECIDED
            pending.answer.set_result(Verdict(decision, f"user:{by}", time.time()))
            return Resolution.RESOLVED
        row = await self._store.get(approval_id) if self._store is not None else None
        if row is None or not _within(row.session_key, scope):
            return Resolution.NOT_FOUND
        if row.status == ApprovalStatus.PENDING:  # its turn waits in another process, or resumes after a restart
            assert self._store is not None
            if await self._store.closed(approval_id, decision.value, f"user:{by}"):
                # a resumed turn may have taken the request up while the row was being closed
                self._answered(approval_id, Verdict(decision, f"user:{by}", time.time()))
                return Resolution.RESOLVED
            row = await self._store.get(approval_id) or row
        return Resolution.EXPIRED if row.status == ApprovalStatus.EXPIRED else Resolution.ALREADY_DECIDED

    async def ask(self, event: InboundEvent, turn_id: str, identity: str, action: ToolAction,
                  taken: set[str] | None = None) -> Verdict:
        """The person's answer to `action`. A resumed turn passes `taken`, the requests it has taken
        up so far: one it made for this call before it was cut off is taken up (again) first,
        though the resumed turn's channel may not say it can ask: it could, and the person sees
        the request listed."""
        before = await self._asked_before(turn_id, action, taken) if taken is not None else None
        if before is not None and before.status != ApprovalStatus.PENDING:
            return Verdict(Decision(before.status), before.decided_by or "user", time.time())
        if before is None and not event.can_approve:
            if event.channel == TASK_CHANNEL and event.metadata.get("grant_approvals") == "true":
                # a scheduled task's person granted its runs what would ask them
                return Verdict(Decision.APPROVE_ONCE, "task grant", time.time(),
                               "the scheduled task was created with approval granted")
            return Verdict(Decision.DENY, "channel", time.time(),
                           f"it needs approval, and the {event.channel} channel cannot ask for it")
        explanation = await self._explainer.explain(action) if self._explainer is not None else None
        timeout_s = self._timeout_s if before is None else before.created_at + self._timeout_s - time.time()
        request = ApprovalRequest(id=before.id if before else uuid.uuid4().hex, session_key=event.session_key,
                                  turn_id=turn_id, action=action, timeout_s=timeout_s, explanation=explanation)
        if self._store is not None and before is None:
            await self._store.opened(request.id, request.session_key, turn_id, identity, action.tool, action.summary,
                                     encode_approval(request))
        pending = _Pending(request, asyncio.get_running_loop().create_future())
        self._pending[request.id] = pending
        text = f"Allow Ember to {action.summary}? ({action.risk.value})"
        verdict = Verdict(Decision.DENY, "cancelled", time.time(), "the turn stopped while it waited")
        try:
            if before is not None:  # answered in the store while this turn was reading it?
                await self._answered_meanwhile(request.id)
            if not pending.answer.done():
                await self._bus.publish_outbound(OutboundEvent(
                    channel=event.route.channel, chat_id=event.route.chat_id, kind=OutboundKind.APPROVAL_REQUEST,
                    text=f"{text}\n{explanation.line()}" if explanation else text, turn_id=turn_id,
                    reply_to=event.message_id, approval=request,
                ))
            async with asyncio.timeout(timeout_s):
                verdict = replace(await self._answer(pending), explanation=explanation)
        except TimeoutError:
            verdict = Verdict(Decision.DENY, "timeout", time.time(),
                              f"nobody answered the approval request within {self._timeout_s:g} s", explanation)
        finally:
            del self._pending[request.id]
            # A turn cancelled while it waits (Ember stopping) leaves its request pending, for the
            # turn to take up when it resumes; a person's stop expires it (turn_ended).
            if self._store is not None and verdict.decided_by != "cancelled":
                status = ApprovalStatus.EXPIRED if verdict.decided_by == "timeout" else verdict.decision.value
                await asyncio.shield(self._store.closed(request.id, status, verdict.decided_by))
        return verdict

    async def _asked_before(self, turn_id: str, action: ToolAction, taken: set[str]) -> AskedBefore | None:
        """The oldest request the turn made for this call, before it was cut off, not taken up yet
        and not expired: answered meanwhile, or still pending within its timeout."""
        if self._store is None:
            return None
        since = time.time() - self._timeout_s
        for row in await self._store.asked_before(turn_id, action.tool, action.summary, since=since):
            if row.id not in taken and row.status != ApprovalStatus.EXPIRED:
                taken.add(row.id)
                return row
        return None

    def _answered(self, approval_id: str, verdict: Verdict) -> None:
        pending = self._pending.get(approval_id)
        if pending is not None and not pending.answer.done():
            pending.answer.set_result(verdict)

    async def _answered_meanwhile(self, approval_id: str) -> None:
        """Take up an answer closed into the request's row before this turn was listening."""
        assert self._store is not None
        verdict = _closed_verdict(await self._store.get(approval_id), "user")
        if verdict is not None:
            self._answered(approval_id, verdict)

    async def _answer(self, pending: _Pending) -> Verdict:
        """The answer given to this process."""
        return await pending.answer


class SharedApprovalBroker(ApprovalBroker):
    """The broker of a process that shares its store with others: a turn waiting here takes the
    answer given to another process (a gateway) from the request's row."""

    def __init__(self, bus: OutboundPublisher, timeout_s: float, explainer: ApprovalExplainer | None,
                 store: ApprovalLog) -> None:
        super().__init__(bus, timeout_s, explainer, store)
        self._rows = store

    async def _answer(self, pending: _Pending) -> Verdict:
        while not pending.answer.done():
            await asyncio.wait({pending.answer}, timeout=SHARED_POLL_S)
            verdict = _closed_verdict(await self._rows.get(pending.request.id), "another process")
            if verdict is not None and not pending.answer.done():
                return verdict
        return pending.answer.result()


def _closed_verdict(row: ApprovalRow | None, by: str) -> Verdict | None:
    """The answer a request's row was closed with, if it is closed (expired: a denial)."""
    if row is None or row.status == ApprovalStatus.PENDING:
        return None
    decision = Decision.DENY if row.status == ApprovalStatus.EXPIRED else Decision(row.status)
    return Verdict(decision, row.decided_by or by, time.time())


def _within(session_key: str, scope: str) -> bool:
    return session_key == scope or (scope.endswith(":") and session_key.startswith(scope))


class TurnApprover:
    """The Approver of one turn: asks through the channel the turn came from."""

    def __init__(self, broker: ApprovalBroker, event: InboundEvent, turn_id: str, identity: str, *,
                 resumed: bool = False) -> None:
        self._broker = broker
        self._event = event
        self._turn_id = turn_id
        self._identity = identity
        self._taken: set[str] | None = set() if resumed else None

    async def approve(self, action: ToolAction) -> Verdict:
        return await self._broker.ask(self._event, self._turn_id, self._identity, action, self._taken)
