"""`ember serve` as a supervisor sees it, and under many concurrent clients:
graceful stops, crashes and restarts, failed starts, no mixed-up turns."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gatewayproc import EMBER, GatewayProcess, LaunchGateway, free_port, gateway_env
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply
from tests.sse import events as read_events

SLOW = Reply(text="".join(f"word{i} " for i in range(30)).strip(), chunk_delay_s=0.05)


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event type, data) of a native SSE stream."""
    for event in read_events(lines):
        yield event.name or "", event.json()


def history(gateway: GatewayProcess, key: str) -> list[dict[str, Any]]:
    response = httpx.get(gateway.url(f"/api/sessions/{key}/messages"))
    assert response.status_code == 200, response.text
    return response.json()["messages"]


def test_sigterm_lets_the_turn_in_flight_finish(launch_gateway: LaunchGateway, model_server: ModelServer) -> None:
    gateway = launch_gateway(model_server)
    model_server.push(SLOW)
    seen: list[str] = []
    with httpx.stream("POST", gateway.url("/api/sessions/graceful/messages"), json={"text": "go"},
                      timeout=30) as response:
        for kind, data in sse_events(response.iter_lines()):
            seen.append(kind)
            if seen == ["delta"]:
                gateway.process.send_signal(signal.SIGTERM)
            if kind == "final":
                assert data["text"] == SLOW.text
    assert seen[-1] == "final" and seen.count("final") == 1
    assert gateway.process.wait(timeout=30) == 0
    assert "stopping; open requests and running turns get up to" in gateway.output()
    restarted = launch_gateway(model_server, port=gateway.port)
    assert [m["content"] for m in history(restarted, "graceful")] == ["go", SLOW.text]


def test_kill_9_then_restart_at_once_on_the_same_port(launch_gateway: LaunchGateway,
                                                      model_server: ModelServer) -> None:
    gateway = launch_gateway(model_server)
    model_server.push(SLOW)
    with httpx.stream("POST", gateway.url("/api/sessions/crash/messages"), json={"text": "before the crash"},
                      timeout=30) as response:
        for kind, _ in sse_events(response.iter_lines()):
            if kind == "delta":
                gateway.kill()
                break
    # The question survived; the half-streamed answer was never committed. At the restart the
    # cut-off turn is resumed (it is recent), once, and its answer committed in full.
    model_server.push(Reply(text="The resumed answer."))
    restarted = launch_gateway(model_server, port=gateway.port)
    wait_until(lambda: len(history(restarted, "crash")) == 2, what="the interrupted turn to be resumed")
    assert [(m["role"], m["content"]) for m in history(restarted, "crash")] == [
        ("user", "before the crash"), ("assistant", "The resumed answer."),
    ]
    model_server.push(Reply(text="back again"))
    with httpx.stream("POST", restarted.url("/api/sessions/crash/messages"), json={"text": "hello?"}) as response:
        finals = [data["text"] for kind, data in sse_events(response.iter_lines()) if kind == "final"]
    assert finals == ["back again"]
    assert len(history(restarted, "crash")) == 4


