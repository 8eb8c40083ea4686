"""A test's own HTTP server: an ASGI app served by uvicorn on 127.0.0.1, from a thread (or, for a
channel's routes that share the runtime's clients, on the test's own event loop: `served_here`)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Protocol, TypeVar

import uvicorn


def wait_until(condition: Callable[[], bool], *, timeout_s: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


class LoopbackServer:
    def __init__(self, app: Any, name: str) -> None:
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted sockets only then, and without it
        # each response waits ~40 ms for the client's delayed ACK (Nagle) before its body goes out.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self._name = name
        # log_config=None: leave the test process's logging alone.
        config = uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name=name, daemon=True)

    @property
    def origin(self) -> str:
        host, port = self._socket.getsockname()
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), timeout_s=10, what=self._name)
        if not self._server.started:
            raise RuntimeError(f"the test's {self._name} did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


class _Startable(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


S = TypeVar("S", bound=_Startable)


@contextmanager
def started(server: S) -> Iterator[S]:
    """`server`, started for the block and stopped after it."""
    server.start()
    try:
        yield server
    finally:
        server.stop()


@asynccontextmanager
async def served_here(app: Any) -> AsyncIterator[str]:
    """`app` served on this event loop, as `ember serve` serves a channel's routes beside its
    runtime; the origin to reach it at."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=2))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.01)
        host, port = sock.getsockname()
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        sock.close()
