"""Scheduled tasks over HTTP: the caller's tasks listed, created and removed, in the records
`ember cron list --json` prints. Tasks belong to a person, like memory: another
person's task does not exist for a caller (404)."""

from __future__ import annotations

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.gateway.http import ApiError, read_json
from ember.channels.gateway.schemas import SESSION_KEY_PATTERN
from ember.channels.gateway.turns import CHANNEL, chat_id
from ember.core.events import ReplyRoute
from ember.core.schedule import ScheduleError
from ember.core.tasks import MissedPolicy, Task, TaskState, new_task_id
from ember.memory.identity import Identities
from ember.store.protocols import TaskBook
from ember.tools.tasks import ScheduleArgs, schedule_of


class TaskWrite(ScheduleArgs):
    """What the schedule_task tool takes, and what only a person may set."""

    model_config = ConfigDict(extra="forbid")

    # The caller's session whose chat gets the answers; default: the task's own session only.
    session: str | None = Field(default=None, pattern=SESSION_KEY_PATTERN)
    missed: MissedPolicy = MissedPolicy.SKIP
    grant_approvals: bool = False


class TasksApi:
    def __init__(self, tasks: TaskBook, identities: Identities, *, max_body_bytes: int,
                 default_tz: str = "UTC") -> None:
        self._tasks = tasks
        self._identities = identities
        self._max_body_bytes = max_body_bytes
        self._default_tz = default_tz

    def routes(self) -> list[Route]:
        return [
            Route("/api/tasks", self.tasks, methods=["GET", "POST"]),
            Route("/api/tasks/{id}", self.task, methods=["GET", "DELETE"]),
        ]

    def _person(self, request: Request) -> str:
        return self._identities.resolve(CHANNEL, request.state.identity)

    async def tasks(self, request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse([task.to_json_dict() for task in await self._tasks.list(self._person(request))])
        body = await read_json(request, TaskWrite, self._max_body_bytes)
        route = ReplyRoute(CHANNEL, chat_id(request.state.identity, body.session)) if body.session else None
        try:
            schedule = schedule_of(cron=body.cron, every=body.every, at=body.at, tz=body.tz or self._default_tz,
                                   now=self._tasks.clock())
            task = await self._tasks.add(Task(id=new_task_id(), identity=self._person(request), prompt=body.prompt,
                                              schedule=schedule, reply=route, missed=body.missed,
                                              grant_approvals=body.grant_approvals))
        except ScheduleError as exc:
            raise ApiError(422, str(exc), code="invalid_schedule") from None
        return JSONResponse(task.to_json_dict(), status_code=201)

    async def task(self, request: Request) -> Response:
        task_id, person = request.path_params["id"], self._person(request)
        if request.method == "GET":
            task = await self._tasks.get(task_id, person)
            if task is not None:
                runs = await self._tasks.runs(task.id)
                recent = [{"scheduled_for": run.scheduled_for, "outcome": run.outcome, "answer": run.answer}
                          for run in runs]
                return JSONResponse({**task.to_json_dict(), "recent_runs": recent})
        else:
            task = await self._tasks.set_state(task_id, TaskState.REMOVED, person)
            if task is not None:
                return JSONResponse({**task.to_json_dict(), "state": TaskState.REMOVED.value})
        raise ApiError(404, f"no task {task_id[:64]!r}", code="task_not_found")
