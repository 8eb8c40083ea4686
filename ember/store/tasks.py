"""Scheduled tasks and their runs.

`claim_due` is the scheduler's one write: in a single transaction it records
each due run, advances the task's next run past now, and keeps the run's
message (accept_inbound) for the loop. A crash after the commit re-publishes
that message at start (its turn then has a receipt, so it runs once); a crash
before it leaves the run due. Either way no run fires twice.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ember.core.events import InboundEvent, ReplyRoute
from ember.core.schedule import Schedule, ScheduleError, ScheduleKind
from ember.core.tasks import CHANNEL, MissedPolicy, Task, TaskRun, TaskState
from ember.store.database import Database
from ember.store.deliveries import accept_inbound

_COLUMNS = ("id, identity, prompt, kind, spec, tz, anchor, reply_channel, reply_chat_id, missed, grant_approvals, "
            "state, next_run_at, runs, created_at")
# At most this many past-due times of one task are looked at (an every-1s task after a week away).
MAX_CATCH_UP = 1_000


def new_task_id() -> str:
    return "t_" + secrets.token_hex(5)


def _task(row: Sequence[Any]) -> Task:
    (id_, identity, prompt, kind, spec, tz, anchor, reply_channel, reply_chat_id, missed, grant, state,
     next_run_at, runs, created_at) = row
    return Task(id=id_, identity=identity, prompt=prompt, schedule=Schedule(ScheduleKind(kind), spec, tz, anchor),
                reply=ReplyRoute(reply_channel, reply_chat_id) if reply_channel else None,
                missed=MissedPolicy(missed), grant_approvals=bool(grant), state=TaskState(state),
                next_run_at=next_run_at, runs=runs, created_at=created_at)


def run_event(task: Task, scheduled_for: float) -> InboundEvent:
    """The message a run of `task` is: its prompt, in its session, as its owner, answered to its chat."""
    return InboundEvent(channel=CHANNEL, chat_id=task.id, sender_id=task.identity, text=task.prompt,
                        message_id=f"{task.id}@{scheduled_for:.3f}", reply=task.reply,
                        metadata={"grant_approvals": "true"} if task.grant_approvals else {})


class SqlTaskStore:
    """`clock`: what "now" is when a task is added or changed (tests move it)."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self.clock = clock

    async def add(self, task: Task) -> Task:
        """`task`, stored with its first run; ScheduleError if it has none left."""
        now = self.clock()
        first = task.schedule.first_run(now)
        if first is None:
            raise ScheduleError(f"{task.schedule.describe()} is in the past; nothing was scheduled")
        added = replace(task, next_run_at=first, created_at=now, state=TaskState.ACTIVE)
        reply = added.reply
        await self._db.run_write(lambda conn: conn.execute(
            f"INSERT INTO tasks ({_COLUMNS}, updated_at) VALUES ({', '.join('?' * 16)})",
            (added.id, added.identity, added.prompt, added.schedule.kind.value, added.schedule.spec,
             added.schedule.tz, added.schedule.anchor, reply.channel if reply else None,
             reply.chat_id if reply else None, added.missed.value, int(added.grant_approvals), added.state.value,
             added.next_run_at, 0, now, now)))
        return added

    async def get(self, task_id: str, identity: str | None = None) -> Task | None:
        """The task, if it exists for `identity` (None: anyone's); removed tasks are gone."""
        row = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_COLUMNS} FROM tasks WHERE id = ? AND state != 'removed' AND (? IS NULL OR identity = ?)",
            (task_id, identity, identity)).fetchone())
        return _task(row) if row else None

    async def list(self, identity: str | None = None) -> list[Task]:
        rows = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_COLUMNS} FROM tasks WHERE state != 'removed' AND (? IS NULL OR identity = ?) "
            "ORDER BY created_at", (identity, identity)).fetchall())
        return [_task(row) for row in rows]

    async def set_state(self, task_id: str, state: TaskState, identity: str | None = None,
                        now: float | None = None) -> Task | None:
        """Pause, resume (the next run counted from now) or remove a task; None if it is not there."""
        task = await self.get(task_id, identity)
        if task is None:
            return None
        at = self.clock() if now is None else now
        next_run = task.next_run_at
        if state is TaskState.ACTIVE:
            if task.state is not TaskState.PAUSED:
                return task
            next_run = task.schedule.next_after(at)
            state = TaskState.ACTIVE if next_run is not None else TaskState.DONE
        await self._db.run_write(lambda conn: conn.execute(
            "UPDATE tasks SET state = ?, next_run_at = ?, updated_at = ? WHERE id = ?",
            (state.value, next_run, at, task_id)))
        return replace(task, state=state, next_run_at=next_run)

    async def edit(self, task_id: str, *, prompt: str | None = None, schedule: Schedule | None = None,
                   identity: str | None = None) -> Task | None:
        """A new prompt or schedule. An edit revokes the approval grant: what was granted was the old task."""
        task = await self.get(task_id, identity)
        if task is None:
            return None
        now = self.clock()
        changed = replace(task, prompt=prompt or task.prompt, schedule=schedule or task.schedule,
                          grant_approvals=False)
        if schedule is not None and task.state is TaskState.ACTIVE:
            first = schedule.first_run(now)
            if first is None:
                raise ScheduleError(f"{schedule.describe()} is in the past; the task was not changed")
            changed = replace(changed, next_run_at=first)
        await self._db.run_write(lambda conn: conn.execute(
            "UPDATE tasks SET prompt = ?, kind = ?, spec = ?, tz = ?, anchor = ?, next_run_at = ?, "
            "grant_approvals = 0, updated_at = ? WHERE id = ?",
            (changed.prompt, changed.schedule.kind.value, changed.schedule.spec, changed.schedule.tz,
             changed.schedule.anchor, changed.next_run_at, now, task_id)))
        return changed

    async def runs(self, task_id: str, limit: int = 20) -> list[TaskRun]:
        """The task's latest runs and missed runs, newest first, each run with its answer once it has one."""
        rows = await self._db.run_read(lambda conn: conn.execute(
            "SELECT r.task_id, r.scheduled_for, r.outcome, r.message_id, r.recorded_at, "
            "(SELECT o.text FROM inbox i JOIN outbox o ON o.turn_id = i.turn_id "
            " WHERE i.channel = ? AND i.chat_id = r.task_id AND i.message_id = r.message_id "
            " ORDER BY o.kind = 'final' DESC, o.created_at DESC LIMIT 1) "
            "FROM task_runs r WHERE r.task_id = ? ORDER BY r.scheduled_for DESC, r.outcome LIMIT ?",
            (CHANNEL, task_id, limit)).fetchall())
        return [TaskRun(*row) for row in rows]

    async def next_due_at(self) -> float | None:
        return await self._db.run_read(lambda conn: conn.execute(
            "SELECT MIN(next_run_at) FROM tasks WHERE state = 'active'").fetchone()[0])

    async def make_due(self, task_id: str, identity: str | None = None, now: float | None = None) -> Task | None:
        """Run an active task at the scheduler's next look, outside its schedule; then on as before."""
        task = await self.get(task_id, identity)
        if task is None or task.state is not TaskState.ACTIVE:
            return task
        at = self.clock() if now is None else now
        await self._db.run_write(lambda conn: conn.execute(
            "UPDATE tasks SET next_run_at = ?, updated_at = ? WHERE id = ? AND state = 'active'",
            (at, at, task_id)))
        return replace(task, next_run_at=at)

    async def claim_due(self, now: float, *, missed_after_s: float, limit: int = 500) -> list[InboundEvent]:
        """Claim the runs due by `now`, at most `limit` tasks: one transaction that records them,
        advances each task past `now` and keeps each run's message. A run more than `missed_after_s`
        late was missed (Ember was down): recorded as such, and run once if the task's policy says so."""
        def claim(conn: sqlite3.Connection) -> list[InboundEvent]:
            rows = conn.execute(f"SELECT {_COLUMNS} FROM tasks WHERE state = 'active' AND next_run_at <= ? "
                                "ORDER BY next_run_at LIMIT ?", (now, limit)).fetchall()
            events = []
            for task in map(_task, rows):
                assert task.next_run_at is not None
                due = [task.next_run_at]
                while len(due) < MAX_CATCH_UP and (t := task.schedule.next_after(due[-1])) is not None and t <= now:
                    due.append(t)
                following = task.schedule.next_after(max(due[-1], now))
                missed = [t for t in due if now - t > missed_after_s]
                to_run = [t for t in due if now - t <= missed_after_s][-1:]
                if missed and not to_run and task.missed is MissedPolicy.RUN_ONCE:
                    to_run = [missed.pop()]
                conn.executemany("INSERT OR IGNORE INTO task_runs VALUES (?, ?, 'missed', NULL, ?)",
                                 [(task.id, t, now) for t in missed])
                for t in to_run:
                    event = run_event(task, t)
                    conn.execute("INSERT OR IGNORE INTO task_runs VALUES (?, ?, 'run', ?, ?)",
                                 (task.id, t, event.message_id, now))
                    if accept_inbound(conn, event, now):
                        events.append(event)
                state = TaskState.ACTIVE if following is not None else TaskState.DONE
                conn.execute("UPDATE tasks SET next_run_at = ?, state = ?, runs = runs + ?, updated_at = ? "
                             "WHERE id = ?", (following, state.value, len(to_run), now, task.id))
            return events

        return await self._db.run_write(claim)
