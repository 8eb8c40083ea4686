"""Models that fail over: a chain of real OpenAI-compatible clients against the tests' own
model servers, its circuit breakers on a fake clock, and the chain as configuration."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.app.models import configured_model
from ember.config.settings import load_settings
from ember.core.errors import ConfigError, ContextTooLong, ModelBadRequest, ModelUnavailable, StreamBroken
from ember.core.messages import Message
from ember.models.base import TextDelta, complete
from ember.models.openai_compat import OpenAICompatibleModel
from ember.models.router import CircuitBreaker, ModelRouter, Route
from tests.modelserver import MODEL, ModelServer, Reply, serving

HELLO = [Message.user("hello")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def backup() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


def client(base_url: str, attempts: int = 2) -> OpenAICompatibleModel:
    return OpenAICompatibleModel(model=MODEL, base_url=base_url, api_key="k", timeout_s=5, max_attempts=attempts)


def chain(*urls: str, clock: Clock | None = None, windows: tuple[int | None, ...] = ()) -> ModelRouter:
    routes = [Route(f"m{i}", client(url), windows[i] if windows else None,
                    CircuitBreaker(failures=2, window_s=60, cooldown_s=30, clock=clock or Clock()))
              for i, url in enumerate(urls)]
    return ModelRouter("main", routes)


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/v1"


async def test_an_overloaded_primary_is_answered_for_by_the_fallback_once(model_server: ModelServer,
                                                                         backup: ModelServer) -> None:
    model_server.push(Reply(status=503), Reply(status=503))
    backup.push(Reply(text="from the backup"))
    reply = await complete(chain(model_server.base_url, backup.base_url), HELLO)
    assert reply.text == "from the backup"
    assert (len(model_server.requests), len(backup.requests)) == (2, 1)  # its retries, then one fallback
    assert reply.model == "m1" and len(reply.passed_over) == 1 and "m0: " in reply.passed_over[0]
    assert "HTTP 503" in reply.passed_over[0]  # what the turn's trace shows


async def test_a_primary_refusing_connections_falls_over(backup: ModelServer) -> None:
    backup.push(Reply(text="still here"))
    assert (await complete(chain(closed_port_url(), backup.base_url), HELLO)).text == "still here"


async def test_a_bad_request_never_falls_over(model_server: ModelServer, backup: ModelServer) -> None:
    model_server.push(Reply(status=400))
    with pytest.raises(ModelBadRequest):
        await complete(chain(model_server.base_url, backup.base_url), HELLO)
    assert backup.requests == []


async def test_a_stream_broken_after_text_is_one_error_not_a_second_answer(model_server: ModelServer,
                                                                         backup: ModelServer) -> None:
    model_server.push(Reply(text="This answer is cut off half way through.", cut_after_chunks=3))
    seen = []
    with pytest.raises(StreamBroken):
        async for event in chain(model_server.base_url, backup.base_url).stream(HELLO):
            seen.append(event)
    assert any(isinstance(event, TextDelta) for event in seen) and backup.requests == []


async def test_a_context_too_long_goes_only_to_a_larger_window(model_server: ModelServer, backup: ModelServer) -> None:
    with serving() as large:
        too_long = Reply(status=400, error_code="context_length_exceeded", error_message="maximum context length")
        model_server.push(too_long)
        large.push(Reply(text="read it all"))
        router = chain(model_server.base_url, backup.base_url, large.base_url, windows=(8_000, 8_000, 200_000))
        assert (await complete(router, HELLO)).text == "read it all"
        assert backup.requests == []  # no larger than the one that refused
        model_server.push(too_long)
        with pytest.raises(ContextTooLong):
            await complete(chain(model_server.base_url, backup.base_url, windows=(8_000, 8_000)), HELLO)


async def test_the_breaker_opens_then_a_probe_closes_it_once_the_primary_recovers(
        model_server: ModelServer, backup: ModelServer) -> None:
    clock = Clock()
    router = chain(model_server.base_url, backup.base_url, clock=clock)
    primary = router.routes[0].breaker
    assert primary is not None
    for _ in range(2):  # two unavailable calls (each its two attempts) open it
        model_server.push(Reply(status=503), Reply(status=503))
        backup.push(Reply(text="backup"))
        await complete(router, HELLO)
    assert primary.state == "open" and len(model_server.requests) == 4
    backup.push(Reply(text="backup again"))
    assert (await complete(router, HELLO)).text == "backup again"
    assert len(model_server.requests) == 4  # skipped while open
    clock.now += 31
    assert primary.state == "half-open"
    model_server.push(Reply(text="primary is back"))
    assert (await complete(router, HELLO)).text == "primary is back"
    assert primary.state == "closed"


async def test_a_probe_cut_short_lets_the_next_call_probe(model_server: ModelServer, backup: ModelServer) -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures=1, cooldown_s=30, clock=clock)
    router = ModelRouter("main", [Route("m0", client(model_server.base_url), None, breaker),
                                  Route("m1", client(backup.base_url))])
    model_server.push(Reply(status=503), Reply(status=503))
    backup.push(Reply(text="backup"))
    await complete(router, HELLO)
    clock.now += 31
    model_server.push(Reply(text="a slow probe answer", chunk_delay_s=0.2))
    stream = router.stream(HELLO)
    assert isinstance(await anext(stream), TextDelta)
    await stream.aclose()  # the turn stops mid-probe
    model_server.push(Reply(text="probe again"))
    assert (await complete(router, HELLO)).text == "probe again" and breaker.state == "closed"


async def test_every_model_down_is_one_clear_error() -> None:
    with pytest.raises(ModelUnavailable, match=r"no model of the main role could answer: m0: .*; m1: "):
        await complete(chain(closed_port_url(), closed_port_url()), HELLO)


def write_config(text: str) -> None:
    home = Path(os.environ["EMBER_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "ember.toml").write_text(text)


async def test_the_chains_come_from_models_and_model_roles(model_server: ModelServer, backup: ModelServer) -> None:
    write_config(f'''
[models.primary]
base_url = "{model_server.base_url}"
model = "{MODEL}"
api_key_env = "PRIMARY_KEY"
[models.backup]
base_url = "{backup.base_url}"
model = "{MODEL}"
[model_roles]
main = ["primary", "backup"]
background = ["backup"]
''')
    settings = load_settings()
    main, background = configured_model(settings), configured_model(settings, "background")
    assert isinstance(main, ModelRouter) and [r.label for r in main.routes] == ["primary", "backup"]
    assert isinstance(background, ModelRouter) and [r.label for r in background.routes] == ["backup"]
    model_server.push(Reply(status=503), *[Reply(status=503)] * 3)
    backup.push(Reply(text="answered by backup"))
    assert (await complete(main, HELLO)).text == "answered by backup"
    assert len(model_server.requests) == 1  # a model with a fallback after it is not retried: the next one is
    await main.aclose()
    await background.aclose()


def test_a_role_naming_an_unknown_model_is_refused_at_start() -> None:
    write_config('[models.a]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\n[model_roles]\nmain = ["a", "b"]\n')
    with pytest.raises(ConfigError, match=r"model_roles\.main names 'b'"):
        load_settings()


async def test_a_timeout_opens_the_breaker_at_once_and_a_rate_limit_holds_it_as_asked(
        model_server: ModelServer, backup: ModelServer) -> None:
    clock = Clock()
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        slow = OpenAICompatibleModel(model=MODEL, base_url=f"http://127.0.0.1:{silent.getsockname()[1]}/v1",
                                     api_key="k", timeout_s=0.5, max_attempts=1)
        breaker = CircuitBreaker(failures=3, cooldown_s=30, clock=clock)
        router = ModelRouter("main", [Route("slow", slow, None, breaker), Route("backup", client(backup.base_url))])
        backup.push(Reply(text="one"), Reply(text="two"))
        assert (await complete(router, HELLO)).text == "one"
        assert breaker.state == "open"  # one timeout was enough: the next call does not wait for it again
        assert (await complete(router, HELLO)).text == "two"
        await router.aclose()

    model_server.push(Reply(status=429, retry_after="90"))
    limited = CircuitBreaker(failures=3, cooldown_s=30, clock=clock)
    router = ModelRouter("main", [Route("primary", client(model_server.base_url, attempts=1), None, limited),
                                  Route("backup", client(backup.base_url))])
    backup.push(Reply(text="three"))
    assert (await complete(router, HELLO)).text == "three"
    clock.now += 31
    assert limited.state == "open"  # past the cooldown, not yet past the 90 s it asked for
    clock.now += 60
    assert limited.state == "half-open"
    await router.aclose()
