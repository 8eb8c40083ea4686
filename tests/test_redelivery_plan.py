"""What the agent loop does with a message delivered again (runtime/redelivery.py), case by case:
the table the loop's crash and redelivery tests (test_delivery.py, tests/crash/) exercise end to end."""

from __future__ import annotations

import pytest

from ember.core.delivery import DeliveryKind, Receipt
from ember.runtime.redelivery import Redelivered, Redelivery, plan

ANSWERED = Receipt(channel="c", message_id="m", chat_id="x", sender_id="s", turn_id="t", answered_at=2.0)
OPEN = Receipt(channel="c", message_id="m", chat_id="x", sender_id="s", turn_id="t")
FINAL, ERROR = DeliveryKind.FINAL, DeliveryKind.ERROR

CASES = [
    # recovery, receipt, answer, resumable, last_asked -> what is done
    (False, None, None, True, True, Redelivery.FRESH),  # never accepted: a new message
    (True, None, None, True, True, Redelivery.SKIP),  # recovery brings accepted messages only
    (False, ANSWERED, FINAL, True, True, Redelivery.RESEND),  # answered: the answer again, no model call
    (False, ANSWERED, ERROR, True, True, Redelivery.RESUME),  # it failed: sent again, it is a retry
    (False, ANSWERED, None, True, True, Redelivery.RESUME),  # an answer row gone: a retry, not silence
    (True, ANSWERED, FINAL, True, True, Redelivery.SKIP),  # recovery leaves answered messages alone
    (True, ANSWERED, ERROR, True, True, Redelivery.SKIP),  # ... errors included: the person saw one
    (False, OPEN, None, True, True, Redelivery.RESUME),  # cut off: picked up from its committed steps
    (False, OPEN, None, False, True, Redelivery.RESUME),  # the policy is for recovery, not a live redelivery
    (False, OPEN, None, True, False, Redelivery.NOTICE),  # a later message came: resuming would answer it
    (True, OPEN, None, True, True, Redelivery.RESUME),  # recovery resumes a recent cut-off turn
    (True, OPEN, None, False, True, Redelivery.NOTICE),  # too old, or `interrupted_turns = "notice"`
    (True, OPEN, None, True, False, Redelivery.NOTICE),
    (True, OPEN, None, False, False, Redelivery.NOTICE),
]


@pytest.mark.parametrize(("recovery", "receipt", "answer", "resumable", "last_asked", "expected"), CASES)
def test_a_redelivered_message_is_run_resent_resumed_noticed_or_left(
        recovery: bool, receipt: Receipt | None, answer: DeliveryKind | None, resumable: bool, last_asked: bool,
        expected: Redelivery) -> None:
    assert plan(Redelivered(recovery, receipt, answer, resumable=resumable, last_asked=last_asked)) is expected


def test_every_outcome_has_a_case() -> None:
    assert {case[-1] for case in CASES} == set(Redelivery)
