"""What the Redis bus (ember/bus/redis.py) and the gateways' shared rate limits stand on: the
bus's settings, the shard of a session, a URL fit for a log, how a consumer waits out and
reports an outage, and how a publisher retries through one."""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from ember.core.errors import BusUnavailable, ConfigError

log = logging.getLogger("ember.bus.redis")
T = TypeVar("T")

# What "Redis is not there" looks like (a restarting Redis's LOADING is a ConnectionError too).
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)

READER_TTL_MS = 10_000  # the longest a process's outbound stream outlives its reads


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisBusConfig:
    namespace: str = "ember"  # the prefix of every key: several deployments can share one Redis
    shards: int = 4
    claim_idle_ms: int = 30_000  # a pending entry idle this long is a dead consumer's: taken over
    block_ms: int = 1_000  # the longest a read blocks between upkeeps
    publish_timeout_s: float = 5.0  # how long publishing retries before BusUnavailable
    outbound_maxlen: int = 10_000
    reader_ttl_ms: int = READER_TTL_MS  # a process's outbound stream lives this long after it stops reading
    route_ttl_s: int = 86_400

    def __post_init__(self) -> None:
        numbers = (self.shards, self.claim_idle_ms, self.block_ms, self.publish_timeout_s, self.outbound_maxlen,
                   self.reader_ttl_ms, self.route_ttl_s)
        if min(numbers) <= 0:
            raise ConfigError("the Redis bus's shards, timeouts, TTLs and maxlen must be positive")
        if not self.namespace or ":" in self.namespace:
            raise ConfigError("the Redis bus's namespace must be a non-empty name without ':'")


def shard_of(session_key: str, shards: int) -> int:
    """The inbound shard of a session: the same in every process and Python run."""
    return zlib.crc32(session_key.encode("utf-8", "surrogatepass")) % shards


def redacted_url(url: str) -> str:
    """The URL as it may be logged: without its password or query (which can carry one)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(a malformed Redis URL)"
    host = f"[{host}]" if ":" in host else host
    user = f"{parts.username}:***@" if parts.password else (f"{parts.username}@" if parts.username else "")
    return f"{parts.scheme}://{user}{host}{port}{parts.path}"


class Backoff:
    """A consumer's wait between tries while Redis is away: logged once per outage."""

    def __init__(self, where: str, reader: str) -> None:
        self._where, self._reader, self._delay, self._failing = where, reader, 0.05, False

    async def wait(self, exc: BaseException) -> None:
        if not self._failing:
            log.warning("Redis bus at %s unreachable (%s reading, %s); retrying with backoff",
                        self._where, self._reader, type(exc).__name__)
            self._failing = True
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, 2.0)

    def recovered(self) -> None:
        if self._failing:
            log.info("Redis bus at %s reachable again (%s reading)", self._where, self._reader)
        self._failing, self._delay = False, 0.05


def end_if_cancelled() -> None:
    """A read can return normally although its task was cancelled while it sent the command:
    redis-py sends through asyncio.wait_for, which on Python 3.11 drops a cancellation that
    arrives as the send completes. A consumer's loop must end anyway (at its next read, within
    block_ms), or whatever waits for it, a shutdown above all, waits forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def lost_group(exc: ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")


def route_key(namespace: str, channel: str, message_id: str) -> str:
    """Where a message's answers go: the process that published it (and holds its client)."""
    return f"{namespace}:route:{channel}:{message_id}"


async def create_group(client: Redis, stream: str, group: str) -> None:
    """`group` on `stream` (made if missing), reading it from its start; there already is fine."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def retrying(where: str, timeout_s: float, what: str, op: Callable[[], Awaitable[T]]) -> T:
    """`op`, tried again while Redis is unreachable, for up to `timeout_s`; then BusUnavailable."""
    try:
        async for attempt in AsyncRetrying(stop=stop_after_delay(timeout_s), reraise=True,
                                           wait=wait_exponential(multiplier=0.05, max=1.0),
                                           retry=retry_if_exception_type(REDIS_DOWN)):
            with attempt:
                return await op()
    except REDIS_DOWN as exc:
        raise BusUnavailable(f"The message bus (Redis at {where}) is unreachable: could not {what} "
                             f"within {timeout_s:g} s ({type(exc).__name__}).") from exc
    raise AssertionError("tenacity ended without a result")
