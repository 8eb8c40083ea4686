"""A model that cannot be reached is said at start and in plain words: `ember serve` asks it once,
bounded, says so in one line and on the page, and serves anyway; a failed connection names the
URL, why, and what to check."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser import needs_chromium, sign_in
from tests.gatewayproc import LaunchGateway, free_port
from tests.modelserver import ModelServer
from tests.test_cli_e2e import chat, ember, ember_env, one_line

UNREACHABLE = "The model cannot be reached"
KEY = "alice-secret-0123456789"


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A base URL whose port accepts connections and never answers (a hung server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def test_serve_with_an_unreachable_model_says_it_in_one_line_and_serves(launch_gateway: LaunchGateway) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"

    gateway = launch_gateway(None, EMBER_MODEL_BASE_URL=dead, EMBER_MODEL="m")

    said = [line for line in gateway.output().splitlines() if UNREACHABLE in line]
    assert len(said) == 1, gateway.output()
    assert dead in said[0] and "nothing is listening there" in said[0] and "serves anyway" in said[0]
    assert httpx.get(gateway.url("/healthz")).status_code == 200
    me = httpx.get(gateway.url("/api/me")).json()
    assert dead in me["model_problem"] and "connection refused" in me["model_problem"]


def test_serve_waits_for_a_silent_model_only_a_couple_of_seconds(launch_gateway: LaunchGateway,
                                                               silent_endpoint: str) -> None:
    gateway = launch_gateway(None, EMBER_MODEL_BASE_URL=silent_endpoint, EMBER_MODEL="m")

    # The probe's own 2 s, not the model timeout's 60.
    said = [line for line in gateway.output().splitlines() if UNREACHABLE in line]
    assert len(said) == 1 and f"no answer from {silent_endpoint} within 2 s" in said[0]


def test_serve_with_a_model_that_answers_says_nothing_of_it_and_no_warning(
        launch_gateway: LaunchGateway, model_server: ModelServer) -> None:
    gateway = launch_gateway(model_server)

    assert UNREACHABLE not in gateway.output()
    assert "Warning" not in gateway.output(), gateway.output()  # no library's warning at start
    assert httpx.get(gateway.url("/api/me")).json()["model_problem"] is None


def test_a_connection_error_names_the_url_and_what_to_check(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    env = ember_env(tmp_path, None, EMBER_MODEL_BASE_URL=dead, EMBER_MODEL="m", EMBER_MODEL_MAX_ATTEMPTS="1")

    done = chat(env, "hello", "s")

    said = one_line(done.stderr)
    assert done.returncode == 1
    assert f"could not connect to {dead}: nothing is listening there (connection refused)" in said
    assert "check that the model server is running there" in said
    assert "ssl:default" not in said and "Connect call failed" not in said
    checked = one_line(ember(env, "models", "--check").stdout)
    assert f"down: listing its models: could not connect to {dead}" in checked


def test_a_host_name_that_does_not_resolve_is_said_so(tmp_path: Path) -> None:
    env = ember_env(tmp_path, None, EMBER_MODEL_BASE_URL="http://no-such-host.invalid/v1", EMBER_MODEL="m",
                    EMBER_MODEL_MAX_ATTEMPTS="1")

    done = chat(env, "hello", "s")

    assert "could not connect to http://no-such-host.invalid/v1: its host name does not resolve" in one_line(
        done.stderr)


@needs_chromium
def test_the_page_shows_a_banner_only_when_the_model_could_not_be_reached(
        page: Page, launch_gateway: LaunchGateway, model_server: ModelServer, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    down = launch_gateway(None, keys={"alice": KEY}, home=tmp_path / "down", EMBER_MODEL_BASE_URL=dead,
                          EMBER_MODEL="m")
    sign_in(page, down, KEY)
    banner = page.locator("#model-banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text(f"The model did not answer when Ember started: could not connect to {dead}")

    up = launch_gateway(model_server, keys={"alice": KEY}, home=tmp_path / "up")
    sign_in(page, up, KEY)
    expect(page.locator("#whoami")).to_be_visible()
    expect(page.locator("#model-banner")).to_be_hidden()
