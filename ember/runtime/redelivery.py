"""What to do with a message delivered again (the bus redelivers what a crash or a lost lease
left unacknowledged; start-up recovery queues every accepted message that was never answered),
decided from what is known of it: a plain function, so each case is a line of a table (I1, I2)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ember.core.delivery import DeliveryKind, Receipt


class Redelivery(enum.Enum):
    FRESH = "fresh"  # never accepted: a new message, its turn runs as any other
    SKIP = "skip"  # nothing is left to do
    RESEND = "resend"  # its answer is committed: send that again, run nothing
    RESUME = "resume"  # its question is committed: run its turn on from there (cut off, or it failed)
    NOTICE = "notice"  # cut off, and resuming would surprise or answer the wrong message: say so instead


@dataclass(frozen=True, slots=True)
class Redelivered:
    """What is known of the message: whether start-up recovery brought it, its receipt, and for
    a receipt the facts that decide between its cases."""

    recovery: bool
    receipt: Receipt | None
    answer: DeliveryKind | None = None  # of its committed answer, when answered (looked up for a live redelivery)
    resumable: bool = True  # the recovery policy would resume its turn (not too old; `interrupted_turns`)
    last_asked: bool = True  # it is still its session's latest question


def plan(message: Redelivered) -> Redelivery:
    receipt = message.receipt
    if receipt is None:
        # Recovery brings only accepted messages; one without a receipt was never taken in.
        return Redelivery.SKIP if message.recovery else Redelivery.FRESH
    if receipt.answered_at is not None:
        if message.recovery:
            return Redelivery.SKIP
        # An answer that was an error is no answer: a redelivery is a retry.
        return Redelivery.RESEND if message.answer is DeliveryKind.FINAL else Redelivery.RESUME
    if message.recovery and not message.resumable:
        return Redelivery.NOTICE
    # Resumed after a later message, the model would answer that one: it reads the history to its end.
    return Redelivery.RESUME if message.last_asked else Redelivery.NOTICE
