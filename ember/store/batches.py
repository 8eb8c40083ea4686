"""Units of work asked together, run together: one transaction carries several units.

Reads (`ReadBatches`). The reads asked in the same instant share one read
transaction: a turn's profile and recall, and under load the reads of every
turn running, cost one BEGIN ... COMMIT and one pooled connection on
PostgreSQL, one hop to the reader thread on SQLite, instead of one each. A
batch is formed when its task first runs, a step of the event loop after the
first read of it was asked, so every read asked meanwhile joins it; the reads
asked while `in_flight` batches run wait for the next. Each unit reads in a
snapshot taken after it was asked, so it sees every write committed before.

Writes are batched by the SQLite engine alone (its group commit, each unit in
a savepoint); on PostgreSQL a batch of writes would take the row locks of
several sessions at once, which two processes could then wait on crosswise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ember.store.tx import Work

T = TypeVar("T")

MAX_BATCH = 32  # reads in one transaction: a batch's last read waits for all before it


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """How one unit of a batch ended: its value, or the error that undid it."""

    value: T | None = None
    error: BaseException | None = None


# A batch's units, run in one transaction: one outcome per unit that ran, in order. Fewer
# outcomes than units: the transaction could not go on after the last one (a failed
# statement aborts a PostgreSQL transaction), and the units after it are run again.
RunBatch = Callable[[Sequence[Work[Any]]], Awaitable[list[Outcome[Any]]]]


@dataclass(frozen=True, slots=True)
class _Asked:
    work: Work[Any]
    done: asyncio.Future[Any]


class ReadBatches:
    """`run(work)`: the read's result, its unit run in a transaction shared with the reads asked with it."""

    def __init__(self, run_batch: RunBatch, *, in_flight: int, max_batch: int = MAX_BATCH) -> None:
        if in_flight < 1 or max_batch < 1:
            raise ValueError("a read batch needs in_flight >= 1 and max_batch >= 1")
        self._run_batch = run_batch
        self._in_flight = in_flight
        self._max_batch = max_batch
        self._asked: list[_Asked] = []
        self._running = 0  # batches started, a starting one included
        self._starting = False  # a batch's task is started and has not taken its reads yet

    async def run(self, work: Work[T]) -> T:
        asked = _Asked(work, asyncio.get_running_loop().create_future())
        self._asked.append(asked)
        self._start()
        # A caller cancelled meanwhile leaves its read in the batch; the batch runs regardless.
        return await asked.done  # type: ignore[no-any-return]

    def _start(self) -> None:
        if self._asked and not self._starting and self._running < self._in_flight:
            self._starting = True
            self._running += 1
            asyncio.get_running_loop().create_task(self._batch(), name="ember-db-read")

    async def _batch(self) -> None:
        self._starting = False
        batch, self._asked = self._asked[:self._max_batch], self._asked[self._max_batch:]
        try:
            while batch:
                try:
                    outcomes = await self._run_batch([asked.work for asked in batch]) or [
                        Outcome(error=RuntimeError("a read batch ran none of its units"))] * len(batch)
                except Exception as exc:  # the transaction itself failed: every unit of it did
                    outcomes = [Outcome(error=exc)] * len(batch)
                for asked, outcome in zip(batch, outcomes):
                    _settle(asked.done, outcome)
                batch = batch[len(outcomes):]
        except asyncio.CancelledError:  # the loop is closing: nothing more is read
            for asked in batch:
                asked.done.cancel()
            raise
        finally:
            self._running -= 1
        self._start()


def run_each(works: Sequence[Work[Any]], tx: Any, *, aborted: Callable[[BaseException], bool]) -> list[Outcome[Any]]:
    """Each unit on `tx` in turn, each one's outcome; none after a unit whose error `aborted` the
    transaction (the batch runs the rest in another)."""
    outcomes: list[Outcome[Any]] = []
    for work in works:
        try:
            outcomes.append(Outcome(work(tx)))
        except Exception as exc:
            outcomes.append(Outcome(error=exc))
            if aborted(exc):
                break
    return outcomes


def _settle(future: asyncio.Future[Any], outcome: Outcome[Any]) -> None:
    if future.done():  # its caller was cancelled
        return
    if outcome.error is not None:
        future.set_exception(outcome.error)
    else:
        future.set_result(outcome.value)
