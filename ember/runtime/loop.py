"""AgentLoop: takes inbound events off the bus and runs each as one turn.

    _on_inbound(event):
        hold the session lease (turns of one session run one at a time, in
        arrival order; different sessions run concurrently)
            ctx    = ContextStage.prepare(event)     user message committed
            result = InferenceStage.run(ctx)         model + tools, steps committed
            done   = ResponseStage.finalize(ctx, result)   the commit boundary
            publish the final only if not done.outbound_sent
        on an exception: publish exactly one error response
        on a cancellation: deliver the answer if it was committed, else one
            "interrupted" error
        record the turn's trace
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from ember.bus.base import Bus
from ember.core.errors import EmberError
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.journal import TurnJournal
from ember.core.leases import SessionLeases
from ember.core.messages import Role
from ember.core.tools import ToolRun
from ember.core.turn import PipelineContext
from ember.pipeline.context import ContextStage
from ember.pipeline.inference import InferenceStage
from ember.pipeline.response import ResponseStage
from ember.runtime.approvals import ApprovalBroker
from ember.runtime.streaming import StreamPublisher
from ember.runtime.tasks import cancel_task, stop_tasks
from ember.store.traces import SqlTraceStore, TurnTrace

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pipeline:
    context: ContextStage
    inference: InferenceStage
    response: ResponseStage


INTERRUPTED_TEXT = "Sorry, this turn was interrupted before it finished (Ember is shutting down)."


@dataclass(slots=True)
class _Progress:
    """How far a turn got, for a cancellation to report honestly."""

    ctx: PipelineContext | None = None
    delivered: bool = False

    def undelivered_answer(self, turn_id: str) -> str | None:
        """The turn's final answer when it was committed but not yet sent."""
        if self.ctx is None or self.delivered or not self.ctx.session.messages:
            return None
        last = self.ctx.session.messages[-1]
        final = last.role is Role.ASSISTANT and not last.tool_calls and last.turn_id == turn_id
        return last.content if final else None


def error_text(exc: BaseException, turn_id: str) -> str:
    if isinstance(exc, EmberError):
        return f"Sorry, I could not answer: {exc}"
    return f"Sorry, something went wrong inside Ember ({type(exc).__name__}). Turn id for the logs: {turn_id}"


class AgentLoop:
    def __init__(self, bus: Bus, leases: SessionLeases, pipeline: Pipeline, traces: SqlTraceStore,
                 approvals: ApprovalBroker) -> None:
        self._bus = bus
        self._leases = leases
        self._pipeline = pipeline
        self._traces = traces
        self._approvals = approvals
        self._turns: set[asyncio.Task[None]] = set()
        self._consumer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._consumer = asyncio.create_task(self._consume(), name="ember-agent-loop")

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop taking events; let turns in flight finish for `grace_s`, then cancel
        them (their committed steps stay committed)."""
        await cancel_task(self._consumer)
        self._consumer = None
        await stop_tasks(self._turns, grace_s)

    async def _consume(self) -> None:
        while True:
            event = await self._bus.next_inbound()
            task = asyncio.create_task(self._on_inbound(event), name=f"ember-turn-{event.session_key}")
            self._turns.add(task)
            task.add_done_callback(self._turns.discard)

    async def _on_inbound(self, event: InboundEvent) -> None:
        turn_id = uuid.uuid4().hex
        trace = TurnTrace(turn_id=turn_id, session_key=event.session_key, started_at=time.time())
        progress = _Progress()
        journal = TurnJournal()
        try:
            async with self._leases.hold(event.session_key):
                await self._run_turn(event, turn_id, journal, progress)
            trace.status = "ok"
        except asyncio.CancelledError:
            trace.status, trace.error = "cancelled", "the turn was stopped before it finished"
            answer = progress.undelivered_answer(turn_id)
            if answer is not None:  # committed before the cancel: deliver the record, not an error
                await self._publish(event, turn_id, OutboundKind.FINAL, answer, stream_full_text=True)
            elif not progress.delivered:
                await self._publish(event, turn_id, OutboundKind.ERROR, INTERRUPTED_TEXT)
            raise
        except Exception as exc:  # the loop's edge: one error response, logged once
            log.exception("turn %s of %s failed", turn_id, event.session_key)
            trace.status, trace.error = "failed", f"{type(exc).__name__}: {exc}"
            await self._publish(event, turn_id, OutboundKind.ERROR, error_text(exc, turn_id))
        finally:
            trace.detail.update(journal.as_dict())
            await self._record(trace)

    async def _record(self, trace: TurnTrace) -> None:
        trace.finished_at = time.time()
        try:
            await self._traces.record(trace)
        except SQLAlchemyError:
            log.warning("could not record the trace of turn %s", trace.turn_id, exc_info=True)

    async def _run_turn(self, event: InboundEvent, turn_id: str, journal: TurnJournal, progress: _Progress) -> None:
        def open_stream(prefix: str) -> StreamPublisher:
            return StreamPublisher(self._bus, event, turn_id, prefix=prefix)

        started = time.perf_counter()
        ctx = progress.ctx = await self._pipeline.context.prepare(event, turn_id, open_stream if event.stream else None)
        journal.stage("context", started)
        started = time.perf_counter()
        tools = ToolRun(event.session_key, turn_id, self._approvals.for_turn(event, turn_id), journal)
        result = await self._pipeline.inference.run(ctx, tools)
        journal.stage("inference", started)
        started = time.perf_counter()
        done = await self._pipeline.response.finalize(ctx, result)
        journal.stage("response", started)
        if not done.outbound_sent:
            await self._publish(event, turn_id, OutboundKind.FINAL, done.response_text)
        progress.delivered = True

    async def _publish(self, event: InboundEvent, turn_id: str, kind: OutboundKind, text: str,
                       *, stream_full_text: bool = False) -> None:
        await self._bus.publish_outbound(
            OutboundEvent(channel=event.channel, chat_id=event.chat_id, kind=kind, text=text,
                          turn_id=turn_id, reply_to=event.message_id, stream_full_text=stream_full_text)
        )
