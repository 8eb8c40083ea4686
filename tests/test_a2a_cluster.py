"""A2A tasks are in the main store: two `ember serve` on one PostgreSQL read, cancel and stream the
same tasks (the official a2a-sdk client), and a task file an earlier Ember kept in EMBER_HOME is
copied into the store once at start."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

import httpx
import pytest
from a2a.auth.user import User
from a2a.client import ClientConfig, create_client
from a2a.client.client import Client
from a2a.helpers import new_task_from_user_message, new_text_part
from a2a.server.cluster import ConcurrentTaskModificationError, TaskVersion, VersionedEvent
from a2a.server.context import ServerCallContext
from a2a.server.tasks import DatabaseTaskStore
from a2a.types import (
    Artifact,
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import TaskNotFoundError
from sqlalchemy.ext.asyncio import create_async_engine

from ember.channels.a2a import task_owner
from ember.store.a2a_tasks import SqlA2ATaskEvents, SqlA2ATaskStore, import_task_file
from ember.store.engine import Database
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, Reply, tool_call
from tests.pgserver import ENGINES, engine_database

ALICE, BOB = "alice-a2a-key-0123456789", "bob-a2a-key-0123456789ab"
KEYS = {"alice": ALICE, "bob": BOB}
POLICY = """
[tool_policy]
write = "ask"
timeout_s = 120
"""


@asynccontextmanager
async def client(gateway: GatewayProcess, key: str = ALICE, *, streaming: bool = False) -> AsyncIterator[Client]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as transport:
        made = await create_client(gateway.base_url, ClientConfig(streaming=streaming, httpx_client=transport))
        try:
            yield made
        finally:
            await made.close()


def request(text: str) -> SendMessageRequest:
    return SendMessageRequest(message=Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex,
                                              parts=[Part(text=text)]))


def states(responses: list[StreamResponse]) -> list[int]:
    found = []
    for response in responses:
        kind = response.WhichOneof("payload")
        if kind == "task":
            found.append(response.task.status.state)
        elif kind == "status_update":
            found.append(response.status_update.status.state)
    return found


async def collect(stream: AsyncIterator[StreamResponse], into: list[StreamResponse]) -> None:
    async for response in stream:
        into.append(response)


async def test_a_task_created_through_one_gateway_is_read_followed_and_cancelled_through_another(
        launch_gateway: LaunchGateway, model_server: ModelServer, pg_database: str, tmp_path: Path) -> None:
    first, second = (gateway_on(launch_gateway, model_server, tmp_path / name, pg_database) for name in ("one", "two"))
    held = threading.Event()
    model_server.push(Reply(text="An answer that comes too late.", hold=held))
    sent: list[StreamResponse] = []
    followed: list[StreamResponse] = []
    async with client(first, streaming=True) as alice_one, client(second, streaming=True) as alice_two, \
            client(second, BOB) as bob_two:
        sending = asyncio.create_task(collect(alice_one.send_message(request("take your time")), sent))
        try:
            for _ in range(200):
                listed = await alice_two.list_tasks(ListTasksRequest())
                if listed.tasks:
                    break
                await asyncio.sleep(0.05)
            [task] = listed.tasks
            got = await alice_two.get_task(GetTaskRequest(id=task.id))
            assert got.status.state in (TaskState.TASK_STATE_SUBMITTED, TaskState.TASK_STATE_WORKING)
            assert got.history[0].parts[0].text == "take your time"
            with pytest.raises(TaskNotFoundError):  # another caller's task does not exist for bob
                await bob_two.get_task(GetTaskRequest(id=task.id))
            following = asyncio.create_task(collect(alice_two.subscribe(SubscribeToTaskRequest(id=task.id)),
                                                    followed))
            for _ in range(200):  # the resubscription reads the task first, then follows its events
                if followed:
                    break
                await asyncio.sleep(0.05)

            cancelled = await alice_two.cancel_task(CancelTaskRequest(id=task.id))
            assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
            await asyncio.wait_for(following, 30)  # the followed stream ends with the cancel
            # it starts where the task stood when followed: as `got` saw it, or working since
            assert got.status.state <= states(followed)[0] <= TaskState.TASK_STATE_WORKING
            assert states(followed)[-1] == TaskState.TASK_STATE_CANCELED
            held.set()  # the turn on the first gateway goes on, and learns at its next write
            await asyncio.wait_for(sending, 30)
        finally:
            held.set()
            sending.cancel()
            again = await alice_one.get_task(GetTaskRequest(id=task.id))
        assert again.status.state == TaskState.TASK_STATE_CANCELED
        assert "too late" not in "".join(p.text for artifact in again.artifacts for p in artifact.parts)
        await a_task_waiting_for_an_approval_is_cancelled_through_the_other_gateway(first, second, model_server)


def gateway_on(launch: LaunchGateway, model_server: ModelServer, home: Path, database: str) -> GatewayProcess:
    home.mkdir()
    (home / "ember.toml").write_text(POLICY)
    return launch(model_server, keys=KEYS, home=home, EMBER_DATABASE_URL=database)


async def a_task_waiting_for_an_approval_is_cancelled_through_the_other_gateway(
        first: GatewayProcess, second: GatewayProcess, model_server: ModelServer) -> None:
    """The turn waits in the first gateway: it learns of the cancel there, and its approval is denied."""
    name = f"cancelled-{uuid.uuid4().hex[:6]}.txt"
    model_server.push(Reply(tool_calls=(tool_call("write_file", path=name, content="no"),)), Reply(text="Stopped."))
    async with client(first) as alice_one, client(second) as alice_two:
        [waiting] = [r.task for r in [r async for r in alice_one.send_message(request(f"write {name}"))]
                     if r.WhichOneof("payload") == "task"][-1:]
        assert waiting.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
        cancelled = await alice_two.cancel_task(CancelTaskRequest(id=waiting.id))
        assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
    for _ in range(300):  # the first gateway looks about every second
        if model_server.requests and model_server.requests[-1]["messages"][-1]["role"] == "tool":
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the turn waiting in the first gateway did not go on after the cancel")
    assert "not permitted" in model_server.requests[-1]["messages"][-1]["content"]
    assert not (first.home / "workspaces" / "alice" / name).exists()


async def old_task_file(path: Path) -> str:
    """An EMBER_HOME/a2a.db as an earlier Ember left it: the SDK's own store, one task of alice's."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    # The SDK's model of its default table (one of another name is declared once per process), renamed below.
    store = DatabaseTaskStore(engine, owner_resolver=task_owner)
    task = new_task_from_user_message(Message(role=Role.ROLE_USER, message_id="m1", parts=[new_text_part("hello")]))
    task.status.state = TaskState.TASK_STATE_COMPLETED
    task.artifacts.append(Artifact(artifact_id="answer", name="answer", parts=[new_text_part("Kept from before.")]))
    context = ServerCallContext(user=_Alice())
    await store.save(task, context)
    await engine.dispose()
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE tasks RENAME TO a2a_tasks")
    return task.id


