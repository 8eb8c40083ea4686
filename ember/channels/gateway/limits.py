"""Rate limits on the gateway: a token bucket per caller, `per_minute` steady and `burst` at once.

In one process the buckets are in memory. Gateways sharing a Redis share the
buckets too, so a caller gets the same limit however many gateways there are:
each bucket is a Redis hash, updated by one script on Redis's clock. Redis
unreachable, requests go ahead (the limit protects the gateway, it is not
worth refusing everyone over), and the outage is logged once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ember.bus.redis_support import REDIS_DOWN

log = logging.getLogger(__name__)


class Limiter(Protocol):
    async def retry_after(self, identity: str) -> float:
        """0 when the request may go ahead (and is counted), else seconds to wait."""
        ...


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


@dataclass(slots=True)
class RateLimiter:
    """A token bucket per identity, in this process: `per_minute` steady, `burst` at once."""

    per_minute: float
    burst: int
    max_buckets: int = 10_000
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    async def retry_after(self, identity: str) -> float:
        """0 when the request may go ahead (and is counted), else seconds to wait."""
        now = time.monotonic()
        if len(self._buckets) >= self.max_buckets:
            self._forget_idle(now)
        bucket = self._buckets.setdefault(identity, _Bucket(float(self.burst), now))
        rate = self.per_minute / 60
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / rate

    def _forget_idle(self, now: float) -> None:
        """Drop buckets that have refilled: they hold nothing a new bucket would not."""
        full_after = self.burst / (self.per_minute / 60)
        self._buckets = {k: b for k, b in self._buckets.items() if now - b.stamp < full_after}


# KEYS: the bucket. ARGV: tokens per second, burst. Returns the seconds to wait, as text (a Lua
# number would be truncated to an integer).
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local held = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = math.min(burst, (tonumber(held[1]) or burst) + (now - (tonumber(held[2]) or now)) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'stamp', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


class RedisRateLimiter:
    """The buckets of every gateway on one Redis (`namespace`: its deployment's keys)."""

    def __init__(self, url: str, namespace: str, per_minute: float, burst: int) -> None:
        self._client = Redis.from_url(url, decode_responses=True, retry=Retry(NoBackoff(), 0),
                                      socket_connect_timeout=1.0, socket_timeout=1.0)
        self._take = self._client.register_script(_TAKE)
        self._prefix = f"{namespace}:rate:"
        self._args = (per_minute / 60, burst)
        self._failing = False

    async def retry_after(self, identity: str) -> float:
        try:
            wait = float(await self._take(keys=[self._prefix + identity], args=self._args))
        except REDIS_DOWN as exc:
            if not self._failing:
                log.warning("rate limits are not applied: their Redis is unreachable (%s)", type(exc).__name__)
                self._failing = True
            return 0.0
        if self._failing:
            log.info("rate limits are applied again: their Redis is reachable")
            self._failing = False
        return wait

    async def aclose(self) -> None:
        await self._client.aclose()
