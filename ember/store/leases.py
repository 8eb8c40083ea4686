"""Leases on the database that several Ember processes and machines share (PostgreSQL).

A lease is a row: its holder, a token, and when it expires, by the database's
clock (the processes' clocks may disagree). Taking it is one upsert that
succeeds only on a free or expired row and adds one to its token; the holder
renews it every third of `ttl_s`. A holder that stops renewing (killed,
paused, cut off from the database) loses it when it expires, and another
process takes it, with the next token.

Fencing. A holder paused past its lease may wake up mid-turn and commit. While
a session lease is held, its `Fence` is the task's `current_fence`, and the
PostgreSQL store checks it inside every write transaction (`FENCE_CHECK`):
the lease row, read FOR SHARE, must still name this holder and token. A new
holder's upsert waits for that row lock, so a late commit either lands before
the takeover or is refused (`LeaseLost`) and nothing of it is kept.

Within a process, waiters for one lease queue in arrival order on a lock of
their own; only the first polls the database.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from ember.core.errors import LeaseLost, StoreError
from ember.core.leases import Fence, KeyedLocks, LeaseClock, current_fence, current_lease_clock
from ember.store.engine import Database
from ember.store.tx import Statement, Tx, Work

T = TypeVar("T")

log = logging.getLogger(__name__)

SESSION_PREFIX = "session:"
POLL_START_S = 0.005
POLL_MAX_S = 0.25

_NOW = {"sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
        "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"}


def _by_clock(sql: str) -> tuple[Statement, Statement]:
    """`sql` with `{now}` as each engine's clock, in seconds since the epoch; and with `{now}` as
    the `:now` parameter, for a table given a clock of its own."""
    return (Statement(sql.format(now=_NOW["sqlite"]), sql.format(now=_NOW["postgresql"])),
            Statement(sql.format(now="CAST(:now AS DOUBLE PRECISION)")))


_TAKE = _by_clock("""INSERT INTO leases (name, holder, token, expires_at)
    VALUES (:name, :holder, 1, {now} + CAST(:ttl AS DOUBLE PRECISION))
    ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, token = leases.token + 1,
        expires_at = excluded.expires_at
    WHERE leases.expires_at < {now}
    RETURNING token""")
_RENEW = _by_clock("""UPDATE leases SET expires_at = {now} + CAST(:ttl AS DOUBLE PRECISION)
    WHERE name = :name AND holder = :holder AND token = :token""")
_RELEASE = Statement("UPDATE leases SET expires_at = 0 WHERE name = :name AND holder = :holder AND token = :token")
FENCE_CHECK = Statement(
    "SELECT 1 FROM leases WHERE name = :name AND holder = :holder AND token = :token",
    "SELECT 1 FROM leases WHERE name = :name AND holder = :holder AND token = :token FOR SHARE")


class LeaseTable:
    """The statements on the lease rows; none of them is itself fenced."""

    def __init__(self, db: Database, holder: str, ttl_s: float, *, clock: Callable[[], float] | None = None) -> None:
        """`clock`: what lease times are read by, in the rows and between renewals (a test's, to move
        time on); None: the database's in the rows, since the processes' clocks may disagree, and
        this process's monotonic clock between renewals."""
        if ttl_s <= 0:
            raise ValueError("a lease's ttl_s must be positive")
        self.db = db
        self.holder = holder
        self.ttl_s = ttl_s
        self._clock = clock

    def now(self) -> float:
        """The time by which renewals are spaced."""
        return self._clock() if self._clock is not None else time.monotonic()

    def _timed(self, statements: tuple[Statement, Statement], params: dict[str, object]) -> Work[Any]:
        clock = self._clock
        if clock is None:
            return lambda tx: tx.execute(statements[0], params)
        return lambda tx: tx.execute(statements[1], {**params, "now": clock()})

    async def try_take(self, name: str) -> int | None:
        """The new token, or None while another holder's lease on `name` lasts."""
        take = self._timed(_TAKE, {"name": name, "holder": self.holder, "ttl": self.ttl_s})
        row = await self.db.run_write(lambda tx: take(tx).fetchone())
        return None if row is None else int(row[0])

    async def take(self, name: str) -> int:
        delay = POLL_START_S
        while (token := await self.try_take(name)) is None:
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        return token

    async def renew(self, name: str, token: int) -> bool:
        """False: the lease expired and another process took it."""
        renew = self._timed(_RENEW, {"name": name, "holder": self.holder, "token": token, "ttl": self.ttl_s})
        return await self.db.run_write(lambda tx: renew(tx).rowcount == 1)

    async def release(self, name: str, token: int) -> None:
        """Free the lease at once; if this fails, it frees itself when it expires."""
        params = {"name": name, "holder": self.holder, "token": token}
        try:
            await self.db.run_write(lambda tx: tx.execute(_RELEASE, params))
        except StoreError:
            log.warning("could not release the lease %s; it expires in %.0f s", name, self.ttl_s, exc_info=True)


