"""A2A task records in the main store, shared by every gateway on the database (a2a-sdk's
VersionedTaskStore and TaskEventStream over Ember's `Database`).

A task is one row: the protocol's JSON of it, its owner (the caller's key name: a caller sees only
its own tasks), and `version`, which counts its writes. A write names the version it read and fails
(ConcurrentTaskModificationError) if another came first, except a cancel, which overrides any
task not yet ended: so a gateway running a task learns, at its next write, that another gateway
cancelled it, and stops. Each write also appends the event it applied to `a2a_task_events`, which
a stream resubscribed through another gateway follows by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

from a2a.server.cluster import (
    ConcurrentTaskModificationError,
    StoredTask,
    TaskEventStream,
    TaskVersion,
    VersionedEvent,
    VersionedTaskStore,
)
from a2a.server.cluster.database_event_stream import stream_response_to_event
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event
from a2a.types.a2a_pb2 import ListTasksRequest, ListTasksResponse, StreamResponse, Task, TaskState
from a2a.utils.constants import DEFAULT_LIST_TASKS_PAGE_SIZE
from a2a.utils.errors import InvalidParamsError
from a2a.utils.proto_utils import to_stream_response
from a2a.utils.task import ListTasksCursor, decode_list_tasks_cursor, encode_list_tasks_cursor
from google.protobuf.json_format import MessageToJson, Parse
from sqlalchemy import BigInteger, Text, and_, bindparam, delete, func, insert, or_, select

from ember.store import schema
from ember.store.engine import Database
from ember.store.tx import Statement, Tx

log = logging.getLogger(__name__)
_t, _e = schema.a2a_tasks, schema.a2a_task_events
ENDED = frozenset(TaskState.Name(s) for s in (TaskState.TASK_STATE_COMPLETED, TaskState.TASK_STATE_CANCELED,
                                               TaskState.TASK_STATE_FAILED, TaskState.TASK_STATE_REJECTED))
# A stream followed through another gateway needs only the events after the task it read first:
# older ones go.
EVENTS_KEPT_S = 3_600.0
POLL_S = 0.25

_mine = (_t.c.id == bindparam("id"), _t.c.owner == bindparam("owner"))
_GET = Statement(select(_t.c.task_json, _t.c.version).where(*_mine))
_STATE_FOR_CANCEL = Statement(select(_t.c.version, _t.c.state).where(*_mine).with_for_update())
_INSERT_NEW = Statement(
    "INSERT INTO a2a_tasks (id, owner, context_id, state, updated_ns, version, task_json) VALUES "
    "(:id, :owner, :context_id, :state, :updated_ns, :version, :task_json) ON CONFLICT (id) DO NOTHING")
_UPDATE = Statement(
    "UPDATE a2a_tasks SET context_id = :context_id, state = :state, updated_ns = :updated_ns, version = :version, "
    "task_json = :task_json WHERE id = :id AND owner = :owner AND version = :prev")
_DELETE = Statement(delete(_t).where(*_mine))
_APPEND = Statement(insert(_e).values(task_id=bindparam("id"), version=bindparam("version"),
                                      event_json=bindparam("event_json"), created_at=bindparam("now")))
_PRUNE = Statement(delete(_e).where(_e.c.created_at < bindparam("before")))
_FORGET_EVENTS = Statement(delete(_e).where(_e.c.task_id == bindparam("id")))
_EVENTS_AFTER = Statement(select(_e.c.seq, _e.c.version, _e.c.event_json)
                          .where(_e.c.task_id == bindparam("id"), _e.c.seq > bindparam("cursor"))
                          .order_by(_e.c.seq))
_START = Statement(select(func.coalesce(func.max(_e.c.seq), 0))
                   .where(_e.c.task_id == bindparam("id"), _e.c.version <= bindparam("version")))

# ListTasks: the caller's tasks by (has a timestamp, timestamp, id), newest first, as the SDK's own store.
_context = bindparam("context_id", type_=Text)
_state = bindparam("state", type_=Text)
_since = bindparam("since_ns", type_=BigInteger)
_FILTERS = (_t.c.owner == bindparam("owner"), or_(_context.is_(None), _t.c.context_id == _context),
            or_(_state.is_(None), _t.c.state == _state), or_(_since.is_(None), _t.c.updated_ns >= _since))
_cursor_ns, _cursor_id = bindparam("cursor_ns", type_=BigInteger), bindparam("cursor_id", type_=Text)
_AFTER_CURSOR = or_(
    _cursor_id.is_(None),
    and_(_cursor_ns.is_(None), _t.c.updated_ns.is_(None), _t.c.id < _cursor_id),
    and_(_cursor_ns.is_not(None), or_(_t.c.updated_ns < _cursor_ns, _t.c.updated_ns.is_(None),
                                      and_(_t.c.updated_ns == _cursor_ns, _t.c.id < _cursor_id))))
_COUNT = Statement(select(func.count()).select_from(_t).where(*_FILTERS))
_PAGE = Statement(select(_t.c.task_json, _t.c.updated_ns, _t.c.id).where(*_FILTERS, _AFTER_CURSOR)
                  .order_by(_t.c.updated_ns.is_(None), _t.c.updated_ns.desc(), _t.c.id.desc())
                  .limit(bindparam("limit")))

Owner = Callable[[ServerCallContext], str]


def task_row(task: Task, owner: str, version: int) -> dict[str, object]:
    """The row of `task` at `version` (for its first write, and for a copy from an older file)."""
    updated = task.status.timestamp.ToNanoseconds() if task.status.HasField("timestamp") else None
    return {"id": task.id, "owner": owner, "context_id": task.context_id, "state": TaskState.Name(task.status.state),
            "updated_ns": updated, "version": version, "task_json": MessageToJson(task)}


def _task(task_json: str) -> Task:
    return Parse(task_json, Task())


def _version_of(version: TaskVersion) -> int:
    value = version._value
    if not isinstance(value, int):
        raise TypeError(f"an A2A task version is a count, not {value!r}")
    return value


def _save(tx: Tx, row: dict[str, object], cancel: bool, prev: int, event_json: str | None) -> int:
    """Write the task's row; its new version. A stale `prev` (0: the first write) raises."""
    if cancel:
        current = tx.execute(_STATE_FOR_CANCEL, row).fetchone()
        if current is None or current[1] in ENDED:
            raise ConcurrentTaskModificationError(str(row["id"]))
        prev = current[0]
    version = prev + 1
    statement = _INSERT_NEW if prev == 0 else _UPDATE
    if tx.execute(statement, {**row, "version": version, "prev": prev}).rowcount != 1:
        raise ConcurrentTaskModificationError(str(row["id"]))
    if event_json is not None:
        now = time.time()
        tx.execute(_APPEND, {"id": row["id"], "version": version, "event_json": event_json, "now": now})
        tx.execute(_PRUNE, {"before": now - EVENTS_KEPT_S})
    return version


