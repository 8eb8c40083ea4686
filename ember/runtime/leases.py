"""Session leases for every Ember process that shares one EMBER_HOME on a host.

Inside a process, an asyncio.Lock per session key: it wakes waiters in arrival
order, which keeps a session's turns in order. Across processes (an
`ember chat` beside an `ember run`), an advisory `flock` on one file per key,
which the kernel releases when its holder dies, kill -9 included.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from ember.core.leases import KeyedLocks

POLL_START_S = 0.001
POLL_MAX_S = 0.05


def process_name() -> str:
    """This process among those sharing a store and a bus: what its leases, job claims and
    pending messages are held as. Unique even where every container's process is pid 1."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}".replace(":", "-")


class HostLock:
    """An exclusive, non-blocking advisory lock on one file."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        if self._fd is not None:
            return True
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # the first lock in this folder: create it, once
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        return True

    async def acquire(self) -> None:
        delay = POLL_START_S
        while not self.try_acquire():
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class LocalLeases:
    """Session leases on one host: a lock per session in the process, then a file lock for the others."""

    def __init__(self, lock_dir: Path) -> None:
        self._lock_dir = lock_dir
        self._in_process = KeyedLocks()

    @asynccontextmanager
    async def hold(self, session_key: str) -> AsyncIterator[None]:
        async with self._in_process.hold(session_key):
            host_lock = HostLock(self._lock_dir / hashlib.sha1(session_key.encode()).hexdigest())
            await host_lock.acquire()
            try:
                yield
            finally:
                host_lock.release()
