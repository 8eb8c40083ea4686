"""In-process session leases: a fair (FIFO) lock per session key."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator


class InProcessLeases:
    """Locks are created on demand and dropped when nobody holds or awaits them,
    so a server with a million sessions keeps only the busy ones in memory.

    asyncio.Lock wakes waiters in the order they arrived, which is what keeps a
    session's turns in arrival order.
    """

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}

    @asynccontextmanager
    async def hold(self, session_key: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(session_key, asyncio.Lock())
        self._users[session_key] = self._users.get(session_key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[session_key] -= 1
            if self._users[session_key] == 0:
                del self._users[session_key]
                del self._locks[session_key]

    def active(self) -> int:
        return len(self._locks)