class SqlA2ATaskStore(VersionedTaskStore):
    def __init__(self, db: Database, owner: Owner) -> None:
        self._db = db
        self._owner = owner

    async def save(self, task: Task, *, event: Event | None, prev: Task | None, prev_version: TaskVersion,
                   context: ServerCallContext) -> TaskVersion:
        row = task_row(task, self._owner(context), 0)
        cancel = task.status.state == TaskState.TASK_STATE_CANCELED
        event_json = MessageToJson(to_stream_response(event)) if event is not None else None
        version = await self._db.run_write(lambda tx: _save(tx, row, cancel, _version_of(prev_version), event_json))
        return TaskVersion(version)

    async def get(self, task_id: str, context: ServerCallContext) -> StoredTask | None:
        found = await self._db.run_read(lambda tx: tx.execute(
            _GET, {"id": task_id, "owner": self._owner(context)}).fetchone())
        return StoredTask(_task(found[0]), TaskVersion(found[1])) if found else None

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        filters = {"owner": self._owner(context), "context_id": params.context_id or None,
                   "state": TaskState.Name(params.status) if params.status else None,
                   "since_ns": (params.status_timestamp_after.ToNanoseconds()
                                if params.HasField("status_timestamp_after") else None)}
        cursor = decode_list_tasks_cursor(params.page_token) if params.page_token else None
        if params.page_token and cursor is None:
            raise InvalidParamsError(f"Invalid page token: {params.page_token}")
        size = params.page_size or DEFAULT_LIST_TASKS_PAGE_SIZE
        page = {**filters, "cursor_ns": cursor.timestamp_ns if cursor else None,
                "cursor_id": cursor.task_id if cursor else None, "limit": size + 1}

        def read(tx: Tx) -> tuple[int, list[tuple[str, int | None, str]]]:
            return tx.execute(_COUNT, filters).fetchone()[0], [tuple(r) for r in tx.execute(_PAGE, page).fetchall()]

        total, rows = await self._db.run_read(read)
        more = len(rows) > size
        token = encode_list_tasks_cursor(ListTasksCursor(rows[size - 1][1], rows[size - 1][2])) if more else None
        return ListTasksResponse(tasks=[_task(r[0]) for r in rows[:size]], total_size=total,
                                 next_page_token=token, page_size=size)

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        owner = self._owner(context)

        def forget(tx: Tx) -> None:
            if tx.execute(_DELETE, {"id": task_id, "owner": owner}).rowcount:
                tx.execute(_FORGET_EVENTS, {"id": task_id})

        await self._db.run_write(forget)


