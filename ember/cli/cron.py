"""`ember cron`: scheduled tasks from the terminal. A running `ember serve` runs them; it
picks up what these commands change within a second or two."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ember.cli.common import (
    err,
    open_listings,
    open_store,
    out,
    print_json,
    run_command,
    settings_or_exit,
    setup_logging,
)
from ember.core.errors import EmberError
from ember.core.schedule import ScheduleError, local_time
from ember.core.tasks import MissedPolicy, Task, TaskState

if TYPE_CHECKING:
    from ember.config.settings import Settings
    from ember.core.events import ReplyRoute

cron_app = typer.Typer(help="Scheduled tasks: add, edit, list, pause, resume, remove, run.", no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
IdArgument = Annotated[str, typer.Argument(help="The task's id (ember cron list shows them).")]


class TaskNotFound(EmberError):
    pass


def _settings() -> Settings:
    settings = settings_or_exit()
    setup_logging(settings, verbose=False)
    return settings


def _route(session: str) -> ReplyRoute:
    """`--session`: a session key with its channel (http:alice:work), or a terminal session's name."""
    from ember.core.events import ReplyRoute

    channel, _, chat_id = session.partition(":")
    if chat_id and channel in ("cli", "http", "webhook", "telegram", "wecom", "qq", "outbound"):
        return ReplyRoute(channel, chat_id)
    return ReplyRoute("cli", session)


def _show(task: Task, as_json: bool) -> None:
    if as_json:
        print_json(task.to_json_dict())
        return
    out.print(f"{task.id} [{task.state.value}] {escape(task.schedule.describe())}")
    for t in task.upcoming():
        out.print(f"  next: {local_time(t, task.schedule.tz)}")


