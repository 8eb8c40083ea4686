"""ResponseStage: the commit boundary. The order below is the contract
(DESIGN.md §2); each numbered step must finish before the next begins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ember.core.delivery import Delivery, delivery_id
from ember.core.events import TurnUsage
from ember.core.jobs import JobKind, JobRequest
from ember.core.messages import Message
from ember.core.thinking import strip_thinking
from ember.core.turn import InferenceResult, PipelineContext, ProcessResult
from ember.memory.consolidation import should_consolidate
from ember.memory.protocols import RecallNotes
from ember.pipeline.context import merge_intro
from ember.pipeline.voice import SpokenReplies
from ember.store.protocols import SessionStore

EMPTY_ANSWER = "(The model returned an empty answer.)"


class Scheduler(Protocol):
    def wake(self, delay_s: float = 0.0) -> None:
        """New jobs were committed, due in `delay_s`: look at the queue then rather than at the next poll."""


@dataclass(frozen=True, slots=True)
class DerivedWorkPolicy:
    consolidation_threshold: int
    titled_channels: frozenset[str] = frozenset()  # whose sessions the background model names
    # A turn's derived work is due this long after its commit: the turns committed meanwhile
    # share it (one archive of a session, one upkeep, for all of them).
    batch_s: float = 0.25


class ResponseStage:
    def __init__(self, sessions: SessionStore, scheduler: Scheduler, memory: RecallNotes,
                 policy: DerivedWorkPolicy, voice: SpokenReplies | None = None) -> None:
        self._sessions = sessions
        self._scheduler = scheduler
        self._memory = memory
        self._policy = policy
        self._voice = voice

    async def finalize(self, ctx: PipelineContext, result: InferenceResult) -> ProcessResult:
        # 1. Reasoning never reaches the record or the channel.
        text = strip_thinking(result.response_text) or EMPTY_ANSWER
        # 2. The introduction is the system's, not the model's.
        text = merge_intro(ctx.intro_text, text)
        # 3. Spoken, where the session asked for it: the recording is stored before the commit names it.
        files = result.files
        if self._voice is not None:
            spoken, note = await self._voice.recording(ctx.session, text)
            files, text = files + spoken, text + note
        # 4. The commit, with the outbox record that owes it to the channel and the
        #    derived work it calls for: a crash keeps all three or none (I6).
        delivery = Delivery.replying(ctx.event, delivery_id=delivery_id(ctx.turn_id, ctx.session.next_seq),
                                     turn_id=ctx.turn_id, text=text, attachments=files)
        jobs = self._derived_work(ctx, result)
        answer = Message.assistant(text, turn_id=ctx.turn_id, attachments=files)
        await self._sessions.append(ctx.session, [answer], delivery=delivery, jobs=jobs)
        # 5. Derived work runs in the background and never undoes step 4.
        if jobs:
            self._scheduler.wake(self._policy.batch_s)
        # 6. Delivery of the final through the stream, which replaces the draft.
        usage = (TurnUsage(result.input_tokens, result.cached_tokens, result.output_tokens)
                 if result.model_calls else None)
        sent = await ctx.stream.finalize(delivery, usage)
        # 7. The loop publishes the final itself only if the stream did not.
        return ProcessResult(delivery, outbound_sent=sent, usage=usage)

    def _derived_work(self, ctx: PipelineContext, result: InferenceResult) -> list[JobRequest]:
        key, turn, delay, jobs = ctx.session.key, ctx.turn_id, self._policy.batch_s, []
        if not ctx.session.metadata.get("evaluation"):
            # The question and its answer join the searchable history.
            jobs.append(JobRequest(JobKind.ARCHIVE, key, key, turn, delay))
        if self._memory.recalls_pending:
            jobs.append(JobRequest(JobKind.MEMORY_UPKEEP, "all", turn_id=turn, delay_s=delay))
        # The answer about to be committed counts toward the threshold.
        if should_consolidate(ctx.session.unconsolidated_count + 1, self._policy.consolidation_threshold):
            jobs.append(JobRequest(JobKind.CONSOLIDATE, key, key, turn, delay))
        if ctx.event.channel in self._policy.titled_channels and _first_exchange(ctx):
            jobs.append(JobRequest(JobKind.TITLE_SESSION, key, key, turn, delay))
        if result.total_tool_calls > 0:
            if result.should_review_skills:
                jobs.append(JobRequest(JobKind.REVIEW_SKILLS, key, key, turn, delay))
            if result.should_review_memory:
                jobs.append(JobRequest(JobKind.REVIEW_MEMORY, key, key, turn, delay))
        return jobs


def _first_exchange(ctx: PipelineContext) -> bool:
    """The turn answers the session's first message (seq 0), even if it was resumed."""
    messages = ctx.session.messages
    return bool(messages) and messages[0].seq == 0 and messages[0].turn_id == ctx.turn_id