class SqlA2ATaskEvents(TaskEventStream):
    """The events the task store appended, followed by polling (the store writes them: publish does nothing)."""

    def __init__(self, db: Database, poll_s: float = POLL_S) -> None:
        self._db = db
        self._poll_s = poll_s

    async def publish(self, task_id: str, event: VersionedEvent) -> None:
        del task_id, event

    async def subscribe(self, task_id: str, *, after: TaskVersion) -> AsyncGenerator[VersionedEvent, None]:
        version = _version_of(after)
        cursor = await self._db.run_read(lambda tx: tx.execute(
            _START, {"id": task_id, "version": version}).fetchone()[0]) if version else 0
        while True:
            rows = await self._db.run_read(lambda tx, at=cursor: tx.execute(
                _EVENTS_AFTER, {"id": task_id, "cursor": at}).fetchall())
            for seq, event_version, event_json in rows:
                cursor = seq
                if event_version > version:
                    yield VersionedEvent(stream_response_to_event(Parse(event_json, StreamResponse())),
                                         TaskVersion(event_version))
            if not rows:
                await asyncio.sleep(self._poll_s)

    async def destroy(self, task_id: str) -> None:
        del task_id  # its events go with age


_OLD_COLUMNS = ("id", "context_id", "kind", "owner", "status", "artifacts", "history", "metadata", "protocol_version")
_OLD_JSON = ("status", "artifacts", "history", "metadata")


def _read_task_file(path: Path) -> list[dict[str, object]]:
    """The rows of the SDK's table in an old task file, as its model's fields; none without a table
    (the SDK made it at the first call: a gateway never called left none)."""
    with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'a2a_tasks'").fetchone():
            return []
        rows = conn.execute(f"SELECT {', '.join(_OLD_COLUMNS)} FROM a2a_tasks").fetchall()
    fields = [dict(zip(_OLD_COLUMNS, row, strict=True)) for row in rows]
    for row in fields:
        row.update({name: json.loads(row[name]) for name in _OLD_JSON if isinstance(row[name], str)})
        row["task_metadata"] = row.pop("metadata")
    return fields


async def import_task_file(db: Database, path: Path) -> int:
    """Copy the tasks of a gateway's own task file (EMBER_HOME/a2a.db, where they were kept before
    they moved into the store) into `db`, then rename it `a2a.db.migrated`, so it is copied once.
    Returns how many tasks were copied; a task already in the store is left as it is."""
    from a2a.server.models import TaskModel
    from a2a.server.tasks import DatabaseTaskStore
    from sqlalchemy.ext.asyncio import create_async_engine

    # The SDK's own reading of its rows, which knows the older protocol's too; it never connects.
    reader = DatabaseTaskStore(create_async_engine("sqlite+aiosqlite://"), create_table=False)
    fields = await asyncio.to_thread(_read_task_file, path)
    rows = [task_row(reader._from_orm(TaskModel(**row)), str(row["owner"] or ""), 1) for row in fields]
    copied = await db.run_write(lambda tx: sum(tx.execute(_INSERT_NEW, row).rowcount for row in rows)) if rows else 0
    with contextlib.suppress(FileNotFoundError):  # another process sharing the home moved it first
        await asyncio.to_thread(path.rename, path.with_name(path.name + ".migrated"))
    log.info("copied %d of %d A2A tasks from %s into the store", copied, len(rows), path)
    return copied
