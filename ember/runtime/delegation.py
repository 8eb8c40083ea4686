"""Delegated turns: the `delegate` tool's tasks, each a turn of its own in a session of its own.

A child turn runs inside its parent's tool call, in the parent's process and task: it takes no turn
slot, so parents waiting for their children can never hold every slot the children need. From there
it is a turn like any other: its question is committed with a receipt, its tool steps as they
happen, its answer with an outbox record, delivered at once (the delivery is its return to the
parent). Its trace is kept, under its parent's, which names it.

Its message id comes from the parent turn and the task, so a parent killed mid-child that resumes
and delegates the same task again finds the child's receipt: an answered child's answer comes back
as it was recorded, an unanswered one resumes from its committed steps. No committed step runs twice.

What it may do is never more than its parent may: its tools are the parent's, narrowed by the
task's `tools` and its agent's own set (no `delegate` at the depth limit); it works for the
parent's person (their workspace, budget and memory, or its agent's own memory with them); its
approvals are asked through the parent's approver, so they reach the person who asked, in their
chat. `[delegation]` bounds how deep, how many at once in one turn, how many tokens and how long.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, replace

from ember.core.delegation import CHANNEL, ChildAnswer, ChildTask
from ember.core.delivery import Delivery, DeliveryKind
from ember.core.errors import DuplicateMessage, LeaseLost
from ember.core.events import InboundEvent
from ember.core.journal import Delegated, TurnJournal
from ember.core.leases import KeyedLocks, SessionLeases
from ember.core.redact import redact_text
from ember.core.tools import Approver, ToolAction, ToolRun, Verdict
from ember.core.traces import TurnTrace
from ember.core.turn import PipelineContext
from ember.runtime.delivery import DeliveryWorker
from ember.runtime.loop import Pipeline
from ember.runtime.turn_state import error_text, record_trace
from ember.store.protocols import TraceLog
from ember.tools.base import ToolFailure
from ember.tools.delegate import NAME, DelegationSpec

log = logging.getLogger(__name__)


class ForTheAsker:
    """A child turn's approver: the parent's, with the request saying whose task asks."""

    def __init__(self, parent: Approver, who: str) -> None:
        self._parent = parent
        self._who = who

    async def approve(self, action: ToolAction) -> Verdict:
        return await self._parent.approve(replace(action, summary=f"{action.summary} ({self._who})"))


@dataclass(slots=True)
class _Child:
    """One child turn as it runs, for its trace."""

    event: InboundEvent
    turn_id: str
    journal: TurnJournal
    ctx: PipelineContext | None = None


class Delegations:
    """Runs the children of every turn in this process (the ChildTurns of the `delegate` tool)."""

    def __init__(self, leases: SessionLeases, deliveries: DeliveryWorker, traces: TraceLog,
                 limits: DelegationSpec) -> None:
        self._leases = leases
        self._deliveries = deliveries
        self._traces = traces
        self._limits = limits
        self._pipeline: Pipeline | None = None
        self._places = KeyedLocks(limits.max_concurrent)  # per parent turn

    def bind(self, pipeline: Pipeline) -> None:
        """The stages children run through: built after the tools, which include `delegate`."""
        self._pipeline = pipeline

    async def run(self, task: ChildTask, parent: ToolRun) -> ChildAnswer:
        if parent.depth >= self._limits.max_depth:
            raise ToolFailure(f"delegated tasks may nest {self._limits.max_depth} deep ([delegation] max_depth), "
                              "and this one is that deep already: do the task yourself")
        allowed = parent.offered if task.tools is None else parent.offered & set(task.tools)
        if unknown := sorted(set(task.tools or ()) - parent.offered):
            raise ToolFailure(f"tools {', '.join(map(repr, unknown))} are not yours to give; yours: "
                              f"{', '.join(sorted(parent.offered)) or 'none'}")
        if parent.depth + 1 >= self._limits.max_depth:
            allowed = allowed - {NAME}
        async with self._places.hold(parent.turn_id):
            return await self._run_child(child_event(task, parent), task, parent, allowed)

    async def _run_child(self, event: InboundEvent, task: ChildTask, parent: ToolRun,
                         allowed: frozenset[str]) -> ChildAnswer:
        child = _Child(event, uuid.uuid4().hex, TurnJournal())
        trace = TurnTrace(turn_id=child.turn_id, session_key=event.session_key, started_at=time.time())
        run = ToolRun(event.session_key, child.turn_id, ForTheAsker(parent.approver, whose_task(task)), child.journal,
                      parent.identity, depth=parent.depth + 1, asked_in=parent.conversation)
        try:
            async with self._leases.hold(event.session_key):
                answer = await self._bounded(child, run, allowed)
        except LeaseLost:
            raise
        except Exception as exc:  # its session's lease could not be taken: nothing of it ran
            answer = ChildAnswer(error_text(exc, child.turn_id), child.turn_id, failed=True)
        parent.spent.add(run.spent)
        status = "answered before" if answer.turn_id != child.turn_id else "failed" if answer.failed else "ok"
        if status != "answered before":  # else its trace was recorded when it answered
            await self._record(trace, child, parent, task, status)
        parent.observer.event(Delegated(answer.turn_id, task.agent, status, run.spent.model_calls,
                                        run.spent.input_tokens, run.spent.output_tokens))
        return answer

    async def _bounded(self, child: _Child, run: ToolRun, allowed: frozenset[str]) -> ChildAnswer:
        """The child's answer within its time; its failure, recorded as its answer, past it or on an error."""
        try:
            async with asyncio.timeout(self._limits.timeout_s):
                return await self._answer(child, run, allowed)
        except TimeoutError:
            return await self._failed(child, f"the delegated task ran past its {self._limits.timeout_s:g} s limit "
                                             "([delegation] timeout_s) and was stopped")
        except LeaseLost:
            raise
        except Exception as exc:  # the child's own failure is its parent's tool result, not the parent's crash
            log.exception("delegated turn %s failed", child.turn_id)
            return await self._failed(child, error_text(exc, child.turn_id))

    async def _answer(self, child: _Child, run: ToolRun, allowed: frozenset[str]) -> ChildAnswer:
        assert self._pipeline is not None, "Delegations.bind was not called"
        pipeline = self._pipeline
        try:
            child.ctx = await pipeline.context.prepare(child.event, child.turn_id)
        except DuplicateMessage:  # asked before: by this parent turn before it was cut off and resumed
            seen = await self._deliveries.store.receipt(CHANNEL, child.event.chat_id, child.event.message_id or "")
            assert seen is not None
            if seen.answered_at is not None:
                recorded = await self._deliveries.store.answer_of(seen.turn_id)
                if recorded is not None:
                    return ChildAnswer(recorded.text, seen.turn_id, failed=recorded.kind is DeliveryKind.ERROR)
            child.turn_id = seen.turn_id
            run = replace(run, turn_id=seen.turn_id)
            child.ctx = await pipeline.context.prepare(child.event, child.turn_id, resume=True)
        ctx = child.ctx
        run = replace(run, memory_identity=ctx.memory_identity or None)
        stage = pipeline.agents.get(ctx.agent or "", pipeline.inference).narrowed(allowed, "this delegated task")
        with child.journal.stage("inference"):
            result = await stage.run(ctx, run, token_budget=self._limits.token_budget)
        done = await pipeline.response.finalize(ctx, result)
        self._deliveries.delivered(done.delivery_id or "")
        return ChildAnswer(done.response_text, child.turn_id)

    async def _failed(self, child: _Child, text: str) -> ChildAnswer:
        """The failure recorded as the child's answer, when its question was: a parent asking again is told it."""
        if child.ctx is not None:
            await self._deliveries.store.record(child.event.session_key,
                                                Delivery.failing(child.event, turn_id=child.turn_id, text=text))
        return ChildAnswer(text, child.turn_id, failed=True)

    async def _record(self, trace: TurnTrace, child: _Child, parent: ToolRun, task: ChildTask, status: str) -> None:
        trace.turn_id, trace.status = child.turn_id, status
        trace.detail.update(child.journal.as_dict())
        trace.detail["delegated_by"] = {"turn_id": parent.turn_id, "session": parent.session_key,
                                        "agent": task.agent, "task": redact_text(task.task[:500])}
        await record_trace(self._traces, trace)


def whose_task(task: ChildTask) -> str:
    return f"for a task delegated to agent {task.agent}" if task.agent else "for a delegated task"


def child_event(task: ChildTask, parent: ToolRun) -> InboundEvent:
    """The child's message: the same task asked again by the same parent turn is the same message."""
    digest = hashlib.sha256("\0".join([parent.turn_id, task.agent or "", task.task,
                                       ",".join(task.tools or ("*",))]).encode()).hexdigest()[:24]
    return InboundEvent(channel=CHANNEL, chat_id=f"{parent.turn_id}.{digest[:8]}", sender_id=parent.identity,
                        text=task.task, message_id=digest, agent=task.agent)
