"""The session lease: one writer of a session's history at a time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol


class SessionLeases(Protocol):
    def hold(self, session_key: str) -> AbstractAsyncContextManager[None]:
        """Held while a turn runs, and while consolidation reloads or commits."""
        ...


class Leadership(Protocol):
    """One process of several leads (the one that fires scheduled tasks): asked before each
    round whether it still does, and given up when it stops."""

    async def held(self) -> bool: ...

    async def release(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Fence:
    """The lease a unit of work runs under: a store shared by several processes commits the
    work only while `holder` still holds lease `name` at `token` (store/leases.py)."""

    name: str
    holder: str
    token: int


# Set while a lease that fences is held: every write made meanwhile, in this task and the
# tasks it starts, is checked against it.
current_fence: ContextVar[Fence | None] = ContextVar("ember_fence", default=None)


class LeaseClock:
    """When the lease a turn runs under (one that expires: store/leases.py) was last known to be
    this process's, by this process's clock. Silent past its `ttl_s` (paused, starved), the
    holder may have lost it to a process that now runs the turn: what it would stream then is
    a draft of an answer that will not be kept."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.renewed_at = time.monotonic()

    @property
    def surely_held(self) -> bool:
        return time.monotonic() - self.renewed_at < self.ttl_s

    def lost(self) -> None:
        self.renewed_at = float("-inf")


# Set beside current_fence while such a lease is held.
current_lease_clock: ContextVar[LeaseClock | None] = ContextVar("ember_lease_clock", default=None)


class KeyedLocks:
    """An asyncio.Lock per key (with `places` > 1, a semaphore letting that many in), created on
    demand and dropped when nobody holds or awaits it, so a server with a million sessions keeps only
    the busy ones in memory. It wakes waiters in arrival order, which keeps a session's turns in order
    within a process."""

    def __init__(self, places: int = 1) -> None:
        self._places = places
        self._locks: dict[str, asyncio.Lock | asyncio.Semaphore] = {}
        self._users: dict[str, int] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock() if self._places == 1 else asyncio.Semaphore(self._places)
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if self._users[key] == 0:
                del self._users[key]
                del self._locks[key]
