"""A connection to a model's endpoint that failed, said in plain words: where, why, what to check."""

from __future__ import annotations

import errno
import socket
import ssl

# What a client's model listing (its reachability check) says it was doing when it failed.
LISTING = "listing its models"
_CHECK = "check that the model server is running there and that the base URL in the configuration is right"


def connection_failure(exc: BaseException) -> OSError | None:
    """The OS error (not a timeout) at the root of `exc`'s causes, if any."""
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, OSError) and not isinstance(cause, TimeoutError):
            return cause
        cause = cause.__cause__
    return None


def _why(cause: OSError | None) -> str:
    if cause is None:
        return "the connection failed"
    # aiohttp wraps the socket's error and keeps its errno; the wrapped one sits in os_error.
    inner = getattr(cause, "os_error", None) or cause
    if isinstance(inner, ssl.SSLError) or "ssl" in type(cause).__name__.lower():
        return "the TLS handshake failed (an http:// server behind an https:// URL, or a certificate this " \
               "machine does not trust)"
    if isinstance(inner, socket.gaierror) or "dns" in type(cause).__name__.lower():
        return "its host name does not resolve"
    if inner.errno == errno.ECONNREFUSED:
        return "nothing is listening there (connection refused)"
    if inner.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "the host cannot be reached from this machine"
    return inner.strerror or type(inner).__name__


def unreachable_text(base_url: str | None, exc: BaseException) -> str:
    """'could not connect to URL: why; check …' for a failed connection `exc` (an SDK's error,
    caused by the transport's)."""
    where = f" to {base_url}" if base_url else ""
    return f"could not connect{where}: {_why(connection_failure(exc))}; {_CHECK}"
