"""Counting model usage off the turn's path, and the daily budgets it is checked against.

Rows are kept in memory and written in one transaction every `flush_s`, and
at stop: a turn never waits for its count, and a crash loses at most the last
second of counts (the turn itself is committed as ever).

A budgeted person's call reserves the most it may cost before it is made, and
its count replaces the reservation after: however many calls run at once, a
day is overspent by at most what one call cost beyond its reservation. The
reservations are this process's: several workers may each make one call past
the budget's end.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping

from ember.core.errors import BudgetSpent
from ember.core.usage import UsageRow
from ember.runtime.tasks import cancel_task
from ember.store.protocols import UsageLedger

log = logging.getLogger(__name__)

UsageObserver = Callable[[UsageRow], None]


def utc_midnight(now: dt.datetime | None = None) -> float:
    moment = now or dt.datetime.now(dt.UTC)
    return moment.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


class UsageRecorder:
    def __init__(self, store: UsageLedger, *, budgets_usd_per_day: Mapping[str, float] | None = None,
                 flush_s: float = 1.0) -> None:
        self.store = store
        self._budgets = dict(budgets_usd_per_day or {})
        self._flush_s = flush_s
        self._pending: list[UsageRow] = []
        self._observers: list[UsageObserver] = []
        self._task: asyncio.Task[None] | None = None
        self._reserved: dict[str, float] = {}  # by identity, for calls in flight
        # Held while rows move to the store, and while a reservation reads what was spent: no row is
        # then in neither place.
        self._ledger = asyncio.Lock()

    def observe(self, observer: UsageObserver) -> None:
        """`observer` sees every row as it is counted (the gateway's /metrics)."""
        self._observers.append(observer)

    def record(self, row: UsageRow) -> None:
        self._pending.append(row)
        for observer in self._observers:
            observer(row)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._flushing(), name="ember-usage")

    async def stop(self) -> None:
        await cancel_task(self._task)
        self._task = None
        await self.flush()

    async def flush(self) -> None:
        async with self._ledger:
            rows, self._pending = self._pending, []
            try:
                await self.store.record(rows)
            except BaseException:
                self._pending[:0] = rows  # written by the next flush
                raise

    async def _flushing(self) -> None:
        while True:
            await asyncio.sleep(self._flush_s)
            try:
                await self.flush()
            except Exception as exc:  # counts wait for the next flush; turns go on
                log.warning("model usage could not be written (kept for the next try): %s", exc)

    async def refusal(self, identity: str) -> str | None:
        """Why the identity may not start a turn now (its day's budget is spent), or None."""
        budget = self._budgets.get(identity)
        if budget is None:
            return None
        spent = await self._spent(identity)
        return None if spent < budget else _spent_text(identity, budget, spent)

    async def reserve(self, identity: str | None, usd: float) -> Callable[[], None]:
        budget = self._budgets.get(identity or "")
        if identity is None or budget is None:
            return _nothing
        async with self._ledger:
            spent = await self._spent(identity)
            if spent + usd > budget:
                raise BudgetSpent(_spent_text(identity, budget, spent, needing=usd))
            self._reserved[identity] = self._reserved.get(identity, 0.0) + usd

        def release() -> None:
            self._reserved[identity] -= usd

        return release

    async def _spent(self, identity: str) -> float:
        """Today's cost (UTC), counted or still reserved by calls in flight."""
        since = utc_midnight()
        return await self.store.spent(identity, since) + self._reserved.get(identity, 0.0) + sum(
            row.cost_usd or 0.0 for row in self._pending if row.scope.identity == identity and row.at >= since)


def _spent_text(identity: str, budget: float, spent: float, *, needing: float = 0.0) -> str:
    room = f" (the next call may cost up to ${needing:.4f})" if needing else ""
    return (f"The daily model budget for {identity} (${budget:.2f}) is used up: ${spent:.2f} spent since "
            f"00:00 UTC{room}. It renews at midnight UTC; `ember usage --by identity` shows where it went.")


def _nothing() -> None:
    """The release of a call no budget holds back."""
