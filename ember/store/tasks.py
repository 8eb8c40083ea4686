"""Scheduled tasks and their runs.

`claim_due` is the scheduler's one write: in a single transaction it records
each due run, advances the task's next run past now, and keeps the run's
message (accept_inbound) for the loop. A crash after the commit re-publishes
that message at start (its turn then has a receipt, so it runs once); a crash
before it leaves the run due. Either way no run fires twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from sqlalchemy import Text, bindparam, func, insert, or_, select, update

from ember.core.delivery import DeliveryKind
from ember.core.events import InboundEvent
from ember.core.schedule import Schedule, ScheduleError
from ember.core.tasks import CHANNEL, MissedPolicy, Task, TaskRun, TaskState
from ember.store import schema
from ember.store.deliveries import accept_inbound
from ember.store.engine import Database
from ember.store.records import TASK_COLUMNS, scheduled_task
from ember.store.tx import Statement, Tx, upsert

# At most this many past-due times of one task are looked at (an every-1s task after a week away).
MAX_CATCH_UP = 1_000

_t, _r, _i, _o = schema.tasks, schema.task_runs, schema.inbox, schema.outbox
_TASK = select(*(_t.c[name] for name in TASK_COLUMNS))
_identity = bindparam("identity", type_=Text)
_owned = or_(_identity.is_(None), _t.c.identity == _identity)  # by anyone when None

_ADD = Statement(insert(_t))
_GET = Statement(_TASK.where(_t.c.id == bindparam("task_id"), _t.c.state != "removed", _owned))
_LIST = Statement(_TASK.where(_t.c.state != "removed", _owned).order_by(_t.c.created_at))
_SET_STATE = Statement(update(_t).where(_t.c.id == bindparam("task_id")).values(
    state=bindparam("state"), next_run_at=bindparam("next_run_at"), updated_at=bindparam("now")))
_EDIT = Statement(update(_t).where(_t.c.id == bindparam("task_id")).values(
    prompt=bindparam("prompt"), kind=bindparam("kind"), spec=bindparam("spec"), tz=bindparam("tz"),
    anchor=bindparam("anchor"), next_run_at=bindparam("next_run_at"), grant_approvals=0, updated_at=bindparam("now")))
_ANSWER = (select(_o.c.text).select_from(_i.join(_o, _o.c.turn_id == _i.c.turn_id))
           .where(_i.c.channel == CHANNEL, _i.c.chat_id == _r.c.task_id, _i.c.message_id == _r.c.message_id)
           .order_by((_o.c.kind == DeliveryKind.FINAL.value).desc(), _o.c.created_at.desc()).limit(1).scalar_subquery())
_RUNS = Statement(select(_r.c.task_id, _r.c.scheduled_for, _r.c.outcome, _r.c.message_id, _r.c.recorded_at, _ANSWER)
                  .where(_r.c.task_id == bindparam("task_id"))
                  .order_by(_r.c.scheduled_for.desc(), _r.c.outcome).limit(bindparam("limit")))
_NEXT_DUE = Statement(select(func.min(_t.c.next_run_at)).where(_t.c.state == "active"))
_MAKE_DUE = Statement(update(_t).where(_t.c.id == bindparam("task_id"), _t.c.state == "active")
                      .values(next_run_at=bindparam("at"), updated_at=bindparam("at")))
# Two claimers at once (a scheduler leader's takeover) skip each other's tasks rather than fire them twice.
_DUE = Statement(_TASK.where(_t.c.state == "active", _t.c.next_run_at <= bindparam("now"))
                 .order_by(_t.c.next_run_at).limit(bindparam("limit")).with_for_update(skip_locked=True))
# A run recorded before (a claim retried) stays as it was.
_MISSED = upsert(lambda ins: ins(_r).values(
    task_id=bindparam("task_id"), scheduled_for=bindparam("scheduled_for"), outcome="missed",
    recorded_at=bindparam("now")).on_conflict_do_nothing(index_elements=["task_id", "scheduled_for", "outcome"]))
_RAN = upsert(lambda ins: ins(_r).values(
    task_id=bindparam("task_id"), scheduled_for=bindparam("scheduled_for"), outcome="run",
    message_id=bindparam("message_id"), recorded_at=bindparam("now"),
).on_conflict_do_nothing(index_elements=["task_id", "scheduled_for", "outcome"]))
_ADVANCE = Statement(update(_t).where(_t.c.id == bindparam("task_id")).values(
    next_run_at=bindparam("following"), state=bindparam("state"), runs=_t.c.runs + bindparam("ran"),
    updated_at=bindparam("now")))


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
        row = {"id": added.id, "identity": added.identity, "prompt": added.prompt,
               "kind": added.schedule.kind.value, "spec": added.schedule.spec, "tz": added.schedule.tz,
               "anchor": added.schedule.anchor, "reply_channel": reply.channel if reply else None,
               "reply_chat_id": reply.chat_id if reply else None, "missed": added.missed.value,
               "grant_approvals": int(added.grant_approvals), "state": added.state.value,
               "next_run_at": added.next_run_at, "runs": 0, "created_at": now, "updated_at": now}
        await self._db.run_write(lambda tx: tx.execute(_ADD, row))
        return added

    async def get(self, task_id: str, identity: str | None = None) -> Task | None:
        """The task, if it exists for `identity` (None: anyone's); removed tasks are gone."""
        row = await self._db.run_read(lambda tx: tx.execute(
            _GET, {"task_id": task_id, "identity": identity}).fetchone())
        return scheduled_task(row) if row else None

    async def list(self, identity: str | None = None) -> list[Task]:
        rows = await self._db.run_read(lambda tx: tx.execute(_LIST, {"identity": identity}).fetchall())
        return [scheduled_task(row) for row in rows]

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
        await self._db.run_write(lambda tx: tx.execute(
            _SET_STATE, {"task_id": task_id, "state": state.value, "next_run_at": next_run, "now": at}))
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
        await self._db.run_write(lambda tx: tx.execute(_EDIT, {
            "task_id": task_id, "prompt": changed.prompt, "kind": changed.schedule.kind.value,
            "spec": changed.schedule.spec, "tz": changed.schedule.tz, "anchor": changed.schedule.anchor,
            "next_run_at": changed.next_run_at, "now": now}))
        return changed

    async def runs(self, task_id: str, limit: int = 20) -> list[TaskRun]:
        """The task's latest runs and missed runs, newest first, each run with its answer once it has one."""
        rows = await self._db.run_read(lambda tx: tx.execute(
            _RUNS, {"task_id": task_id, "limit": limit}).fetchall())
        return [TaskRun(*row) for row in rows]

    async def next_due_at(self) -> float | None:
        return await self._db.run_read(lambda tx: tx.execute(_NEXT_DUE).fetchone()[0])

    async def make_due(self, task_id: str, identity: str | None = None, now: float | None = None) -> Task | None:
        """Run an active task at the scheduler's next look, outside its schedule; then on as before."""
        task = await self.get(task_id, identity)
        if task is None or task.state is not TaskState.ACTIVE:
            return task
        at = self.clock() if now is None else now
        await self._db.run_write(lambda tx: tx.execute(_MAKE_DUE, {"task_id": task_id, "at": at}))
        return replace(task, next_run_at=at)

    async def claim_due(self, now: float, *, missed_after_s: float, limit: int = 500) -> list[InboundEvent]:
        """Claim the runs due by `now`, at most `limit` tasks: one transaction that records them,
        advances each task past `now` and keeps each run's message. A run more than `missed_after_s`
        late was missed (Ember was down): recorded as such, and run once if the task's policy says so."""
        def claim(tx: Tx) -> list[InboundEvent]:
            rows = tx.execute(_DUE, {"now": now, "limit": limit}).fetchall()
            events = []
            for task in map(scheduled_task, rows):
                assert task.next_run_at is not None
                due = [task.next_run_at]
                while len(due) < MAX_CATCH_UP and (t := task.schedule.next_after(due[-1])) is not None and t <= now:
                    due.append(t)
                following = task.schedule.next_after(max(due[-1], now))
                missed = [t for t in due if now - t > missed_after_s]
                to_run = [t for t in due if now - t <= missed_after_s][-1:]
                if missed and not to_run and task.missed is MissedPolicy.RUN_ONCE:
                    to_run = [missed.pop()]
                tx.executemany(_MISSED, [{"task_id": task.id, "scheduled_for": t, "now": now} for t in missed])
                for t in to_run:
                    event = run_event(task, t)
                    tx.execute(_RAN, {"task_id": task.id, "scheduled_for": t, "message_id": event.message_id,
                                      "now": now})
                    if accept_inbound(tx, event, now):
                        events.append(event)
                state = TaskState.ACTIVE if following is not None else TaskState.DONE
                tx.execute(_ADVANCE, {"task_id": task.id, "following": following, "state": state.value,
                                      "ran": len(to_run), "now": now})
            return events

        return await self._db.run_write(claim)