def test_a_busy_port_fails_the_start_with_one_line(launch_gateway: LaunchGateway, model_server: ModelServer,
                                                   tmp_path: Any) -> None:
    gateway = launch_gateway(model_server)
    env = gateway_env(tmp_path / "other-home", model_server, None)
    second = subprocess.run([EMBER, "serve", "--port", str(gateway.port)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert second.returncode != 0
    assert f"cannot listen on 127.0.0.1:{gateway.port}" in second.stderr
    assert "Traceback" not in second.stderr + second.stdout
    assert httpx.get(gateway.url("/healthz")).status_code == 200  # the first one is untouched


@pytest.mark.parametrize(("extra", "args", "expected"), [
    ({"EMBER_GATEWAY_PORT": "not-a-port"}, [], "gateway_port"),
    ({}, ["--host", "0.0.0.0"], "no API keys are configured"),
    ({"EMBER_API_KEYS": "alice=short"}, [], "shorter than 16 characters"),
])
def test_bad_configuration_fails_the_start_clearly(tmp_path: Any, extra: dict[str, str], args: list[str],
                                                   expected: str) -> None:
    env = gateway_env(tmp_path / "home", None, None, **extra)
    run = subprocess.run([EMBER, "serve", "--port", str(free_port()), *args], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert expected in run.stderr
    assert "Traceback" not in run.stderr


def echo(body: dict[str, Any]) -> Reply:
    return Reply(text=f"echo: {body['messages'][-1]['content']}")


async def _native_turn(client: httpx.AsyncClient, key: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    async with client.stream("POST", f"/api/sessions/{key}/messages", json={"text": text}) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines()]
    return list(sse_events(iter(lines)))


def test_fifty_concurrent_sessions_keep_complete_ordered_histories(launch_gateway: LaunchGateway,
                                                                   model_server: ModelServer) -> None:
    sessions, turns = 50, 3
    model_server.responder = echo
    gateway = launch_gateway(model_server, EMBER_GATEWAY_RATE_BURST="1000")

    async def conversation(client: httpx.AsyncClient, n: int) -> list[str]:
        finals = []
        for t in range(turns):
            events = await _native_turn(client, f"c{n}", f"session {n} turn {t}")
            kinds = [kind for kind, _ in events]
            assert kinds.count("final") == 1 and "error" not in kinds, kinds
            finals.append(events[-1][1]["text"])
        return finals

    async def main() -> list[list[str]]:
        limits = httpx.Limits(max_connections=sessions + 10)
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(conversation(client, n) for n in range(sessions)))

    results = asyncio.run(main())
    for n, finals in enumerate(results):
        assert finals == [f"echo: session {n} turn {t}" for t in range(turns)]
        expected = [c for t in range(turns) for c in (f"session {n} turn {t}", f"echo: session {n} turn {t}")]
        assert [m["content"] for m in history(gateway, f"c{n}")] == expected


def test_concurrent_requests_on_one_session_run_one_at_a_time(launch_gateway: LaunchGateway,
                                                              model_server: ModelServer) -> None:
    model_server.responder = lambda body: Reply(text=f"echo: {body['messages'][-1]['content']}",
                                                chunk_delay_s=0.01)
    gateway = launch_gateway(model_server)

    async def main() -> list[list[tuple[str, dict[str, Any]]]]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            return await asyncio.gather(*(_native_turn(client, "shared", f"message {i}") for i in range(8)))

    for i, events in enumerate(asyncio.run(main())):
        finals = [data["text"] for kind, data in events if kind == "final"]
        assert finals == [f"echo: message {i}"]  # each request got its own answer, once
        assert "".join(data["text"] for kind, data in events if kind == "delta") == f"echo: message {i}"
    stored = history(gateway, "shared")
    # Turns never interleave: every question is directly followed by its own answer.
    pairs = list(zip(stored[::2], stored[1::2]))
    assert len(pairs) == 8
    for question, answer in pairs:
        assert question["role"] == "user" and answer["content"] == f"echo: {question['content']}"
    wait_until(lambda: len(model_server.requests) == 8, what="eight model calls")


def test_a_store_locked_past_its_busy_timeout_is_a_503_to_retry(launch_gateway: LaunchGateway) -> None:
    """Another process holds the database's write lock longer than the busy timeout (10 s): a
    write is refused with 503 and Retry-After, never a 500; once the lock goes, the retry works."""
    gateway = launch_gateway(None)
    path = gateway.home / "ember.db"
    # Waits for a write the gateway may be making at that moment (its start-up jobs), then holds the lock.
    other = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        other.execute("BEGIN IMMEDIATE")
        refused = httpx.post(gateway.url("/api/memory"), json={"content": "I like green tea."}, timeout=60)
        other.execute("COMMIT")
    finally:
        other.close()
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "store_unavailable"
    assert "busy" in refused.json()["error"]["message"] and "sqlite" not in refused.text.lower()
    retried = httpx.post(gateway.url("/api/memory"), json={"content": "I like green tea."}, timeout=60)
    assert retried.status_code == 201
