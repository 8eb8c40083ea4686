"""The model's scheduling tools: schedule_task, list_tasks, cancel_task. Each acts on the
turn's identity's tasks only; a task's runs answer in the chat that created it."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from ember.core.events import ReplyRoute
from ember.core.schedule import Schedule, ScheduleError, local_time
from ember.core.tasks import CHANNEL, Task, TaskState, new_task_id
from ember.core.tools import Risk, ToolRun
from ember.store.protocols import TaskBook
from ember.tools.base import Tool, ToolFailure, TurnTool

MAX_PROMPT_CHARS = 4_000


class ScheduleArgs(BaseModel):
    prompt: str = Field(description="What to do at each run, written as the user's request to you then, "
                        "e.g. 'Remind me to check the build'.", min_length=1, max_length=MAX_PROMPT_CHARS)
    cron: str | None = Field(default=None, description="A cron expression (minute hour day month weekday), "
                             "e.g. '0 9 * * 1-5' for every weekday at 9:00.")
    every: str | None = Field(default=None, description="An interval instead: '30m', '2h', '1d'.")
    at: str | None = Field(default=None, description="One time instead: '2026-12-24T09:00' or '+10m'.")
    tz: str | None = Field(default=None, description="The user's IANA time zone, e.g. 'Europe/Berlin'.")

    @model_validator(mode="after")
    def _one_schedule(self) -> ScheduleArgs:
        if sum(value is not None for value in (self.cron, self.every, self.at)) != 1:
            raise ValueError("give exactly one of cron, every or at")
        return self


class NoArgs(BaseModel):
    pass


class CancelArgs(BaseModel):
    id: str = Field(description="The task's id, as list_tasks shows it.")


def schedule_of(*, cron: str | None, every: str | None, at: str | None, tz: str, now: float) -> Schedule:
    if cron is not None:
        return Schedule.cron(cron, tz)
    if every is not None:
        return Schedule.every(every, now, tz)
    assert at is not None
    return Schedule.at(at, now, tz)


def creating_chat(session_key: str) -> ReplyRoute | None:
    """Where a task made in this session answers: the session's chat (a run making a task: nowhere)."""
    channel, _, chat_id = session_key.partition(":")
    return None if channel == CHANNEL or not chat_id else ReplyRoute(channel, chat_id)


def task_line(task: Task) -> str:
    upcoming = ", ".join(local_time(t, task.schedule.tz) for t in task.upcoming())
    return (f"{task.id} [{task.state.value}] {task.schedule.describe()}: {task.prompt!r}"
            + (f"; next runs: {upcoming}" if upcoming else ""))


def task_tools(tasks: TaskBook, *, default_tz: str = "UTC") -> list[Tool]:
    async def schedule_task(args: ScheduleArgs, run: ToolRun) -> str:
        try:
            schedule = schedule_of(cron=args.cron, every=args.every, at=args.at, tz=args.tz or default_tz,
                                   now=tasks.clock())
            task = await tasks.add(Task(id=new_task_id(), identity=run.identity, prompt=args.prompt,
                                        schedule=schedule, reply=creating_chat(run.conversation)))
        except ScheduleError as exc:
            raise ToolFailure(str(exc)) from exc
        return (f"Scheduled {task_line(task)}. Tell the user the next run times. "
                "Each run's answer comes to this chat.")

    async def list_tasks(args: NoArgs, run: ToolRun) -> str:
        return "\n".join(task_line(task) for task in await tasks.list(run.identity)) or "No scheduled tasks."

    async def cancel_task(args: CancelArgs, run: ToolRun) -> str:
        task = await tasks.set_state(args.id, TaskState.REMOVED, run.identity)
        if task is None:
            raise ToolFailure(f"there is no task {args.id!r}; list_tasks shows the ids")
        return f"Cancelled {task.id}: {task.prompt!r} will not run again."

    return [
        TurnTool("schedule_task", "Schedule a task that runs later, once or repeatedly (reminders, checks, "
                 "reports); its answer is sent to this chat.", ScheduleArgs, schedule_task, risk=Risk.READ,
                 subject=lambda a: a.prompt, verb="schedule"),
        TurnTool("list_tasks", "List the user's scheduled tasks with their next run times.", NoArgs,
                 list_tasks, risk=Risk.READ, subject=lambda a: "tasks", verb="list"),
        TurnTool("cancel_task", "Cancel one of the user's scheduled tasks by its id.", CancelArgs, cancel_task,
                 risk=Risk.WRITE, subject=lambda a: a.id, verb="cancel the scheduled task"),
    ]
