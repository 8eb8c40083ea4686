"""Counting what a turn costs, deterministically: the store's transactions and statements, the
texts embedded and the model calls, each by who caused it. For the per-turn budgets
(tests/test_turn_budget.py); bench/roundtrips.py counts the same store traffic for the benches,
by the SQLite file's own statements.

Store traffic is counted at the one seam every store goes through, `Database` (store/engine.py):
each `run_write` / `run_read` call and each `write()` / `read()` block is one transaction of
its side, charged to the asyncio task that asked for it. Counting units of work rather than
COMMITs keeps the counts independent of timing: SQLite's group commit may carry several units
under one COMMIT, and how many it gathers depends on who was queued at that instant. A
statement is one `execute` or `executemany` a unit sends (BEGIN, COMMIT and ROLLBACK are the
transaction itself): a read by the `Tx` its unit is handed, as are SQLite's writes on its
one-hop thread; PostgreSQL's writes as asyncpg is sent them (store/pg_direct.py), the
lease check that fences them included; and wherever SQLAlchemy runs a statement (the
`write()` / `read()` blocks) by its engine events; the last two charged through a context
variable to the unit that is open.
"""

from __future__ import annotations

import asyncio
import re
import threading
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from sqlalchemy import event
from sqlalchemy.engine import Engine

from ember.core.messages import Message, Role
from ember.core.tools import ToolSpec
from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.memory.embeddings import HashingEmbedder
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.runtime.titles import TITLE_INSTRUCTION
from ember.store.engine import Database
from ember.store.pg_direct import PgDirectTx
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tx import Params, Rows, Statement, Tx, Work

T = TypeVar("T")

WRITE, READ = "write", "read"
TEST = "the test"  # the test's own reads (waiting for the queue to drain): never counted
# Whose work is the turn's own path, from the message taken off the bus to the final delivered
# and marked so: the turn's task, and the delivery worker that records the answer reached its channel.
TURN_PATH = frozenset({"ember-turn", "ember-delivery"})
_FRAMING = re.compile(r"\s*(BEGIN|COMMIT|ROLLBACK)\b", re.IGNORECASE)


def task_name(task: asyncio.Task[Any]) -> str:
    """A task's name without the session it serves: "ember-turn-http:c1" -> "ember-turn"."""
    name = task.get_name()
    for prefix in ("ember-turn-", "ember-lease-", "ember-channel-"):
        if name.startswith(prefix):
            return prefix.rstrip("-")
    return name


class Senders:
    """Who is running now, by the task's name; a task of asyncio's default name ("Task-12") is
    its creator's: the runtime hands a step it awaits to a task of its own (a write that must
    finish despite a cancellation, an index one caller builds while the others wait for it).
    `ignored` tasks (the test's own) are TEST. Knows the creators of the tasks made while installed
    on the running loop (`with senders.tracking():`)."""

    def __init__(self) -> None:
        self._creators: weakref.WeakKeyDictionary[asyncio.Task[Any], asyncio.Task[Any]] = (
            weakref.WeakKeyDictionary())
        self.ignored: set[asyncio.Task[Any]] = set()

    @contextmanager
    def tracking(self) -> Iterator[Senders]:
        loop = asyncio.get_running_loop()
        before = loop.get_task_factory()

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Future[Any]:
            task = before(loop, coro, **options) if before else asyncio.Task(coro, loop=loop, **options)
            creator = asyncio.current_task(loop)
            if creator is not None and isinstance(task, asyncio.Task):
                self._creators[task] = creator
            return task

        loop.set_task_factory(factory)
        try:
            yield self
        finally:
            loop.set_task_factory(before)

    def now(self) -> str:
        task = asyncio.current_task()
        while task is not None and task not in self.ignored and re.fullmatch(r"Task-\d+", task.get_name()):
            task = self._creators.get(task)
        if task is None:
            return "unnamed"
        return TEST if task in self.ignored else task_name(task)


