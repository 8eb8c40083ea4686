"""Scheduled tasks: schedules across DST, runs fired on a fake clock exactly once and answered in
the chat that created them, missed runs per policy, unattended approvals, the `ember cron` command
and `/api/tasks` against a real `ember serve`, and kill -9 in the middle of a run."""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.channels.cron import Scheduler
from ember.config.settings import Settings
from ember.core.events import ReplyRoute
from ember.core.messages import Message, Role, ToolCall
from ember.core.schedule import Schedule, ScheduleError, parse_duration
from ember.core.tasks import MissedPolicy, Task, TaskState, new_task_id
from ember.core.tools import Risk
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.tools.base import FunctionTool, ToolRegistry
from ember.tools.tasks import task_tools
from tests.conftest import CHANNEL, Harness, NoteArgs, serving_runtime
from tests.gatewayproc import EMBER, LaunchGateway
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply
from tests.pgserver import RUNTIMES, engine_settings


def utc(*parts: int) -> float:
    return datetime(*parts, tzinfo=UTC).timestamp()  # type: ignore[arg-type]


# --- schedules -----------------------------------------------------------------------------------

def test_a_daily_cron_keeps_its_local_hour_across_both_dst_changes() -> None:
    daily = Schedule.cron("0 9 * * *", "Europe/Berlin")
    spring = daily.upcoming(utc(2027, 3, 26, 12), 3)
    assert spring == [utc(2027, 3, 27, 8), utc(2027, 3, 28, 7), utc(2027, 3, 29, 7)]
    autumn = daily.upcoming(utc(2027, 10, 29, 12), 3)
    assert autumn == [utc(2027, 10, 30, 7), utc(2027, 10, 31, 8), utc(2027, 11, 1, 8)]


def test_weekdays_at_nine_skip_the_weekend() -> None:
    weekdays = Schedule.cron("0 9 * * 1-5", "America/New_York")
    runs = weekdays.upcoming(utc(2026, 12, 4, 15), 2)  # Friday 10:00 in New York
    assert runs == [utc(2026, 12, 7, 14), utc(2026, 12, 8, 14)]  # Monday, Tuesday 9:00 EST


