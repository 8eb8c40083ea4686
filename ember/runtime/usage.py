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
from ember.core.usage import UsageRow, UsageScope
from ember.runtime.tasks import cancel_task
from ember.store.protocols import UsageLedger

log = logging.getLogger(__name__)

UsageObserver = Callable[[UsageRow], None]


def utc_midnight(now: dt.datetime | None = None) -> float:
    moment = now or dt.datetime.now(dt.UTC)
    return moment.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


# Whose day a budget is: ("identity", name) or ("agent", name).
Holder = tuple[str, str]


class UsageRecorder:
    """`budgets_usd_per_day`: per identity; `agent_budgets_usd_per_day`: per named agent, whoever its
    turns are for."""

    def __init__(self, store: UsageLedger, *, budgets_usd_per_day: Mapping[str, float] | None = None,
                 agent_budgets_usd_per_day: Mapping[str, float] | None = None, flush_s: float = 1.0) -> None:
        self.store = store
        self._budgets: dict[Holder, float] = {
            **{("identity", name): usd for name, usd in (budgets_usd_per_day or {}).items()},
            **{("agent", name): usd for name, usd in (agent_budgets_usd_per_day or {}).items()}}
        self._flush_s = flush_s
        self._pending: list[UsageRow] = []
        self._observers: list[UsageObserver] = []
        self._task: asyncio.Task[None] | None = None
        self._reserved: dict[Holder, float] = {}  # for calls in flight
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

    async def refusal(self, identity: str, agent: str | None = None) -> str | None:
        """Why the identity, or the named agent, may not start a turn now (a day's budget is spent), or None."""
        for holder, budget in self._holders(identity, agent):
            spent = await self._spent(holder)
            if spent >= budget:
                return _spent_text(holder, budget, spent)
        return None

    def holds(self, scope: UsageScope) -> bool:
        return bool(self._holders(scope.identity, scope.agent))

    async def reserve(self, scope: UsageScope, usd: float) -> Callable[[], None]:
        holders = self._holders(scope.identity, scope.agent)
        if not holders:
            return _nothing
        async with self._ledger:
            for holder, budget in holders:
                spent = await self._spent(holder)
                if spent + usd > budget:
                    raise BudgetSpent(_spent_text(holder, budget, spent, needing=usd))
            for holder, _ in holders:
                self._reserved[holder] = self._reserved.get(holder, 0.0) + usd

        def release() -> None:
            for holder, _ in holders:
                self._reserved[holder] -= usd

        return release

    def _holders(self, identity: str | None, agent: str | None) -> list[tuple[Holder, float]]:
        """The budgets a call of `identity` (and of `agent`) counts against."""
        wanted = [("identity", identity), ("agent", agent)]
        return [((kind, name), self._budgets[kind, name]) for kind, name in wanted
                if name is not None and (kind, name) in self._budgets]

    async def _spent(self, holder: Holder) -> float:
        """Today's cost (UTC), counted or still reserved by calls in flight."""
        kind, name = holder
        since = utc_midnight()
        stored = await (self.store.spent(name, since) if kind == "identity" else self.store.spent_by_agent(name, since))
        pending = sum(row.cost_usd or 0.0 for row in self._pending if row.at >= since
                      and (row.scope.identity if kind == "identity" else row.scope.agent) == name)
        return stored + self._reserved.get(holder, 0.0) + pending


def _spent_text(holder: Holder, budget: float, spent: float, *, needing: float = 0.0) -> str:
    kind, name = holder
    whose = name if kind == "identity" else f"agent {name}"
    room = f" (the next call may cost up to ${needing:.4f})" if needing else ""
    return (f"The daily model budget for {whose} (${budget:.2f}) is used up: ${spent:.2f} spent since "
            f"00:00 UTC{room}. It renews at midnight UTC; `ember usage --by {kind}` shows where it went.")


def _nothing() -> None:
    """The release of a call no budget holds back."""