@dataclass(frozen=True, slots=True)
class _Unit:
    sender: str
    side: str
    whole: bool  # a run_write / run_read unit: a write() / read() its engine opens for it is the same one


_OPEN: ContextVar[_Unit | None] = ContextVar("ember_counted_unit", default=None)


@dataclass(frozen=True, slots=True)
class StoreCounts:
    """Transactions and statements per (sender, side); a difference of two is what happened between."""

    transactions: Counter[tuple[str, str]]
    statements: Counter[tuple[str, str]]

    def __sub__(self, earlier: StoreCounts) -> StoreCounts:
        return StoreCounts(self.transactions - earlier.transactions, self.statements - earlier.statements)

    def total(self, kind: str, side: str, senders: Callable[[str], bool] = lambda _: True) -> int:
        counts = self.transactions if kind == "transactions" else self.statements
        return sum(n for (who, s), n in counts.items() if s == side and senders(who))

    def by_sender(self) -> dict[str, str]:
        """Each sender's "writes w (s statements), reads r (s)", for a failure's message."""
        names = sorted({who for who, _ in (*self.transactions, *self.statements)})
        return {who: ", ".join(f"{side}s {self.transactions[who, side]} ({self.statements[who, side]} stmts)"
                               for side in (WRITE, READ)) for who in names}


