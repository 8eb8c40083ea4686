"""Counting what a runtime sends to its SQLite database, for the benchmarks.

Statements reach the store two ways: through SQLAlchemy's engines (seen by
its engine events) and through the threads that take a whole transaction in
one hop on stdlib sqlite3 connections (seen by a trace callback set on them).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from ember.store.engine import Database

# A SQL statement starting with one of these writes (or takes SQLite's write lock).
WRITE_PREFIXES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "BEGIN IMMEDIATE", "BEGIN EXCLUSIVE")


class RoundTrips:
    """Statements and transactions the runtime sends to its database, through
    either way in: SQLAlchemy's engine events (every Engine, filtered to one
    database file), and, once `attach`ed, a trace callback on the connections of
    the threads that take a whole transaction in one hop (`run_write`, `run_read`).

    A transaction is a write when it takes SQLite's write lock (BEGIN IMMEDIATE)
    or changes a row; its statements count on the same side. Each is also
    tallied by the asyncio task that ran it ("ember-turn", "ember-delivery", ...);
    the bench's own reads (`ignore`) are left out.
    """

    def __init__(self, database: Path) -> None:
        self._database = str(database)
        self._open: dict[int, list[Any]] = {}  # connection -> [statements, is_write, task group]
        self.statements: Counter[str] = Counter()
        self.transactions: Counter[str] = Counter()
        self.by_task: Counter[str] = Counter()
        self.ignore: asyncio.Task[Any] | None = None
        self._listeners: list[tuple[str, Callable[..., None]]] = [
            ("before_cursor_execute", self._statement), ("commit", self._end), ("rollback", self._end),
        ]
        for name, fn in self._listeners:
            event.listen(Engine, name, fn)

    async def attach(self, db: Database) -> None:
        """Trace the one-hop threads' connections; sqlite3 wants that set on their own thread.
        Their statements run on those threads, outside any task: they count under the thread's name."""
        for thread, direct in (("one-hop writer", db._direct_writer), ("one-hop reader", db._direct_reader)):
            await direct.read(lambda tx, thread=thread: tx.connection.set_trace_callback(self._traced(thread)))

    def _traced(self, thread: str) -> Callable[[str], None]:
        tally = [0, False]  # statements, is_write: one transaction at a time per thread

        def count(sql: str) -> None:
            if sql in ("COMMIT", "ROLLBACK"):
                if tally[0]:
                    self._count(tally[0], tally[1], thread)
                tally[:] = [0, False]
                return
            tally[0] += 1
            tally[1] = tally[1] or sql.lstrip().upper().startswith(WRITE_PREFIXES)
        return count

    def close(self) -> None:
        for name, fn in self._listeners:
            with suppress(Exception):
                event.remove(Engine, name, fn)

    def snapshot(self) -> Counter[str]:
        counts = Counter({f"{side} statements": n for side, n in self.statements.items()})
        counts.update({f"{side} transactions": n for side, n in self.transactions.items()})
        counts.update({f"task {group}": n for group, n in self.by_task.items()})
        return counts

    def _mine(self, conn: Connection) -> bool:
        return str(conn.engine.url.database) == self._database

    def _statement(self, conn: Connection, _cursor: object, statement: str, *_args: object) -> None:
        if not self._mine(conn):
            return
        task = current_task()
        if task is not None and task is self.ignore:
            return
        tally = self._open.setdefault(id(conn), [0, False, task_group(task)])
        tally[0] += 1
        tally[1] = tally[1] or statement.lstrip().upper().startswith(WRITE_PREFIXES)

    def _end(self, conn: Connection) -> None:
        tally = self._open.pop(id(conn), None)
        if tally is None or not self._mine(conn):
            return
        self._count(*tally)

    def _count(self, statements: int, is_write: bool, group: str) -> None:
        side = "write" if is_write else "read"
        self.statements[side] += statements
        self.transactions[side] += 1
        self.by_task[group] += statements + 1  # its statements and its COMMIT


def current_task() -> asyncio.Task[Any] | None:
    """The asyncio task running now; None outside any (another thread, no event loop)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def task_group(task: asyncio.Task[Any] | None) -> str:
    """The group a task's name puts it in, its first two words: "ember-turn-bench:plain"
    -> "ember-turn"; "unnamed tasks" for asyncio's default names, "no task" for None."""
    if task is None:
        return "no task"
    name = task.get_name()
    return "unnamed tasks" if re.fullmatch(r"Task-\d+", name) else "-".join(name.split("-")[:2])


def per_turn(counts: Counter[str], turns: int) -> list[str]:
    """The lines that report a RoundTrips snapshot difference over `turns` turns."""
    n = max(1, turns)
    ws, rs = counts["write statements"] / n, counts["read statements"] / n
    wt, rt = counts["write transactions"] / n, counts["read transactions"] / n
    senders = sorted(((k.removeprefix("task "), v) for k, v in counts.items() if k.startswith("task ")),
                     key=lambda kv: -kv[1])
    return [
        f"statements  : {ws:5.2f} write + {rs:5.2f} read  (BEGIN, SAVEPOINT and RELEASE included)",
        f"transactions: {wt:5.2f} write + {rt:5.2f} read  (each ends in one COMMIT; under load one group"
        " commit carries the writes of every turn queued at the writer)",
        f"round trips : {ws + rs + wt + rt:5.2f}  (statements + COMMITs; through aiosqlite each is a thread"
        " hop, through a one-hop thread a whole transaction is one)",
        "by sender   : " + ", ".join(f"{name} {v / n:.2f}" for name, v in senders)
        + "  (round trips, by the asyncio task or one-hop store thread that sent them)",
    ]
