"""`ember serve` on the Redis Streams bus (EMBER_REDIS_URL): turns cross a real Redis, each
message is acknowledged once its turn is committed, and a Redis restart mid-run loses nothing:
a message Redis could not take is refused with a clear error, and the next one goes through."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.gatewayproc import EMBER, GatewayProcess, LaunchGateway
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply, serving
from tests.redisserver import RedisServer
from tests.sse import sse_events
from tests.test_gateway_api import final_text, history, send

KEY = "alice-secret-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        server.responder = lambda body: Reply(text=f"echo: {body['messages'][-1]['content']}")
        yield server


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gateway(model: ModelServer, redis_server: RedisServer, launch_gateway: LaunchGateway,
            namespace: str) -> GatewayProcess:
    return launch_gateway(model, keys={"alice": KEY}, EMBER_REDIS_URL=redis_server.url,
                          EMBER_REDIS_NAMESPACE=namespace)


def inbound_left(redis_server: RedisServer, namespace: str) -> tuple[int, int]:
    """Entries still in the inbound streams, and those delivered but not acknowledged."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        streams = [key for key in client.scan_iter(f"{namespace}:inbound:*") if client.type(key) == b"stream"]
        assert streams, "the gateway never used the Redis bus"
        length = sum(client.xlen(stream) for stream in streams)
        pending = sum(client.xpending(stream, "workers")["pending"] for stream in streams)
        return length, pending
    finally:
        client.close()


def test_turns_cross_redis_and_each_message_is_acknowledged_once_answered(
        gateway: GatewayProcess, redis_server: RedisServer, namespace: str) -> None:


    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=30) as alice:
        assert final_text(send(alice, "work", "first")) == "echo: first"
        assert final_text(send(alice, "work", "second")) == "echo: second"
        assert [m["content"] for m in history(alice, "work")] == ["first", "echo: first", "second", "echo: second"]
    # Acknowledged once the turn has ended (just after its answer went out), then deleted.
    wait_until(lambda: inbound_left(redis_server, namespace) == (0, 0), timeout_s=10, what="the acknowledgements")


def test_a_redis_restart_mid_run_loses_no_message(gateway: GatewayProcess, redis_server: RedisServer) -> None:


    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=60) as alice:
        assert final_text(send(alice, "restarts", "before")) == "echo: before"
        redis_server.stop()
        try:
            # Redis is down: the message is refused, said clearly, and nothing of it is kept.
            refused = sse_events(alice.post("/api/sessions/restarts/messages", json={"text": "while down"}).text)
            assert [(e.name, e.json()["code"]) for e in refused] == [("error", "bus_unavailable")]
            down = alice.post("/v1/chat/completions", headers={"X-Ember-Session": "restarts"},
                              json={"model": "ember", "messages": [{"role": "user", "content": "while down"}]})
            assert down.status_code == 503 and down.headers["Retry-After"] == "1"
            assert down.json()["error"]["code"] == "bus_unavailable"
            assert "password" not in down.text
        finally:
            redis_server.start()
        # Back up, empty: the gateway's consumers find their groups gone, make them again and carry on.
        assert final_text(send(alice, "restarts", "after")) == "echo: after"
        assert [m["content"] for m in history(alice, "restarts")] == ["before", "echo: before", "after",
                                                                      "echo: after"]
    assert "Traceback" not in gateway.output()


def test_doctor_reads_the_bus_without_writing_and_fails_clearly_when_redis_is_down(
        gateway: GatewayProcess, redis_server: RedisServer, namespace: str) -> None:
    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=30) as client:
        assert final_text(send(client, "s-doctor", "hello")) == "echo: hello"
    env = {**gateway.env, "EMBER_HOME": str(gateway.home)}
    done = subprocess.run([EMBER, "doctor"], env=env, capture_output=True, text=True, timeout=120)
    line = next((x for x in done.stdout.splitlines() if "Redis bus" in x), done.stdout + done.stderr)
    assert line.startswith("ok") and f"(namespace {namespace}): 4 inbound shard(s)" in line, line
    assert "0 message(s) waiting, 0 being answered, 1 worker(s) seen" in line, line

    fresh = subprocess.run([EMBER, "doctor"], env={**env, "EMBER_REDIS_NAMESPACE": namespace + "x"},
                           capture_output=True, text=True, timeout=120)
    assert "no Ember process has used it yet" in fresh.stdout, fresh.stdout
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert not client.exists(f"{namespace}x:inbound:shards"), "doctor wrote to the bus"
    finally:
        client.close()

    down = subprocess.run([EMBER, "doctor"], env={**env, "EMBER_REDIS_URL": "redis://:hunter2@127.0.0.1:1/0"},
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 1
    assert "FAIL  Redis bus redis://:***@127.0.0.1:1/0" in down.stdout, down.stdout
    assert "hunter2" not in down.stdout + down.stderr
