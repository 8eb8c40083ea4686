"""The browser's only way out: an HTTP proxy on 127.0.0.1, one per person's browser context, that
lets a connection through only to an address web_fetch's rules allow.

Chromium sends it everything, loopback included (`--proxy-bypass-list=<-loopback>`): navigations,
each hop of a redirect (which the browser follows itself, out of a page script's or a route's
reach), images, scripts, WebSockets. Each is checked where it connects, to the very address that
was checked, so a name that resolves differently a moment later cannot lead elsewhere. Plain HTTP
requests are sent on with `Connection: close`, so that every request of the browser's is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from ember.tools.base import ToolFailure
from ember.tools.web import checked_target

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
CONNECT_TIMEOUT_S = 10.0
_HOP_HEADERS = re.compile(rb"^(?:proxy-[a-z-]*|connection|keep-alive):.*\r\n", re.IGNORECASE | re.MULTILINE)
REFUSED_HEADER = "x-ember-refused"  # on the proxy's own refusals, so that they are told from a site's 403
_REFUSED = (b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + REFUSED_HEADER.encode() + b": 1\r\nContent-Length: %d\r\n\r\n%s")


class CheckingProxy:
    def __init__(self, *, allow_private: bool, allowed_hosts: frozenset[str]) -> None:
        self._allow_private = allow_private
        self._allowed_hosts = allowed_hosts
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self.refused: list[str] = []  # why, for each connection refused since the list was last cleared

    async def start(self) -> str:
        """Listen; the proxy's URL, for Chromium."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=MAX_HEAD_BYTES)
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        self._server = None

    async def _serve(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            await self._relay(client_in, client_out)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            log.debug("browser proxy connection ended: %s", exc)
        finally:
            self._pipes.discard(task)
            client_out.close()

    async def _relay(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        head = await client_in.readuntil(b"\r\n\r\n")
        method, target, version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        tunnel = method.upper() == "CONNECT"
        url = f"https://{target}/" if tunnel else target
        try:
            checked = await checked_target(url, allow_private=self._allow_private, allowed_hosts=self._allowed_hosts)
        except ToolFailure as refused:
            self.refused.append(str(refused))
            said = str(refused).encode()
            client_out.write(_REFUSED % (len(said), said))
            await client_out.drain()
            return
        port = checked.url.port or (443 if checked.url.scheme == "https" else 80)
        upstream_in, upstream_out = await _connect(checked.addresses, port)
        try:
            if tunnel:
                client_out.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                path = checked.url.raw_path.decode("ascii") or "/"
                rest = _HOP_HEADERS.sub(b"", head.split(b"\r\n", 1)[1])
                upstream_out.write(f"{method} {path} {version}\r\n".encode("latin-1")
                                   + rest.removesuffix(b"\r\n") + b"Connection: close\r\n\r\n")
            await asyncio.gather(_pipe(client_in, upstream_out), _pipe(upstream_in, client_out))
        finally:
            upstream_out.close()


async def _connect(addresses: tuple[object, ...], port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the first of the checked `addresses` that answers."""
    failure: OSError | None = None
    for address in addresses:
        try:
            return await asyncio.wait_for(asyncio.open_connection(str(address), port), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            failure = OSError(str(exc))
    raise failure or OSError("no address to connect to")


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(65536):
            sink.write(chunk)
            await sink.drain()
    finally:
        with contextlib.suppress(OSError):
            if sink.can_write_eof():
                sink.write_eof()