class _Alice(User):
    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return "alice"


async def test_an_old_task_file_is_copied_into_the_store_once(launch_gateway: LaunchGateway,
                                                               model_server: ModelServer, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    task_id = await old_task_file(home / "a2a.db")
    gateway = launch_gateway(model_server, keys=KEYS, home=home)
    assert not (home / "a2a.db").exists() and (home / "a2a.db.migrated").exists()
    async with client(gateway) as alice:
        kept = await alice.get_task(GetTaskRequest(id=task_id))
        assert kept.status.state == TaskState.TASK_STATE_COMPLETED
        assert kept.artifacts[0].parts[0].text == "Kept from before."
        assert [t.id for t in (await alice.list_tasks(ListTasksRequest())).tasks] == [task_id]
    assert gateway.stop() == 0
    again = launch_gateway(model_server, keys=KEYS, home=home, port=gateway.port)  # copied once: nothing to do
    async with client(again) as alice:
        assert (await alice.get_task(GetTaskRequest(id=task_id))).status.state == TaskState.TASK_STATE_COMPLETED


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    database = await engine_database(request.param, request, tmp_path)
    yield database  # type: ignore[misc]
    await database.close()


def owned_by(name: str) -> Callable[[ServerCallContext], str]:
    return lambda context: name


def a_task(state: TaskState.ValueType, text: str = "hello") -> Task:
    task = new_task_from_user_message(Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex,
                                              parts=[new_text_part(text)]))
    task.status.state = state
    task.status.timestamp.GetCurrentTime()
    return task


CONTEXT = ServerCallContext(user=_Alice())