class StoreCounter:
    """Counts a runtime's store traffic by sender, from its construction until `close()`.

    It wraps the four methods of the runtime's own `db` object in place (the stores call them by
    attribute on every use), so what was opened and migrated before is not counted. What the
    test's own tasks ask (TEST, by `senders`) is left out.
    """

    def __init__(self, db: Database, senders: Senders) -> None:
        self._db = db
        self._senders = senders
        self._sqlite = isinstance(db, SqliteDatabase)
        self._lock = threading.Lock()  # the one-hop threads count too
        self._transactions: Counter[tuple[str, str]] = Counter()
        self._statements: Counter[tuple[str, str]] = Counter()
        self._originals = {name: getattr(db, name) for name in ("run_write", "run_read", "write", "read")}
        db.run_write = self._whole(self._originals["run_write"], WRITE)  # type: ignore[method-assign]
        db.run_read = self._whole(self._originals["run_read"], READ)  # type: ignore[method-assign]
        db.write = self._block(self._originals["write"], WRITE)  # type: ignore[method-assign]
        db.read = self._block(self._originals["read"], READ)  # type: ignore[method-assign]
        event.listen(Engine, "before_cursor_execute", self._executed)
        # PostgreSQL's units run on asyncpg, out of the engine's sight: counted as they send.
        self._direct = {} if self._sqlite else {name: getattr(PgDirectTx, name) for name in ("execute", "executemany")}
        for name, method in self._direct.items():
            setattr(PgDirectTx, name, self._sent(method))

    def snapshot(self) -> StoreCounts:
        with self._lock:
            return StoreCounts(Counter(self._transactions), Counter(self._statements))

    def close(self) -> None:
        event.remove(Engine, "before_cursor_execute", self._executed)
        for name, method in self._direct.items():
            setattr(PgDirectTx, name, method)
        for name in self._originals:
            delattr(self._db, name)  # the class's own methods again

    def _add(self, counts: Counter[tuple[str, str]], unit: _Unit) -> None:
        if unit.sender != TEST:
            with self._lock:
                counts[unit.sender, unit.side] += 1

    @contextmanager
    def _opened(self, who: str, side: str, whole: bool):  # type: ignore[no-untyped-def]
        outer = _OPEN.get()
        if outer is not None and outer.whole:  # the engine's own block for a unit already counted
            yield outer
            return
        unit = _Unit(who, side, whole)
        self._add(self._transactions, unit)
        token = _OPEN.set(unit)
        try:
            yield unit
        finally:
            _OPEN.reset(token)

    def _whole(self, original: Callable[[Work[T]], Awaitable[T]], side: str) -> Callable[[Work[T]], Awaitable[T]]:
        def call(work: Work[T]) -> Awaitable[T]:
            # Who calls, taken at the call: a write that must finish despite a cancellation is
            # awaited in a task of its own (store/engine.py's complete_despite_cancel).
            return run(work, self._senders.now())

        async def run(work: Work[T], who: str) -> T:
            with self._opened(who, side, whole=True) as unit:
                # Counted by its `Tx`: on SQLite the unit runs on a thread of its own, out of
                # SQLAlchemy's sight, and a read may run in a batch another unit started.
                return await original(self._counted(work, unit) if self._sqlite or side == READ else work)
        return call

    def _block(self, original: Callable[[], AbstractAsyncContextManager[Any]],
               side: str) -> Callable[[], AbstractAsyncContextManager[Any]]:
        @asynccontextmanager
        async def block() -> AsyncIterator[Any]:
            with self._opened(self._senders.now(), side, whole=False):
                async with original() as conn:
                    yield conn
        return block

    def _counted(self, work: Work[T], unit: _Unit) -> Work[T]:
        return lambda tx: work(_CountingTx(tx, lambda: self._add(self._statements, unit)))

    def _executed(self, _conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if not _FRAMING.match(statement):
            self._sent_by_open_unit()

    def _sent(self, method: Callable[..., T]) -> Callable[..., T]:
        def send(tx: PgDirectTx, *args: Any) -> T:
            self._sent_by_open_unit()
            return method(tx, *args)
        return send

    def _sent_by_open_unit(self) -> None:
        # A whole read's statements are counted by its `Tx`: it may run in a batch another unit started.
        unit = _OPEN.get()
        if unit is not None and not (unit.whole and unit.side == READ):
            self._add(self._statements, unit)


class _CountingTx:
    """A unit's `Tx`, counting each statement it sends."""

    __slots__ = ("_count", "_tx", "dialect")

    def __init__(self, tx: Tx, count: Callable[[], None]) -> None:
        self._tx, self._count, self.dialect = tx, count, tx.dialect

    def execute(self, statement: Statement, params: Params | None = None) -> Rows:
        self._count()
        return self._tx.execute(statement, params)

    def executemany(self, statement: Statement, rows: Sequence[Params]) -> None:
        self._count()
        self._tx.executemany(statement, rows)


class CountingEmbedder(HashingEmbedder):
    """The hashing embedder, counting the texts (and their characters) it is asked to embed, as
    queries (the turn's recall) and as passages (what is stored) apart."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # embedders are called from threads of their own
        self.texts: Counter[str] = Counter()
        self.chars: Counter[str] = Counter()

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        self._tally("queries", texts)
        return super().embed_passages(texts)  # not embed_queries: that would count them again

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        self._tally("passages", texts)
        return super().embed_passages(texts)

    def _tally(self, kind: str, texts: Sequence[str]) -> None:
        with self._lock:
            self.texts[kind] += len(texts)
            self.chars[kind] += sum(len(text) for text in texts)


ANSWER = "Sure, noted."
SUMMARY = '{"summary": "The user said hello a few times.", "facts": []}'
TITLE = "Saying hello"


class CountingModel(FunctionModel):
    """Answers every request as a plain turn's model would (a short text; a consolidation's JSON;
    a title), counting the calls by what was asked and by whom: `calls[(sender, purpose)]`."""

    def __init__(self, senders: Senders) -> None:
        super().__init__(self._reply, name="counting-model")
        self._senders = senders
        self.calls: Counter[tuple[str, str]] = Counter()

    def _reply(self, messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        system = messages[0].content if messages and messages[0].role is Role.SYSTEM else ""
        purpose, text = ("consolidation", SUMMARY) if system == SUMMARY_INSTRUCTION else (
            ("title", TITLE) if system == TITLE_INSTRUCTION else ("answer", ANSWER))
        self.calls[self._senders.now(), purpose] += 1
        if purpose == "answer":  # each answer its own text, as a model's are: none is embedded from a cache
            text = f"{ANSWER} ({messages[-1].content})"
        return ModelReply(text=text, input_tokens=10, output_tokens=3)
