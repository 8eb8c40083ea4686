"""What the agent loop keeps of a turn while it runs, and the texts it answers with when a turn
cannot end normally (ember/runtime/loop.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from ember.core.delivery import Receipt
from ember.core.errors import EmberError, StoreError
from ember.core.journal import Observers, TurnJournal, TurnObserver
from ember.core.messages import Message, Role
from ember.core.redact import redact_text
from ember.core.traces import TurnTrace
from ember.core.turn import PipelineContext
from ember.store.protocols import TraceLog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    """What to do at start-up with a message whose turn a crash cut off."""

    mode: Literal["resume", "notice"] = "resume"
    # Older than this, resuming would surprise: the user gets a notice instead.
    window_s: float = 600.0

    def resumes(self, receipt: Receipt) -> bool:
        return self.mode == "resume" and time.time() - receipt.received_at <= self.window_s


INTERRUPTED_TEXT = "Sorry, this turn was interrupted before it finished (Ember is shutting down)."
STOPPED_TEXT = "Stopped: you stopped this turn before it finished. What it had done so far is kept."
TRACE_FLUSH_S = 1.0
NOT_RESUMED_TEXT = ("Sorry, Ember stopped while working on this message and did not finish it. "
                    "Send it again if it still matters.")


@dataclass(slots=True)
class TurnState:
    """One turn as the loop tracks it, for a failure or a cancellation to report honestly."""

    turn_id: str
    journal: TurnJournal = field(default_factory=TurnJournal)
    also: TurnObserver | None = None  # another observer of every turn: OpenTelemetry
    resume: bool = False
    ctx: PipelineContext | None = None
    delivered: bool = False
    trace: TurnTrace | None = None
    stop_requested: bool = False  # by a person (stop_turn), not by Ember shutting down

    @property
    def observer(self) -> TurnObserver:
        return self.journal if self.also is None else Observers((self.journal, self.also))

    def undelivered_answer(self) -> Message | None:
        """The turn's final answer when it was committed but not yet sent."""
        if self.ctx is None or self.delivered or not self.ctx.session.messages:
            return None
        last = self.ctx.session.messages[-1]
        final = last.role is Role.ASSISTANT and not last.tool_calls and last.turn_id == self.turn_id
        return last if final else None


def error_text(exc: BaseException, turn_id: str) -> str:
    if isinstance(exc, EmberError):  # a StoreBusy says to send the message again
        # A provider's error may quote the key it refused: the person is told why, not the key.
        return f"Sorry, I could not answer: {redact_text(str(exc))}"
    return f"Sorry, something went wrong inside Ember ({type(exc).__name__}). Turn id for the logs: {turn_id}"


async def record_trace(traces: TraceLog, trace: TurnTrace) -> None:
    """The turn's trace, finished now, kept for the next write; a store that fails costs the trace only."""
    trace.finished_at = time.time()
    try:
        await traces.record(trace)
    except StoreError:
        log.warning("could not record the trace of turn %s", trace.turn_id, exc_info=True)
