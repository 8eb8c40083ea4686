"""The page's read-only Settings view and `GET /api/settings`: what this Ember runs with (models and
their roles, channels, tools, the tool policy), over real HTTP on `ember serve` with the scripted
model server and in a real browser, and never a secret: not the model's key, not a callers' key,
not the password a URL carries."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Page, expect

from ember.app.settings_view import endpoint
from tests.browser import box, needs_chromium, sign_in
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, serving

ALICE = "alice-secret-0123456789"
MODEL_KEY = "sk-" + "settings0view" * 3  # the model's API key: never shown
POLICY = ('[tool_policy]\nwrite = "deny"\ntools = { web_fetch = "allow" }\n'
          '[[tool_policy.rules]]\ntool = "shell"\nsubject = "pytest*"\ndecision = "allow"\n'
          '[agents.coder]\nsystem_prompt = "You are Coder."\ntools = ["read_file", "memory_*"]\nmemory = "own"\n'
          '[channel_agents]\ntelegram = "coder"\n')


@pytest.mark.parametrize(("url", "shown"), [
    ("https://user:p4ss@api.example.com:8443/v1?token=t0k#frag", "https://api.example.com:8443/v1"),
    ("http://[::1]:11434/v1", "http://[::1]:11434/v1"),
    ("https://api.openai.com/v1", "https://api.openai.com/v1"),
    (None, None),
])
def test_an_endpoint_keeps_where_it_is_and_drops_what_may_be_secret(url: str | None, shown: str | None) -> None:
    assert endpoint(url) == shown


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(model: ModelServer, launch_module_gateway: LaunchGateway, tmp_path_factory: pytest.TempPathFactory,
            ) -> GatewayProcess:
    home = tmp_path_factory.mktemp("settings-home")
    (home / "ember.toml").write_text(POLICY)
    return launch_module_gateway(model, keys={"alice": ALICE}, home=home, EMBER_MODEL_API_KEY=MODEL_KEY)


def test_the_settings_route_shows_models_channels_tools_and_policy_and_no_secret(
        gateway: GatewayProcess, model: ModelServer) -> None:
    assert httpx.get(gateway.url("/api/settings")).status_code == 401  # the caller's key first
    response = httpx.get(gateway.url("/api/settings"), headers={"Authorization": f"Bearer {ALICE}"})
    assert response.status_code == 200, response.text
    view = response.json()
    [main] = view["models"]
    assert main["model"] == model.model and main["roles"] == ["main", "background", "approval"]
    assert main["endpoint"] == model.base_url and main["priced"] is False
    assert "http" in view["channels"] and "read_file" in view["tools"]
    policy = view["tool_policy"]
    assert (policy["read"], policy["write"], policy["tools"]) == ("allow", "deny", {"web_fetch": "allow"})
    assert policy["rules"] == [{"tool": "shell", "subject": "pytest*", "decision": "allow"}]
    assert (view["store"], view["bus"]) == ("sqlite", "in-process")
    assert view["agents"] == [{"name": "coder", "models": [], "tools": ["read_file", "memory_*"], "skills": None,
                               "memory": "own", "own_prompt": True}]
    assert view["channel_agents"] == {"telegram": "coder"}
    assert MODEL_KEY not in response.text and ALICE not in response.text


@needs_chromium
@pytest.mark.parametrize("width", [390, 1280])
def test_the_settings_panel_reads_as_a_page_and_fits_a_phone(page: Page, gateway: GatewayProcess,
                                                           model: ModelServer, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 800})
    sign_in(page, gateway, ALICE)
    for button in ("#open-activity", "#open-usage", "#open-settings", "#sign-out"):
        found = box(page, button)  # the header keeps every button on the screen
        assert found["x"] >= 0 and found["x"] + found["width"] <= width, (button, found)
    page.locator("#open-settings").click()
    panel = page.locator("#settings-panel")
    expect(panel).to_contain_text(f"Model: {model.model}")
    expect(panel).to_contain_text("Writing")
    expect(panel.locator("dd", has_text="pytest*")).to_have_text("shell on pytest*: allow")
    expect(panel).to_contain_text("Agent: coder")
    expect(panel).to_contain_text("its own with each person")
    assert MODEL_KEY not in page.content()
    page.screenshot(path=str(gateway.home.parent / f"settings-{width}.png"))  # for a person to look at
    edge = panel.bounding_box()
    assert edge is not None and edge["x"] >= 0 and edge["x"] + edge["width"] <= width + 1
    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    expect(page.locator("#open-settings")).to_be_focused()
    page.locator("#sign-out").click()
    expect(page.locator("#open-settings")).to_be_hidden()
    expect(panel.locator("section")).to_have_count(0)
