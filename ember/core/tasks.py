"""Scheduled tasks as plain data: whose, what to ask, when, and where the answer goes."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.core.schedule import Schedule, local_time

if TYPE_CHECKING:
    from ember.core.events import ReplyRoute

CHANNEL = "cron"  # the channel a task's runs come in on; each task's runs share the session cron:<id>


class TaskState(enum.StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    DONE = "done"  # a one-time task that has run
    REMOVED = "removed"


class MissedPolicy(enum.StrEnum):
    """Runs that fell due while Ember was down: recorded as missed, and then..."""

    SKIP = "skip"  # ...the task waits for its next time
    RUN_ONCE = "run_once"  # ...one run now stands for all of them


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    id: str
    identity: str
    prompt: str
    schedule: Schedule
    reply: ReplyRoute | None  # the chat that created it; None: the answer stays in the task's session
    missed: MissedPolicy = MissedPolicy.SKIP
    # Unattended runs are denied any tool call that would ask a person, unless granted at creation.
    grant_approvals: bool = False
    state: TaskState = TaskState.ACTIVE
    next_run_at: float | None = None
    runs: int = 0
    created_at: float = 0.0

    @property
    def session_key(self) -> str:
        return f"{CHANNEL}:{self.id}"

    def to_json_dict(self) -> dict[str, object]:
        return {
            "id": self.id, "prompt": self.prompt, "schedule": self.schedule.describe(),
            "kind": self.schedule.kind.value, "spec": self.schedule.spec, "tz": self.schedule.tz,
            "state": self.state.value, "missed": self.missed.value, "grant_approvals": self.grant_approvals,
            "next_run_at": self.next_run_at,
            "next_run": local_time(self.next_run_at, self.schedule.tz) if self.next_run_at else None,
            "upcoming": [local_time(t, self.schedule.tz) for t in self.upcoming()],
            "runs": self.runs, "session": self.session_key, "created_at": self.created_at,
            "reply_to": f"{self.reply.channel}:{self.reply.chat_id}" if self.reply else None,
        }

    def upcoming(self, count: int = 3) -> list[float]:
        if self.state is not TaskState.ACTIVE or self.next_run_at is None:
            return []
        return [self.next_run_at, *self.schedule.upcoming(self.next_run_at, count - 1)]


@dataclass(frozen=True, slots=True)
class TaskRun:
    task_id: str
    scheduled_for: float
    outcome: str  # run | missed
    message_id: str | None
    recorded_at: float
    answer: str | None = None  # the run's committed answer (or error), once there is one


def new_task_id() -> str:
    return "t_" + secrets.token_hex(5)
