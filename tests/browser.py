"""The web page's tests drive Debian's headless Chromium: the browser and page fixtures and the
steps every page test takes (sign in, send, read the answer, measure a box)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright

from tests.gatewayproc import GatewayProcess

CHROMIUM = os.environ.get("EMBER_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]

needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}")

# Assertions wait as long as actions do (the page's default timeout below): a loaded machine renders late.
expect.set_options(timeout=10_000)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh profile (empty storage) whose uncaught script errors fail the test."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(10_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], f"the page threw: {errors}"


def offer_key(page: Page, gateway: GatewayProcess, key: str) -> None:
    page.goto(gateway.url("/"))
    page.locator("#key-input").fill(key)
    page.locator("#sign-in").click()


def sign_in(page: Page, gateway: GatewayProcess, key: str) -> None:
    """Signs in and waits for the signed-in view: a loaded machine shows it a while after the click."""
    offer_key(page, gateway, key)
    expect(page.locator("#app-view")).to_be_visible()


def send(page: Page, text: str) -> None:
    page.locator("#message-input").fill(text)
    page.locator("#send").click()


def answer(page: Page) -> Locator:
    """The committed answer text of the last turn (drafts excluded)."""
    return page.locator(".message.assistant").last.locator(".text:not(.draft)")


def box(page: Page, selector: str) -> dict[str, float]:
    expect(page.locator(selector)).to_be_visible()  # a box is measured once the page has shown it
    found = page.locator(selector).bounding_box()
    assert found is not None, f"{selector} has no box"
    return found
