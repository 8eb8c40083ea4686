"""The gateway's rate limits shared through Redis (channels/gateway/limits.py), on a real Redis
(tests/redisserver.py): gateways on one Redis give a caller one limit between them."""

from __future__ import annotations

import logging
import uuid

import pytest

from ember.channels.gateway.limits import RateLimiter, RedisRateLimiter
from tests.redisserver import RedisServer


async def test_two_gateways_on_one_redis_share_a_callers_bucket_and_not_other_callers(
        redis_server: RedisServer) -> None:
    namespace = f"t{uuid.uuid4().hex[:8]}"
    first, second = (RedisRateLimiter(redis_server.url, namespace, per_minute=6, burst=3) for _ in range(2))
    try:
        waits = [await limiter.retry_after("alice") for limiter in (first, second, first)]
        assert waits == [0.0, 0.0, 0.0], "the burst, spent across both gateways"
        refused = await second.retry_after("alice")
        assert 0 < refused <= 10, "one token comes back every 10 s"
        assert await first.retry_after("bob") == 0.0, "another caller has a bucket of its own"
        elsewhere = RedisRateLimiter(redis_server.url, namespace + "x", per_minute=6, burst=3)
        assert await elsewhere.retry_after("alice") == 0.0, "another deployment's buckets are its own"
        await elsewhere.aclose()
    finally:
        await first.aclose()
        await second.aclose()


async def test_the_in_process_limiter_counts_the_same_way() -> None:
    limiter = RateLimiter(per_minute=6, burst=2)
    assert [await limiter.retry_after("alice") for _ in range(2)] == [0.0, 0.0]
    assert 0 < await limiter.retry_after("alice") <= 10


async def test_with_redis_unreachable_requests_go_ahead_and_the_outage_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    limiter = RedisRateLimiter("redis://:hunter2@127.0.0.1:1/0", "ember", per_minute=6, burst=1)
    caplog.set_level(logging.WARNING, "ember.channels.gateway.limits")
    try:
        assert [await limiter.retry_after("alice") for _ in range(3)] == [0.0, 0.0, 0.0]
    finally:
        await limiter.aclose()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert "hunter2" not in caplog.text