@cron_app.command("add")
def add(
    prompt: Annotated[str, typer.Option("--prompt", help="What each run asks the agent.")],
    cron: Annotated[str | None, typer.Option("--cron", help="A cron expression: '0 9 * * 1-5'.")] = None,
    every: Annotated[str | None, typer.Option("--every", help="An interval: 1s, 5m, 1h30m, 1d.")] = None,
    at: Annotated[str | None, typer.Option("--at", help="One time: 2026-12-24T09:00, or +10m.")] = None,
    session: Annotated[str | None, typer.Option("--session", help="The chat answers go to: a session key "
                                                "(http:alice:work) or a terminal session's name; "
                                                "default: the task's own session.")] = None,
    tz: Annotated[str | None, typer.Option("--tz", help="The IANA time zone (default: the timezone setting).")]
    = None,
    missed: Annotated[MissedPolicy, typer.Option("--missed", help="Runs missed while Ember was down: skip "
                                                 "them, or run once.")] = MissedPolicy.SKIP,
    grant_approvals: Annotated[bool, typer.Option("--grant-approvals", help="Let unattended runs do what would "
                                                  "ask for approval (otherwise denied).")] = False,
    identity: Annotated[str | None, typer.Option("--identity", help="Whose task (default: the --session's "
                                                 "person, else local).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Add a task; prints its id and its next runs."""
    from ember.core.memory import LOCAL_IDENTITY, default_identity
    from ember.core.tasks import new_task_id
    from ember.tools.tasks import schedule_of

    if sum(value is not None for value in (cron, every, at)) != 1:
        err.print("[red]error:[/red] give exactly one of --cron, --every, --at")
        raise typer.Exit(2)
    settings = _settings()

    async def main() -> int:
        route = _route(session) if session else None
        owner = identity or (default_identity(f"{route.channel}:{route.chat_id}") if route else LOCAL_IDENTITY)
        async with open_store(settings) as stores:
            try:
                schedule = schedule_of(cron=cron, every=every, at=at, tz=tz or settings.timezone, now=time.time())
                task = await stores.tasks.add(Task(id=new_task_id(), identity=owner, prompt=prompt,
                                                     schedule=schedule, reply=route, missed=missed,
                                                     grant_approvals=grant_approvals))
            except ScheduleError as exc:
                raise EmberError(str(exc)) from None
        if as_json:
            _show(task, True)
        else:
            print(task.id)
            for t in task.upcoming():
                err.print(f"  next: {local_time(t, task.schedule.tz)}", markup=False)
        return 0

    run_command(main())


@cron_app.command("edit")
def edit(
    task_id: IdArgument,
    prompt: Annotated[str | None, typer.Option("--prompt", help="A new prompt.")] = None,
    cron: Annotated[str | None, typer.Option("--cron", help="A new cron expression.")] = None,
    every: Annotated[str | None, typer.Option("--every", help="A new interval.")] = None,
    at: Annotated[str | None, typer.Option("--at", help="A new moment.")] = None,
    tz: Annotated[str | None, typer.Option("--tz", help="The new schedule's time zone.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Change a task's prompt or schedule; this revokes an approval grant it had."""
    from ember.tools.tasks import schedule_of

    if sum(value is not None for value in (cron, every, at)) > 1 or not (prompt or cron or every or at):
        err.print("[red]error:[/red] give --prompt, and at most one of --cron, --every, --at")
        raise typer.Exit(2)
    settings = _settings()

    async def main() -> int:
        async with open_store(settings) as stores:
            try:
                schedule = (schedule_of(cron=cron, every=every, at=at, tz=tz or settings.timezone, now=time.time())
                            if cron or every or at else None)
                task = await stores.tasks.edit(task_id, prompt=prompt, schedule=schedule)
            except ScheduleError as exc:
                raise EmberError(str(exc)) from None
        if task is None:
            raise TaskNotFound(f"there is no task {task_id!r}; ember cron list shows the ids")
        _show(task, as_json)
        return 0

    run_command(main())


@cron_app.command("list")
def list_tasks(as_json: JsonOption = False) -> None:
    """Every task: id, schedule, next run, state."""

    async def main() -> int:
        async with open_listings() as stores:
            tasks = await stores.tasks.list()
        if as_json:
            print_json([task.to_json_dict() for task in tasks])
            return 0
        if not tasks:
            out.print("No scheduled tasks. Add one: ember cron add --every 1d --prompt '…'")
            return 0
        table = Table()
        for name in ("id", "schedule", "next run", "state", "runs", "owner", "prompt"):
            table.add_column(name, no_wrap=name == "id")
        for task in tasks:
            next_run = local_time(task.next_run_at, task.schedule.tz) if task.next_run_at else "—"
            table.add_row(task.id, escape(task.schedule.describe()), next_run, task.state.value, str(task.runs),
                          escape(task.identity), escape(task.prompt))
        out.print(table)
        return 0

    run_command(main())


def _change(task_id: str, as_json: bool, change: str) -> None:

    settings = _settings()

    async def main() -> int:
        async with open_store(settings) as stores:
            store = stores.tasks
            if change == "run":
                task = await store.make_due(task_id)
            else:
                state = {"pause": TaskState.PAUSED, "resume": TaskState.ACTIVE, "remove": TaskState.REMOVED}[change]
                task = await store.set_state(task_id, state)
        if task is None:
            raise TaskNotFound(f"there is no task {task_id!r}; ember cron list shows the ids")
        if change == "run" and task.state is not TaskState.ACTIVE:
            raise EmberError(f"task {task.id} is {task.state.value}; resume it first")
        _show(task, as_json)
        if change == "run" and not as_json:
            err.print("  due now: a running ember serve runs it within a second or two", markup=False)
        return 0

    run_command(main())


@cron_app.command("pause")
def pause(task_id: IdArgument, as_json: JsonOption = False) -> None:
    """Stop a task's runs until it is resumed."""
    _change(task_id, as_json, "pause")


@cron_app.command("resume")
def resume(task_id: IdArgument, as_json: JsonOption = False) -> None:
    """Resume a paused task; its next run is counted from now (what fell due meanwhile is not run)."""
    _change(task_id, as_json, "resume")


@cron_app.command("remove")
def remove(task_id: IdArgument, as_json: JsonOption = False) -> None:
    """Remove a task for good (its runs' history stays in its session)."""
    _change(task_id, as_json, "remove")


@cron_app.command("run")
def run(task_id: IdArgument, as_json: JsonOption = False) -> None:
    """Run a task now, outside its schedule."""
    _change(task_id, as_json, "run")
