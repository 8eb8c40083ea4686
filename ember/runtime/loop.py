"""AgentLoop: takes inbound events off the bus and runs each as one turn.

    _handle(event):
        wait, without a turn slot, while an earlier message of the session is
        not handled (another worker holds it, or a dead one did until it is
        taken over): a session's messages are answered in the order sent
    _on_inbound(event):
        hold the session lease (turns of one session run one at a time, in
        arrival order; different sessions run concurrently)
            the message was accepted before (a redelivery: its question's
            commit refuses it, or start-up recovery brings it)?
                answered:   re-send the recorded answer, same delivery id
                unanswered: its turn was cut off: resume it, or (after the
                            freshness window, or when a later message of
                            the session came meanwhile) answer with a notice
            ctx    = ContextStage.prepare(event)     user message + receipt committed
            result = InferenceStage.run(ctx)         model + tools, steps committed
            done   = ResponseStage.finalize(ctx, result)   answer + outbox record committed
            publish the final only if not done.outbound_sent
        on an exception: publish exactly one error response
        on LeaseLost (this process paused past its lease, and another took the
            session): nothing; the new holder answers the message
        on a cancellation: deliver the answer if it was committed, else one
            "interrupted" error; a person's stop (stop_turn) also records that
            error, so the history explains the question it leaves unanswered
        record the turn's trace (kept, and written with the others every
            TRACE_FLUSH_S and at stop: the turn does not wait for it)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

from ember.bus.base import Bus
from ember.core.channels import ChannelCapabilities
from ember.core.delivery import Delivery, Receipt, delivery_id
from ember.core.errors import DuplicateMessage, LeaseLost, StoreError
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.journal import Spans, TurnJournal
from ember.core.leases import SessionLeases
from ember.core.messages import Message
from ember.core.redact import redact_text
from ember.core.tools import ToolRun
from ember.core.traces import TurnTrace
from ember.pipeline.context import ContextStage
from ember.pipeline.inference import InferenceStage
from ember.pipeline.response import ResponseStage
from ember.runtime.approvals import ApprovalBroker
from ember.runtime.delivery import DeliveryWorker
from ember.runtime.redelivery import Redelivered, Redelivery, plan
from ember.runtime.streaming import StreamPublisher
from ember.runtime.tasks import cancel_task, stop_tasks
from ember.runtime.turn_slots import TurnSlots
from ember.runtime.turn_state import (
    INTERRUPTED_TEXT,
    NOT_RESUMED_TEXT,
    STOPPED_TEXT,
    TRACE_FLUSH_S,
    RecoveryPolicy,
    TurnState,
    error_text,
    record_trace,
)
from ember.store.protocols import SessionStore, TraceLog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pipeline:
    context: ContextStage
    inference: InferenceStage  # the default agent's
    response: ResponseStage
    agents: Mapping[str, InferenceStage] = field(default_factory=dict)  # each named agent's model and tools


class AgentLoop:
    def __init__(self, bus: Bus, leases: SessionLeases, sessions: SessionStore, pipeline: Pipeline,
                 traces: TraceLog, approvals: ApprovalBroker, deliveries: DeliveryWorker,
                 recovery: RecoveryPolicy, spans: Spans | None = None, *, max_turns: int = 64) -> None:
        self._bus = bus
        # Turns at once; beyond them, messages wait on the bus, where another worker may take them.
        self._slots = TurnSlots(bus, max_turns)
        self._spans = spans
        self._leases = leases
        self._sessions = sessions
        self._pipeline = pipeline
        self._traces = traces
        self._approvals = approvals
        self._deliveries = deliveries
        self._recovery = recovery
        self._turns: set[asyncio.Task[None]] = set()
        self._running: dict[str, tuple[TurnState, asyncio.Task[None]]] = {}  # by session key, under its lease
        # What a drain or a test waits on rather than a guessed time: set while no turn runs here;
        # how many turns have ended.
        self.idle = asyncio.Event()
        self.idle.set()
        self.turns_ended = 0
        self._consumer: asyncio.Task[None] | None = None
        self._stop_listener: asyncio.Task[None] | None = None
        self._trace_writer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._consumer = asyncio.create_task(self._consume(), name="ember-agent-loop")
        self._stop_listener = asyncio.create_task(self._listen_for_stops(), name="ember-stop-requests")
        self._trace_writer = asyncio.create_task(self._write_traces(), name="ember-traces")

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop taking events; let turns in flight finish for `grace_s`, then cancel
        them (their committed steps stay committed); then write the traces kept."""
        await cancel_task(self._consumer)
        await cancel_task(self._stop_listener)
        self._consumer = self._stop_listener = None
        await stop_tasks(self._turns, grace_s)
        await cancel_task(self._trace_writer)
        self._trace_writer = None
        await self._flush_traces()

    async def _write_traces(self) -> None:
        while True:
            await asyncio.sleep(TRACE_FLUSH_S)
            await self._flush_traces()

    async def _flush_traces(self) -> None:
        try:
            await self._traces.flush()
        except Exception:  # the writer's edge: the traces are kept for the next flush; turns go on
            log.warning("could not write the traces of recent turns; kept for the next try", exc_info=True)

    async def stop_turn(self, session_key: str) -> str | None:
        """Cancel the turn running in `session_key`, for the person who asked it: its committed
        steps stay, and the history records that it was stopped. In this process, or, on a bus
        other processes share, in the one that runs it. The turn's id, or None when no turn is
        running there."""
        stopped = self._stop_here(session_key)
        if stopped is not None:
            return stopped
        receipt = await self._deliveries.store.unanswered_in(session_key)
        if receipt is None or not await self._bus.publish_stop(session_key):
            return None
        return receipt.turn_id

    def _stop_here(self, session_key: str) -> str | None:
        running = self._running.get(session_key)
        if running is None:
            return None
        turn, task = running
        turn.stop_requested = True
        task.cancel()
        return turn.turn_id

    async def recover(self, channels: Iterable[str],
                      capabilities: Mapping[str, ChannelCapabilities] | None = None) -> int:
        """Queue every accepted message of `channels` whose turn never answered (a crash
        cut it off); each is resumed or answered with a notice, under its session's lease.
        Other channels' messages are left to the process that serves them. Messages a channel
        accepted whose turn never started are published again. A channel's `capabilities`
        say whether its resumed turns stream and may ask for approval, as its live ones do."""
        served = set(channels)
        known = capabilities or {}

        def live(event: InboundEvent) -> InboundEvent:
            can = known.get(event.channel)
            return dataclasses.replace(event, stream=can.edits, can_approve=can.approvals) if can else event

        pending = [r for r in await self._deliveries.store.unanswered() if r.channel in served]
        for receipt in pending:
            await self._bus.publish_inbound(live(InboundEvent(
                channel=receipt.channel, chat_id=receipt.chat_id, sender_id=receipt.sender_id, text="",
                message_id=receipt.message_id, recovery=True,
            )))
        # Accepted by a channel that answered before the turn started (a webhook's 202), never started.
        unstarted = await self._deliveries.store.unstarted(served)
        for event in unstarted:
            await self._bus.publish_inbound(live(event))
        return len(pending) + len(unstarted)

    async def _listen_for_stops(self) -> None:
        """Stops asked of another process (a gateway) for the turns running here."""
        while True:
            self._stop_here(await self._bus.next_stop())

    async def _consume(self) -> None:
        while True:
            await self._slots.take()
            try:
                event = await self._bus.next_inbound()
            except BaseException:
                self._slots.give_back()
                raise
            task = asyncio.create_task(self._handle(event), name=f"ember-turn-{event.session_key}")
            self._turns.add(task)
            self.idle.clear()
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._turns.discard(task)
        self._slots.finished(task)
        self.turns_ended += 1
        if not self._turns:
            self.idle.set()

    async def _handle(self, event: InboundEvent) -> None:
        """The event's turn, then its acknowledgement: a turn cut off (a shutdown, a crash) is
        never acknowledged, so the bus delivers it again and its receipt resumes it. Nor is one
        whose session another process took over: that process acknowledges it, and this one lets
        it go, so that it is taken over again if that process dies too."""
        await self._slots.in_order(event)
        try:
            await self._on_inbound(event)
        except LeaseLost:
            await self._bus.release_inbound(event)
            return
        await self._slots.ack(event)

    async def _on_inbound(self, event: InboundEvent) -> None:
        """The event's turn under its session's lease."""
        try:
            async with self._leases.hold(event.session_key):
                await self._answer(event)
        except (LeaseLost, asyncio.CancelledError):
            raise
        except Exception as exc:  # the lease failed before a turn could start
            turn_id = uuid.uuid4().hex
            log.exception("turn %s of %s could not start", turn_id, event.session_key)
            await self._publish(event, turn_id, OutboundKind.ERROR, error_text(exc, turn_id))

    async def _answer(self, event: InboundEvent) -> None:
        """One turn, its session's lease held."""
        # Every turn gets a receipt, so a crash cannot hide it. A message accepted before is
        # found when the commit of its question refuses it again (DuplicateMessage), before any
        # model call: only then, and on start-up recovery, is its receipt looked up, so a new
        # message costs no read for it.
        if event.message_id is None:
            event = dataclasses.replace(event, message_id=uuid.uuid4().hex)
        turn = TurnState(turn_id=uuid.uuid4().hex, also=self._spans.observer if self._spans else None)
        try:
            if event.recovery and await self._already_handled(event, turn):
                return
            try:
                await self._traced_turn(event, turn)
            except DuplicateMessage:
                turn.trace, turn.journal = None, TurnJournal()  # nothing of that attempt was kept
                if await self._already_handled(event, turn):
                    return
                await self._traced_turn(event, turn)
            assert turn.trace is not None
            turn.trace.status = "ok"
        except asyncio.CancelledError:
            if not await self._cut_off(event, turn):
                raise
        except LeaseLost as lost:
            # Said here, not only by the renewal task: a write can find the lease gone before that task wakes.
            log.warning("turn %s of %s was taken over by another process; this one's work on it is dropped: %s",
                        turn.turn_id, event.session_key, lost)
            turn.trace = None  # the new holder records the turn, under the same id when it resumes it
            raise
        except Exception as exc:  # the loop's edge: one error response, logged once
            log.exception("turn %s of %s failed", turn.turn_id, event.session_key)
            if turn.trace is not None:
                # A model's or a tool's error text may quote a key: the trace keeps it redacted.
                turn.trace.status, turn.trace.error = "failed", redact_text(f"{type(exc).__name__}: {exc}")
            text = error_text(exc, turn.turn_id)
            recorded = await self._record_failure(event, turn, text)
            await self._publish(event, turn.turn_id, OutboundKind.ERROR, text, delivery=recorded)
        finally:
            if turn.trace is not None:
                turn.trace.detail.update(turn.journal.as_dict())
                await self._record(turn.trace)

    async def _cut_off(self, event: InboundEvent, turn: TurnState) -> bool:
        """A turn cancelled mid-way: its answer, if committed, is delivered; else an error says it
        stopped. True if the person stopped it (the task goes on); False if the process is stopping."""
        stopped = turn.stop_requested
        if stopped:  # the person's stop ends this turn only: the task carries on to record it
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        if turn.trace is not None:
            turn.trace.status, turn.trace.error = (
                ("stopped", "stopped by the person who asked") if stopped
                else ("cancelled", "the turn was stopped before it finished"))
        answer = turn.undelivered_answer()
        if answer is not None:  # committed before the cancel: deliver the record, not an error
            await self._deliveries.send(Delivery.replying(
                event, delivery_id=delivery_id(turn.turn_id, answer.seq or 0), turn_id=turn.turn_id,
                text=answer.content))
        elif stopped and not turn.delivered:
            await self._approvals.turn_ended(turn.turn_id, "stopped")
            recorded = await self._record_failure(event, turn, STOPPED_TEXT)
            await self._publish(event, turn.turn_id, OutboundKind.ERROR, STOPPED_TEXT, delivery=recorded)
        elif not turn.delivered and not event.recovery:
            await self._publish(event, turn.turn_id, OutboundKind.ERROR, INTERRUPTED_TEXT)
        return stopped

    async def _traced_turn(self, event: InboundEvent, turn: TurnState) -> None:
        """The turn's stages, traced, and stoppable by the person while they run."""
        turn.trace = TurnTrace(turn_id=turn.turn_id, session_key=event.session_key, started_at=time.time())
        task = asyncio.current_task()
        assert task is not None
        self._running[event.session_key] = (turn, task)
        try:
            with self._spans.turn(turn.turn_id, event.session_key) if self._spans else nullcontext():
                await self._run_turn(event, turn)
        except BaseException:
            if turn.ctx is not None:
                turn.ctx.stream.close()  # before the error the turn sends in its answer's place
            raise
        finally:
            del self._running[event.session_key]

    async def _already_handled(self, event: InboundEvent, turn: TurnState) -> bool:
        """A redelivery: re-send its answer, or pick up its cut-off turn. True when nothing is left to run."""
        assert event.message_id is not None
        seen = await self._deliveries.store.receipt(event.channel, event.chat_id, event.message_id)
        answer = None
        if seen is not None and seen.answered_at is not None and not event.recovery:
            answer = await self._deliveries.store.answer_of(seen.turn_id)
        last_asked = seen is not None and seen.answered_at is None and await self._is_last_asked(event, seen)
        decided = plan(Redelivered(event.recovery, seen, answer.kind if answer is not None else None,
                                   resumable=seen is not None and self._recovery.resumes(seen), last_asked=last_asked))
        if decided is Redelivery.RESEND:
            assert answer is not None
            await self._deliveries.send(answer)
        elif decided is Redelivery.NOTICE:
            assert seen is not None
            await self._answer_with_notice(event, seen)
        elif decided is Redelivery.RESUME:
            assert seen is not None
            turn.turn_id, turn.resume = seen.turn_id, True
        return decided in (Redelivery.SKIP, Redelivery.RESEND, Redelivery.NOTICE)

    async def _is_last_asked(self, event: InboundEvent, seen: Receipt) -> bool:
        """Whether the cut-off turn's message is still the session's last: resumed after a later
        one, it would answer that one, as the model reads the history to its end. Looked up in
        the whole history: a consolidation may have left no question in the window."""
        last = await self._sessions.last_question(event.session_key)
        return last is None or last == seen.turn_id

    async def _answer_with_notice(self, event: InboundEvent, seen: Receipt) -> None:
        await self._approvals.turn_ended(seen.turn_id, "restart")
        session = await self._sessions.load(event.session_key)
        notice = Message.assistant(NOT_RESUMED_TEXT, turn_id=seen.turn_id)
        delivery = Delivery.replying(event, delivery_id=delivery_id(seen.turn_id, session.next_seq),
                                     turn_id=seen.turn_id, text=NOT_RESUMED_TEXT)
        await self._sessions.append(session, [notice], delivery=delivery)
        await self._deliveries.send(delivery)

    async def _record_failure(self, event: InboundEvent, turn: TurnState, text: str) -> str | None:
        """The accepted message was answered, with an error: start-up recovery leaves it alone.
        Returns the error's delivery id, when it was recorded."""
        if turn.ctx is None:
            return None  # nothing was accepted
        delivery = Delivery.failing(event, turn_id=turn.turn_id, text=text)
        try:
            await self._deliveries.store.record(event.session_key, delivery)
        except StoreError:
            log.warning("could not record the failure of turn %s", turn.turn_id, exc_info=True)
            return None
        return delivery.delivery_id

    async def _record(self, trace: TurnTrace) -> None:
        await record_trace(self._traces, trace)

    async def _run_turn(self, event: InboundEvent, turn: TurnState) -> None:
        def open_stream(prefix: str) -> StreamPublisher:
            return StreamPublisher(self._bus, self._deliveries, event, turn.turn_id, prefix=prefix)

        observer = turn.observer
        stream = open_stream if event.stream else None
        with observer.stage("context"):
            ctx = turn.ctx = await self._pipeline.context.prepare(event, turn.turn_id, stream, resume=turn.resume)
        approver = self._approvals.for_turn(event, turn.turn_id, ctx.identity, resumed=turn.resume)
        tools = ToolRun(event.session_key, turn.turn_id, approver, observer, ctx.identity, ctx.memory_identity or None)
        with observer.stage("inference"):
            result = await self._pipeline.agents.get(ctx.agent or "", self._pipeline.inference).run(ctx, tools)
        if turn.resume:  # what it asked before it was cut off and did not ask again is moot now
            await self._approvals.turn_ended(turn.turn_id, "restart")
        with observer.stage("response"):
            done = await self._pipeline.response.finalize(ctx, result)
        if not done.outbound_sent:
            await self._deliveries.send(done.answer, done.usage)
        turn.delivered = True

    async def _publish(self, event: InboundEvent, turn_id: str, kind: OutboundKind, text: str,
                       *, delivery: str | None = None) -> None:
        route = event.route
        await self._bus.publish_outbound(
            OutboundEvent(channel=route.channel, chat_id=route.chat_id, kind=kind, text=text,
                          turn_id=turn_id, reply_to=event.message_id, delivery_id=delivery)
        )
        if delivery is not None:
            self._deliveries.handed_over(route.channel, delivery)
