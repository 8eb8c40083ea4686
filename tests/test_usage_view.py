"""What a person's model calls took and cost, as they see it: `GET /api/usage` by day and by
session (the store's sums on SQLite and PostgreSQL, then over real HTTP on `ember serve` with
the scripted model server), and the page's Usage panel in a real browser. Each identity sees
its own usage only.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from ember.core.usage import UsageCell, UsageRow, UsageScope
from ember.store.engine import Database
from ember.store.usage import SqlUsageStore
from tests.browser import answer, needs_chromium, send, sign_in
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply, serving
from tests.pgserver import ENGINES, engine_database
from tests.test_gateway_api import assert_error

SECRETS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}
DAY = 86400
# 2026-12-04 23:30 UTC: the 4th in London, already the 5th in Berlin (UTC+1)
LATE = datetime(2026, 12, 4, 23, 30, tzinfo=UTC).timestamp()


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    database = await engine_database(request.param, request, tmp_path)
    yield database
    await database.close()


def row(at: float, session: str | None, identity: str, tokens: tuple[int, int], cost: float | None) -> UsageRow:
    return UsageRow(at=at, model="m", scope=UsageScope(session_key=session, identity=identity),
                    input_tokens=tokens[0], output_tokens=tokens[1], cost_usd=cost)


async def test_a_persons_calls_are_summed_by_day_in_their_time_zone_and_by_session(db: Database) -> None:
    usage = SqlUsageStore(db)
    await usage.record([
        row(LATE, "s1", "alice", (100, 10), 0.5),
        row(LATE + 3600, "s1", "alice", (200, 20), None),  # the 5th everywhere; unpriced
        row(LATE - 2 * DAY, "s2", "alice", (300, 30), 0.25),
        row(LATE, None, "alice", (5, 1), 0.125),  # background work of no session
        row(LATE, "s1", "bob", (999, 99), 9.0),  # another person's
        row(LATE - 40 * DAY, "s1", "alice", (1, 1), 1.0),  # before `since`
    ])
    since = LATE - 10 * DAY

    def day(text: str) -> int:
        return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() // DAY)

    london = sorted(await usage.by_day_and_session("alice", since, 0), key=lambda c: (c.day, c.session_key or ""))
    assert london == [
        UsageCell(day("2026-12-02"), "s2", 1, 300, 30, 0, 0, 0.25, 0),
        UsageCell(day("2026-12-04"), None, 1, 5, 1, 0, 0, 0.125, 0),
        UsageCell(day("2026-12-04"), "s1", 1, 100, 10, 0, 0, 0.5, 0),
        UsageCell(day("2026-12-05"), "s1", 1, 200, 20, 0, 0, 0.0, 1),
    ]
    berlin = await usage.by_day_and_session("alice", since, 3600)
    assert {(c.day, c.session_key): c.calls for c in berlin} == {
        (day("2026-12-03"), "s2"): 1, (day("2026-12-05"), None): 1, (day("2026-12-05"), "s1"): 2}
    assert await usage.by_day_and_session("carol", since, 0) == []


# -- over HTTP and on the page ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(model: ModelServer, launch_module_gateway: LaunchGateway) -> GatewayProcess:
    # The tests poll for the usage rows, written about a second after each call: no rate limit in the way.
    return launch_module_gateway(model, keys=SECRETS, EMBER_GATEWAY_RATE_PER_MINUTE="100000",
                                 EMBER_GATEWAY_RATE_BURST="10000")


def client(gateway: GatewayProcess, identity: str) -> httpx.Client:
    return httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {SECRETS[identity]}"},
                        timeout=30)


def session_usage(http: httpx.Client, key: str) -> dict | None:  # type: ignore[type-arg]
    response = http.get("/api/usage")
    assert response.status_code == 200, response.text
    return next((s for s in response.json()["by_session"] if s["session"] == key), None)


def test_the_usage_route_shows_the_callers_own_calls_by_day_and_session(
        gateway: GatewayProcess, model: ModelServer) -> None:
    key = f"u-{uuid.uuid4().hex[:8]}"
    with client(gateway, "alice") as alice, client(gateway, "bob") as bob:
        model.push(Reply(text="Noted, three words."))
        assert alice.post(f"/api/sessions/{key}/messages", json={"text": "count these words please"}).status_code == 200
        # Usage rows are written in batches, about a second after the call.
        wait_until(lambda: session_usage(alice, key) is not None, timeout_s=10, what="alice's usage row")
        mine = session_usage(alice, key)
        assert mine is not None and mine["calls"] >= 1 and mine["input_tokens"] > 0 and mine["output_tokens"] > 0
        assert mine["cost_usd"] == 0 and mine["unpriced_calls"] == mine["calls"]  # the scripted model has no price
        body = alice.get("/api/usage", params={"days": "7", "tz_offset": "-60"}).json()
        assert body["days"] == 7 and body["currency"] == "USD"
        today = datetime.fromtimestamp(time.time() + 3600, UTC).date().isoformat()
        assert body["by_day"][0]["day"] == today
        assert body["total"]["calls"] == sum(d["calls"] for d in body["by_day"]) \
            == sum(s["calls"] for s in body["by_session"])
        assert session_usage(bob, key) is None  # bob has no session of that name, and sees none of alice's calls
        assert bob.get("/api/usage").json()["total"]["calls"] == 0


@pytest.mark.parametrize(("query", "param"), [
    ({"days": "0"}, "days"), ({"days": "367"}, "days"), ({"days": "x"}, "days"),
    ({"tz_offset": "1000"}, "tz_offset"), ({"tz_offset": "-"}, "tz_offset"), ({"dayz": "3"}, "dayz")])
def test_a_bad_usage_parameter_is_a_400_naming_it(gateway: GatewayProcess, query: dict[str, str], param: str) -> None:
    with client(gateway, "alice") as alice:
        error = assert_error(alice.get("/api/usage", params=query), 400, "invalid_parameter")
        assert error["param"] == param


@needs_chromium
@pytest.mark.parametrize("width", [390, 1280])
def test_the_usage_panel_shows_todays_calls_and_the_session_by_its_title(
        page: Page, model: ModelServer, gateway: GatewayProcess, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 800})
    sign_in(page, gateway, SECRETS["alice"])
    model.push(Reply(text="Fine, thanks."))
    send(page, "How are you today?")
    expect(answer(page)).to_have_text("Fine, thanks.")
    session = page.url.split("#", 1)[1]
    with client(gateway, "alice") as alice:
        wait_until(lambda: session_usage(alice, session) is not None, timeout_s=10, what="the turn's usage row")

    page.locator("#open-usage").click()
    panel = page.locator("#usage-panel")
    expect(panel).to_be_visible()
    today = page.evaluate("new Date().toLocaleDateString('sv')")  # the browser's own day, as YYYY-MM-DD
    by_day = panel.locator("#usage-by-day tr")
    expect(by_day.nth(1).locator("td").first).to_have_text(today)
    expect(panel.locator("#usage-by-session")).to_contain_text("How are you today?")  # its title, not its key
    expect(panel.locator("#usage-by-session")).to_contain_text("no price")
    expect(panel.locator("#usage-total")).to_contain_text("model calls")
    edge = panel.bounding_box()
    assert edge is not None and edge["x"] >= 0 and edge["x"] + edge["width"] <= width + 1
    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    expect(page.locator("#open-usage")).to_be_focused()  # back where the person was
    page.locator("#sign-out").click()
    expect(page.locator("#open-usage")).to_be_hidden()
    expect(panel.locator("tr")).to_have_count(0)  # nothing of alice's stays on the page