@settings(max_examples=100, deadline=None)
@given(seconds=st.integers(1, 10_000), anchor=st.floats(0, 1e9), after=st.floats(0, 2e9))
def test_an_interval_runs_on_its_grid_strictly_after_any_time(seconds: int, anchor: float, after: float) -> None:
    every = Schedule.every(f"{seconds}s", anchor)
    runs = every.upcoming(after, 3)
    # The first run is one interval after the task was made, never at that moment.
    assert runs[0] > max(after, anchor) and runs[0] - max(after, anchor) <= seconds + 1e-6 * max(1.0, after)
    assert [round(b - a, 3) for a, b in itertools.pairwise(runs)] == [float(seconds)] * 2


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Schedule.cron("61 * * * *"), "not a cron expression"),
    (lambda: Schedule.cron("0 9 * * *", "Mars/Olympus"), "not a time zone"),
    (lambda: Schedule.every("0.5s", 0), "at least 1 s"),
    (lambda: Schedule.every("soon", 0), "not a duration"),
    (lambda: Schedule.at("next tuesday", 0), "not a time"),
])
def test_a_bad_schedule_says_how_to_write_one(make: Any, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        make()


def test_durations() -> None:
    assert [parse_duration(d) for d in ("1s", "90s", "5m", "1h30m", "2d", "1w")] == [
        1, 90, 300, 5400, 172800, 604800]


# --- runs on a fake clock ------------------------------------------------------------------------

@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """The runtime's task store (claim_due, runs, edits) on SQLite, on PostgreSQL, and on PostgreSQL
    with the Redis bus."""
    return engine_settings(settings, request.param, request)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    harness: Harness
    scheduler: Scheduler
    clock: Clock
    asked: list[str]

    async def at(self, t: float) -> None:
        """Move the clock to `t` and let the scheduler look."""
        self.clock.now = t
        await self.scheduler.fire_due()

    async def run_times(self, task_id: str) -> list[tuple[float, str]]:
        return sorted((r.scheduled_for, r.outcome) for r in await self.harness.runtime.tasks.runs(task_id))


SCHEDULE_CALL = ToolCall(id="c1", name="schedule_task", arguments=json.dumps(
    {"prompt": "Remind me to check the build", "cron": "0 9 * * *", "tz": "Europe/Berlin"}))


def scripted(asked: list[str], extra: dict[str, list[ModelReply]] | None = None) -> FunctionModel:
    """Asked to schedule: calls schedule_task, then says what the tool said; a run: answers its prompt."""
    scripts = {k: list(v) for k, v in (extra or {}).items()}

    def reply(messages: list[Message], tools: object) -> ModelReply:
        last = messages[-1]
        if last.role is Role.TOOL:
            return ModelReply(text=f"Done. {last.content}")
        asked.append(last.content)
        if scripts.get(last.content):
            return scripts[last.content].pop(0)
        if "every day at 9" in last.content:
            return ModelReply(text="", tool_calls=(SCHEDULE_CALL,))
        return ModelReply(text=f"Reminder: {last.content}")

    return FunctionModel(reply)


@asynccontextmanager
async def rig(settings: Settings, start: float, *, tools: list[Any] | None = None,
              extra: dict[str, list[ModelReply]] | None = None) -> AsyncIterator[Rig]:
    asked: list[str] = []
    clock = Clock(start)
    registry = ToolRegistry(tools or [])
    async with serving_runtime(settings, scripted(asked, extra), tools=registry, channels=[CHANNEL]) as h:
        h.runtime.tasks.clock = clock
        for tool in task_tools(h.runtime.tasks):  # the scheduling tools, on the runtime's own store
            registry.register(tool)
        scheduler = Scheduler(h.runtime.bus, h.runtime.tasks, clock=clock, poll_s=3600)  # fired by hand
        yield Rig(h, scheduler, clock, asked)


async def closing_text(h: Harness, chat: str) -> str:
    return (await h.next_closing(chat)).text


async def test_a_task_made_from_chat_fires_at_its_local_time_across_dst_answered_in_that_chat(
        settings: Settings) -> None:
    async with rig(settings, utc(2027, 3, 26, 12)) as r:
        await r.harness.publish("remind me every day at 9 to check the build", chat="creator")
        said = await closing_text(r.harness, "creator")
        assert "2027-03-27 09:00:00 CET, 2027-03-28 09:00:00 CEST, 2027-03-29 09:00:00 CEST" in said
        [task] = await r.harness.runtime.tasks.list()
        assert (task.identity, task.reply) == ("test:tester", ReplyRoute(CHANNEL, "creator"))

        await r.at(utc(2027, 3, 27, 7, 59, 59))
        assert await r.run_times(task.id) == []
        for fire in (utc(2027, 3, 27, 8), utc(2027, 3, 28, 7), utc(2027, 3, 29, 7, 0, 30)):
            await r.at(fire)
            assert await closing_text(r.harness, "creator") == "Reminder: Remind me to check the build"
            await r.at(fire + 30)  # looked at again: nothing more is due
        assert await r.run_times(task.id) == [
            (utc(2027, 3, 27, 8), "run"), (utc(2027, 3, 28, 7), "run"), (utc(2027, 3, 29, 7), "run")]
        assert r.asked.count("Remind me to check the build") == 3
        assert set(r.harness.chats) == {"creator"}  # no other chat got anything
        history = await r.harness.runtime.sessions.history(task.session_key)
        assert [m.role for m in history] == [Role.USER, Role.ASSISTANT] * 3


async def add_task(r: Rig, schedule: Schedule, missed: MissedPolicy = MissedPolicy.SKIP, *,
                   grant: bool = False, prompt: str = "tick") -> Task:
    return await r.harness.runtime.tasks.add(Task(
        id=new_task_id(), identity="test:tester", prompt=prompt, schedule=schedule,
        reply=ReplyRoute(CHANNEL, "c1"), missed=missed, grant_approvals=grant))


@pytest.mark.parametrize(("policy", "runs"), [(MissedPolicy.SKIP, 0), (MissedPolicy.RUN_ONCE, 1)])
async def test_runs_missed_while_down_are_recorded_and_follow_the_tasks_policy(
        settings: Settings, policy: MissedPolicy, runs: int) -> None:
    start = utc(2027, 1, 1)
    async with rig(settings, start) as r:
        task = await add_task(r, Schedule.every("1h", start), policy)
        await r.at(start + 5 * 3600 + 120)  # five runs fell due while Ember was down
        for _ in range(runs):
            await closing_text(r.harness, "c1")
        await r.harness.settled()  # every run fired has been answered
        recorded = await r.run_times(task.id)
        assert [outcome for _, outcome in recorded].count("missed") == 5 - runs
        assert [outcome for _, outcome in recorded].count("run") == runs
        assert r.asked.count("tick") == runs
        after = await r.harness.runtime.tasks.get(task.id)
        assert after is not None and after.next_run_at == start + 6 * 3600


async def test_a_one_time_task_runs_once_and_is_done(settings: Settings) -> None:
    start = utc(2027, 1, 1)
    async with rig(settings, start) as r:
        task = await add_task(r, Schedule.at("+10m", start))
        await r.at(start + 600)
        await closing_text(r.harness, "c1")
        await r.at(start + 1200)
        await r.harness.settled()
        done = await r.harness.runtime.tasks.get(task.id)
        assert done is not None and (done.state, done.next_run_at, done.runs) == (TaskState.DONE, None, 1)
        assert r.asked == ["tick"]


async def test_paused_tasks_do_not_run_and_resume_from_now(settings: Settings) -> None:
    start = utc(2027, 1, 1)
    async with rig(settings, start) as r:
        task = await add_task(r, Schedule.every("1m", start))
        await r.harness.runtime.tasks.set_state(task.id, TaskState.PAUSED)
        await r.at(start + 600)
        resumed = await r.harness.runtime.tasks.set_state(task.id, TaskState.ACTIVE)
        assert resumed is not None and resumed.next_run_at == start + 660
        await r.harness.settled()
        assert r.asked == [] and await r.run_times(task.id) == []


def asking_tool(calls: list[str]) -> FunctionTool[NoteArgs]:
    async def deploy(args: NoteArgs) -> str:
        calls.append(args.text)
        return f"deployed {args.text}"

    return FunctionTool("deploy", "Deploy.", NoteArgs, deploy, risk=Risk.EXECUTE)  # policy: ask


@pytest.mark.parametrize("grant", [False, True])
async def test_an_unattended_run_is_denied_what_would_ask_unless_granted(settings: Settings, grant: bool) -> None:
    start = utc(2027, 1, 1)
    calls: list[str] = []
    deploy = ModelReply(text="", tool_calls=(ToolCall(id="d1", name="deploy", arguments='{"text": "v2"}'),))
    async with rig(settings, start, tools=[asking_tool(calls)], extra={"ship it": [deploy]}) as r:
        await add_task(r, Schedule.at("+1m", start), grant=grant, prompt="ship it")
        await r.at(start + 60)
        said = await closing_text(r.harness, "c1")
    assert calls == (["v2"] if grant else [])
    assert ("deployed v2" if grant else "cannot ask for it") in said


# --- a real `ember serve` ------------------------------------------------------------------------

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef0"


def cron(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    from tests.gatewayproc import gateway_env

    return subprocess.run([EMBER, "cron", *args], env=gateway_env(home, None, None), capture_output=True,
                          text=True, timeout=60)


def task_rows(home: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(f"file:{home / 'ember.db'}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT role, content FROM messages WHERE session_key LIKE 'cron:%' "
                            "ORDER BY created_at").fetchall()


def test_ember_serve_picks_up_a_task_added_by_the_cli_within_seconds(launch_gateway: LaunchGateway,
                                                                     model_server: ModelServer,
                                                                     tmp_path: Path) -> None:
    model_server.responder = lambda body: Reply(text="tock")
    gateway = launch_gateway(model_server)
    added = cron(gateway.home, "add", "--every", "1s", "--prompt", "tick", "--json")
    assert added.returncode == 0, added.stderr
    task = json.loads(added.stdout)
    assert task["state"] == "active" and len(task["upcoming"]) == 3
    wait_until(lambda: ("assistant", "tock") in task_rows(gateway.home), timeout_s=15, what="a run")
    listed = json.loads(cron(gateway.home, "list", "--json").stdout)
    assert [t["id"] for t in listed] == [task["id"]] and listed[0]["runs"] >= 1
    assert cron(gateway.home, "pause", task["id"]).returncode == 0
    paused_at = len(task_rows(gateway.home))
    subprocess.run(["sleep", "2.5"], check=True)  # runs in flight at the pause finish; no new ones start
    settled = len(task_rows(gateway.home))
    subprocess.run(["sleep", "2"], check=True)
    assert len(task_rows(gateway.home)) == settled <= paused_at + 2
    assert cron(gateway.home, "remove", task["id"]).returncode == 0
    assert json.loads(cron(gateway.home, "list", "--json").stdout) == []
    bad = cron(gateway.home, "add", "--cron", "not cron", "--prompt", "x")
    assert bad.returncode == 1 and "not a cron expression" in bad.stderr


def test_tasks_over_http_are_scoped_by_identity(launch_gateway: LaunchGateway, model_server: ModelServer) -> None:
    gateway = launch_gateway(model_server, keys={"alice": ALICE, "bob": BOB})
    alice = httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=10)
    bob = httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {BOB}"}, timeout=10)
    made = alice.post("/api/tasks", json={"prompt": "water the plants", "cron": "0 8 * * *",
                                          "tz": "Europe/Berlin", "session": "home"})
    assert made.status_code == 201, made.text
    task = made.json()
    assert task["reply_to"] == "http:alice:home" and task["tz"] == "Europe/Berlin"
    assert all(line.endswith((" CET", " CEST")) and " 08:00:00 " in line for line in task["upcoming"])
    assert [t["id"] for t in alice.get("/api/tasks").json()] == [task["id"]]
    assert bob.get("/api/tasks").json() == []
    assert bob.get(f"/api/tasks/{task['id']}").status_code == 404
    assert bob.delete(f"/api/tasks/{task['id']}").status_code == 404
    assert alice.get(f"/api/tasks/{task['id']}").json()["recent_runs"] == []
    bad = alice.post("/api/tasks", json={"prompt": "x", "every": "0s"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_schedule"
    both = alice.post("/api/tasks", json={"prompt": "x", "every": "1h", "cron": "* * * * *"})
    assert both.status_code == 422 and "exactly one of cron, every or at" in both.text
    removed = alice.delete(f"/api/tasks/{task['id']}")
    assert removed.status_code == 200 and removed.json()["state"] == "removed"
    assert alice.get("/api/tasks").json() == []


def test_kill_9_in_the_middle_of_a_run_never_runs_it_twice(launch_gateway: LaunchGateway,
                                                           model_server: ModelServer) -> None:
    gateway = launch_gateway(model_server)
    model_server.push(Reply(text=" ".join(f"w{i}" for i in range(60)), chunk_delay_s=0.05))
    added = cron(gateway.home, "add", "--at", "+1s", "--prompt", "the one run", "--json")
    task = json.loads(added.stdout)
    wait_until(lambda: any(r["messages"][-1]["content"] == "the one run" for r in model_server.requests),
               timeout_s=15, what="the run to reach the model")
    gateway.kill()  # mid-stream: the run's message is committed, its answer is not
    model_server.push(Reply(text="finished after the restart"))
    restarted = launch_gateway(model_server, port=gateway.port)
    wait_until(lambda: ("assistant", "finished after the restart") in task_rows(restarted.home), timeout_s=20,
               what="the cut-off run to be finished")
    subprocess.run(["sleep", "1.5"], check=True)
    assert task_rows(restarted.home) == [("user", "the one run"), ("assistant", "finished after the restart")]
    [listed] = json.loads(cron(restarted.home, "list", "--json").stdout)
    assert (listed["id"], listed["state"], listed["runs"]) == (task["id"], "done", 1)
    with sqlite3.connect(f"file:{restarted.home / 'ember.db'}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT outcome FROM task_runs").fetchall() == [("run",)]


async def test_editing_a_task_revokes_its_approval_grant(settings: Settings) -> None:
    start = utc(2027, 1, 1)
    calls: list[str] = []
    deploy = ModelReply(text="", tool_calls=(ToolCall(id="d1", name="deploy", arguments='{"text": "v3"}'),))
    async with rig(settings, start, tools=[asking_tool(calls)], extra={"ship it again": [deploy]}) as r:
        task = await add_task(r, Schedule.at("+1m", start), grant=True, prompt="ship it")
        edited = await r.harness.runtime.tasks.edit(task.id, prompt="ship it again")
        assert edited is not None and not edited.grant_approvals
        await r.at(start + 60)
        said = await closing_text(r.harness, "c1")
    assert calls == [] and "cannot ask for it" in said