class SqlSessionLeases:
    """`SessionLeases` for processes on several machines: a fencing lease row per session."""

    def __init__(self, table: LeaseTable) -> None:
        self._table = table
        self._in_process = KeyedLocks()

    @asynccontextmanager
    async def hold(self, session_key: str) -> AsyncIterator[None]:
        name = SESSION_PREFIX + session_key
        async with self._in_process.hold(session_key):
            # Taken and released outside any fence of the caller's: these rows are not the session's.
            outer = current_fence.set(None)
            try:
                token = await self._table.take(name)
            finally:
                current_fence.reset(outer)
            clock = LeaseClock(self._table.ttl_s)
            renewing = asyncio.create_task(self._keep(name, token, clock), name=f"ember-lease-{session_key}")
            fenced = current_fence.set(Fence(name, self._table.holder, token))
            clocked = current_lease_clock.set(clock)
            try:
                yield
            finally:
                current_lease_clock.reset(clocked)
                current_fence.reset(fenced)
                renewing.cancel()
                outer = current_fence.set(None)
                try:
                    await self._table.release(name, token)
                finally:
                    current_fence.reset(outer)

    async def _keep(self, name: str, token: int, clock: LeaseClock) -> None:
        """Renew the lease until it is released; stop if another process took it meanwhile
        (this one was paused or cut off): the fence then refuses this holder's writes."""
        while True:
            await asyncio.sleep(self._table.ttl_s / 3)
            asked_at = time.monotonic()
            try:
                if not await self._table.renew(name, token):
                    clock.lost()
                    log.warning("lost the lease %s: it expired before it was renewed, and another process "
                                "took it; this process's writes under it are refused", name)
                    return
                clock.renewed_at = asked_at
            except StoreError:
                log.warning("could not renew the lease %s; retrying", name, exc_info=True)


class LeaderLease:
    """One process among many does some work (firing scheduled tasks): the one holding lease
    `name`. `held()`, called before each round of that work, takes, keeps or loses it."""

    def __init__(self, table: LeaseTable, name: str) -> None:
        self._table = table
        self._name = name
        self._token: int | None = None
        self._renewed_at = 0.0

    async def held(self) -> bool:
        now = self._table.now()
        if self._token is not None:
            if now - self._renewed_at < self._table.ttl_s / 3:
                return True
            if await self._table.renew(self._name, self._token):
                self._renewed_at = now
                return True
            log.warning("this process is no longer the %s: another took over", self._name)
            self._token = None
        self._token = await self._table.try_take(self._name)
        if self._token is not None:
            self._renewed_at = now
            log.info("this process is now the %s", self._name)
        return self._token is not None

    async def release(self) -> None:
        if self._token is not None:
            await self._table.release(self._name, self._token)
            self._token = None


def fenced(work: Work[T], fence: Fence | None) -> Work[T]:
    """`work`, refused with LeaseLost unless `fence`'s lease is still its holder's (None: unfenced)."""
    if fence is None:
        return work

    def unit(tx: Tx) -> T:
        check_fence(tx, fence)
        return work(tx)

    return unit


def check_fence(tx: Tx, fence: Fence) -> None:
    if tx.execute(FENCE_CHECK, fence_params(fence)).fetchone() is None:
        raise LeaseLost(f"this process lost the lease {fence.name} (token {fence.token}) to another; "
                        "its write was not kept")


def fence_params(fence: Fence) -> dict[str, object]:
    return {"name": fence.name, "holder": fence.holder, "token": fence.token}
