"""ResponseStage: the commit boundary. The order below is the contract
(DESIGN.md §2); each numbered step must finish before the next begins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ember.core.delivery import Delivery, delivery_id
from ember.core.jobs import JobKind
from ember.core.messages import Message
from ember.core.thinking import strip_thinking
from ember.core.turn import InferenceResult, PipelineContext, ProcessResult
from ember.memory.consolidation import should_consolidate
from ember.memory.service import MemoryService
from ember.pipeline.context import merge_intro
from ember.store.sessions import SessionStore

EMPTY_ANSWER = "(The model returned an empty answer.)"


class Scheduler(Protocol):
    async def schedule(self, kind: str, dedupe_key: str, *, session_key: str | None = None) -> bool: ...


@dataclass(frozen=True, slots=True)
class DerivedWorkPolicy:
    consolidation_threshold: int


class ResponseStage:
    def __init__(self, sessions: SessionStore, scheduler: Scheduler, memory: MemoryService,
                 policy: DerivedWorkPolicy) -> None:
        self._sessions = sessions
        self._scheduler = scheduler
        self._memory = memory
        self._policy = policy

    async def finalize(self, ctx: PipelineContext, result: InferenceResult) -> ProcessResult:
        # 1. Reasoning never reaches the record or the channel.
        text = strip_thinking(result.response_text) or EMPTY_ANSWER
        # 2. The introduction is the system's, not the model's.
        text = merge_intro(ctx.intro_text, text)
        # 3. The commit, with the outbox record that owes it to the channel. Nothing derived starts before it.
        delivery = Delivery(delivery_id=delivery_id(ctx.turn_id, ctx.session.next_seq), turn_id=ctx.turn_id,
                            channel=ctx.event.channel, chat_id=ctx.event.chat_id, reply_to=ctx.event.message_id,
                            kind="final", text=text)
        await self._sessions.append(ctx.session, [Message.assistant(text, turn_id=ctx.turn_id)], delivery=delivery)
        # 4. Derived work: queued durably, run in the background, never undoing step 3.
        await self._schedule_derived_work(ctx, result)
        # 5. Delivery of the final through the stream, which replaces the draft.
        sent = await ctx.stream.finalize(text, delivery.delivery_id) if ctx.stream is not None else False
        # 6. The loop publishes the final itself only if the stream did not.
        return ProcessResult(text, outbound_sent=sent, delivery_id=delivery.delivery_id)

    async def _schedule_derived_work(self, ctx: PipelineContext, result: InferenceResult) -> None:
        key = ctx.session.key
        if self._memory.embeddings_pending:
            # Cleared before the await: turns finishing meanwhile must not each schedule it again.
            self._memory.embeddings_scheduled()
            try:
                await self._scheduler.schedule(JobKind.EMBED, "all")
            except BaseException:
                self._memory.note_new_memory(None)
                raise
        if should_consolidate(ctx.session, self._policy.consolidation_threshold):
            await self._scheduler.schedule(JobKind.CONSOLIDATE, key, session_key=key)
        if result.should_review_skills and result.total_tool_calls > 0:
            await self._scheduler.schedule(JobKind.REVIEW_SKILLS, key, session_key=key)
        if result.should_review_memory and result.total_tool_calls > 0:
            await self._scheduler.schedule(JobKind.REVIEW_MEMORY, key, session_key=key)