async def test_a_write_names_the_version_it_read_and_a_cancel_overrides_a_running_task(db: Database) -> None:
    store = SqlA2ATaskStore(db, owned_by("alice"))
    task = a_task(TaskState.TASK_STATE_WORKING)
    first = await store.save(task, event=None, prev=None, prev_version=TaskVersion.MISSING, context=CONTEXT)
    with pytest.raises(ConcurrentTaskModificationError):  # a second first write
        await store.save(task, event=None, prev=None, prev_version=TaskVersion.MISSING, context=CONTEXT)
    second = await store.save(task, event=None, prev=task, prev_version=first, context=CONTEXT)
    with pytest.raises(ConcurrentTaskModificationError):  # written from a version another write replaced
        await store.save(task, event=None, prev=task, prev_version=first, context=CONTEXT)
    assert second.is_after(first)

    cancelled = Task()
    cancelled.CopyFrom(task)
    cancelled.status.state = TaskState.TASK_STATE_CANCELED
    update = TaskStatusUpdateEvent(task_id=task.id, context_id=task.context_id, status=cancelled.status)
    third = await store.save(cancelled, event=update, prev=task, prev_version=first, context=CONTEXT)
    with pytest.raises(ConcurrentTaskModificationError):  # an ended task is not cancelled again
        await store.save(cancelled, event=None, prev=task, prev_version=third, context=CONTEXT)
    stored = await store.get(task.id, CONTEXT)
    assert stored is not None and stored.version == third
    assert stored.task.status.state == TaskState.TASK_STATE_CANCELED
    assert await SqlA2ATaskStore(db, owned_by("bob")).get(task.id, CONTEXT) is None

    [event] = [e async for e in _first(SqlA2ATaskEvents(db, poll_s=0.01).subscribe(task.id, after=second), 1)]
    assert event.version == third and event.event == update


async def _first(stream: AsyncIterator[VersionedEvent], count: int) -> AsyncIterator[VersionedEvent]:
    async with aclosing(stream):  # type: ignore[type-var]
        async for event in stream:
            yield event
            count -= 1
            if not count:
                return


async def test_list_pages_through_the_callers_tasks_newest_first(db: Database) -> None:
    store = SqlA2ATaskStore(db, owned_by("alice"))
    made = []
    for n in range(5):
        task = a_task(TaskState.TASK_STATE_COMPLETED if n % 2 else TaskState.TASK_STATE_WORKING, f"task {n}")
        task.status.timestamp.FromNanoseconds(1_700_000_000_000_000_000 + n)
        await store.save(task, event=None, prev=None, prev_version=TaskVersion.MISSING, context=CONTEXT)
        made.append(task.id)
    await SqlA2ATaskStore(db, owned_by("bob")).save(a_task(TaskState.TASK_STATE_WORKING), event=None, prev=None,
                                                    prev_version=TaskVersion.MISSING, context=CONTEXT)
    seen, token = [], ""
    while True:
        page = await store.list(ListTasksRequest(page_size=2, page_token=token), CONTEXT)
        assert page.total_size == 5
        seen += [t.id for t in page.tasks]
        if not page.next_page_token:
            break
        token = page.next_page_token
    assert seen == made[::-1]
    done = await store.list(ListTasksRequest(status=TaskState.TASK_STATE_COMPLETED), CONTEXT)
    assert [t.id for t in done.tasks] == [made[3], made[1]] and done.total_size == 2


async def test_an_old_task_file_without_a_table_or_with_a_task_already_copied_is_set_aside(
        db: Database, tmp_path: Path) -> None:
    empty = tmp_path / "empty" / "a2a.db"
    empty.parent.mkdir()
    sqlite3.connect(empty).close()  # a gateway never called: the SDK had made no table yet
    assert await import_task_file(db, empty) == 0 and (empty.parent / "a2a.db.migrated").exists()
    old = tmp_path / "a2a.db"
    task_id = await old_task_file(old)
    assert await import_task_file(db, old) == 1
    (tmp_path / "a2a.db.migrated").rename(old)
    assert await import_task_file(db, old) == 0  # copied before: the store's row stands
    stored = await SqlA2ATaskStore(db, task_owner).get(task_id, CONTEXT)
    assert stored is not None and stored.task.artifacts[0].parts[0].text == "Kept from before."
