"""The browser tool, driving Debian's Chromium against pages the test serves on 127.0.0.1: open,
snapshot, click, type, screenshot, back, close; each hop of a redirect checked by web_fetch's
address rules; a person's cookies and downloads their own; a form's submission judged by the
tool policy."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ember.core.errors import ConfigError
from ember.core.journal import TurnJournal
from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import Decision, ToolRun, ToolSpec
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.tools.approval import ApprovalGate, ToolPolicy
from ember.tools.base import ToolFailure, ToolRegistry
from ember.tools.browser import BrowserPool, BrowserTool, browser_tool
from ember.tools.browser_config import BrowserSpec
from ember.tools.workspace import Workspaces
from tests.browser import CHROMIUM, needs_chromium
from tests.conftest import FixedApprover
from tests.loopback import LoopbackServer, started

pytestmark = needs_chromium

HOME = """<html><head><title>Shop</title></head><body>
<h1>Welcome to the shop</h1>
<a href="/next">Next page</a> <a href="/file.txt">The price list</a>
<form action="/search" method="get"><label for="q">Search</label><input id="q" name="q">
<button type="submit">Find</button></form>
</body></html>"""


def site() -> Starlette:
    async def home(request: Request) -> Response:
        return HTMLResponse(HOME)

    async def search(request: Request) -> Response:
        return HTMLResponse(f"<title>Results</title><p>Results for {request.query_params['q']}</p>")

    async def scripted(request: Request) -> Response:
        return HTMLResponse("<title>App</title><body><script>document.body.innerText = 'made by a script'"
                            "</script></body>")

    async def cookie(request: Request) -> Response:
        response = HTMLResponse(f"<p>cookie: {request.cookies.get('who', 'none')}</p>")
        if "set" in request.query_params:
            response.set_cookie("who", request.query_params["set"])
        return response

    return Starlette(routes=[
        Route("/", home), Route("/next", lambda r: HTMLResponse("<title>Next</title><p>The second page</p>")),
        Route("/search", search), Route("/app", scripted), Route("/cookie", cookie),
        Route("/file.txt", lambda r: PlainTextResponse("tea 3.50", headers={
            "Content-Disposition": 'attachment; filename="prices.txt"'})),
        Route("/hop", lambda r: RedirectResponse("/next")),
        Route("/leak", lambda r: RedirectResponse("http://169.254.169.254/latest/meta-data/")),
        Route("/local", lambda r: RedirectResponse(f"http://localhost:{r.url.port}/next")),
    ])


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    with started(LoopbackServer(site(), "browser's site")) as server:
        yield server.origin


@pytest.fixture
async def browsing(tmp_path: Path) -> AsyncIterator[tuple[BrowserTool, BrowserPool, Workspaces]]:
    folders = Workspaces(tmp_path / "local", tmp_path / "workspaces")
    spec = BrowserSpec(enabled=True, executable=Path(CHROMIUM), timeout_s=10)
    tool, pool = browser_tool(spec, folders, allowed_hosts=frozenset({"127.0.0.1"}))
    yield tool, pool, folders
    await pool.close()


def run_of(identity: str, approver: FixedApprover | None = None) -> ToolRun:
    return ToolRun(f"http:{identity}:s", uuid.uuid4().hex, approver or FixedApprover(), TurnJournal(), identity)


async def test_open_snapshot_click_type_and_back(browsing, web: str) -> None:  # type: ignore[no-untyped-def]
    tool, _pool, _folders = browsing
    alice = run_of("alice")
    opened = await tool.run({"action": "open", "url": web}, alice)
    assert "Page: Shop" in opened and "Welcome to the shop" in opened
    assert '[1] link "Next page"' in opened and '[3] input text "Search" (in a form)' in opened
    assert '[4] button "Find" (submits a form)' in opened

    clicked = await tool.run({"action": "click", "element": 1}, alice)
    assert f"now at {web}/next" in clicked and "The second page" in clicked
    back = await tool.run({"action": "back"}, alice)
    assert "Welcome to the shop" in back

    typed = await tool.run({"action": "type", "element": 3, "text": "green tea", "submit": True}, alice)
    assert "Results for green tea" in typed
    scripted = await tool.run({"action": "open", "url": f"{web}/app"}, alice)
    assert "made by a script" in scripted  # what web_fetch could not read


async def test_a_submit_button_needs_submit_true_and_the_policy_judges_it(browsing, web: str) -> None:  # type: ignore[no-untyped-def]
    tool, _pool, _folders = browsing
    alice = run_of("alice", FixedApprover(Decision.DENY))
    await tool.run({"action": "open", "url": web}, alice)
    with pytest.raises(Exception, match='submits a form: click it with "submit": true'):
        await tool.run({"action": "click", "element": 4}, alice)

    gate = ApprovalGate(ToolRegistry([tool]), ToolPolicy(network="allow"))
    submit = ToolCall(id="c1", name="browser", arguments=json.dumps({"action": "click", "element": 4,
                                                                      "submit": True}))
    denied = await gate.call(submit, alice)
    assert denied.startswith("Error:") and alice.approver.asked[0].tool == "browser"  # type: ignore[attr-defined]
    assert alice.approver.asked[0].risk == "write"  # type: ignore[attr-defined]
    browse = ToolCall(id="c2", name="browser", arguments=json.dumps({"action": "click", "element": 1}))
    assert "The second page" in await gate.call(browse, alice)  # reading on needs nobody's approval


@pytest.mark.parametrize(("path", "refused"), [("/leak", "169.254.169.254"), ("/local", "localhost")])
async def test_each_redirect_hop_passes_the_address_rules(browsing, web: str, path: str, refused: str) -> None:  # type: ignore[no-untyped-def]
    tool, _pool, _folders = browsing
    alice = run_of("alice")
    assert "The second page" in await tool.run({"action": "open", "url": f"{web}/hop"}, alice)
    with pytest.raises(ToolFailure, match=f"{refused}.*refused|refused.*{refused}"):
        await tool.run({"action": "open", "url": f"{web}{path}"}, alice)
    for private in ("http://10.0.0.1/", "https://10.0.0.1/"):  # a request, and a tunnel
        with pytest.raises(ToolFailure, match=r"10\.0\.0\.1 is a private address; only public addresses"):
            await tool.run({"action": "open", "url": private}, alice)


def test_a_browser_that_cannot_run_says_what_to_install(tmp_path: Path) -> None:
    spec = BrowserSpec(enabled=True, executable=tmp_path / "no-chromium")
    with pytest.raises(ConfigError, match=r"no Chromium at .*apt-get install chromium"):
        browser_tool(spec, Workspaces(tmp_path))


async def test_each_person_has_their_own_cookies_downloads_and_screenshots(browsing, web: str) -> None:  # type: ignore[no-untyped-def]
    tool, _pool, folders = browsing
    alice, bob = run_of("alice"), run_of("bob")
    assert "cookie: none" in await tool.run({"action": "open", "url": f"{web}/cookie?set=alice"}, alice)
    assert "cookie: alice" in await tool.run({"action": "open", "url": f"{web}/cookie"}, alice)
    assert "cookie: none" in await tool.run({"action": "open", "url": f"{web}/cookie"}, bob)

    await tool.run({"action": "open", "url": web}, alice)
    await tool.run({"action": "click", "element": 2}, alice)  # the price list downloads
    shot = await tool.run({"action": "screenshot"}, alice)
    alice_folder = folders.for_identity("alice").root / "browser"
    assert "browser/screenshot-" in shot
    [png] = alice_folder.glob("screenshot-*.png")
    assert png.read_bytes().startswith(b"\x89PNG")
    await _downloaded(alice_folder / "prices.txt")
    assert (alice_folder / "prices.txt").read_text() == "tea 3.50"
    assert not (folders.for_identity("bob").root / "browser").exists()

    assert await tool.run({"action": "close"}, alice) == "The browser is closed."
    with pytest.raises(Exception, match="no page is open"):
        await tool.run({"action": "snapshot"}, alice)
    assert "cookie: none" in await tool.run({"action": "open", "url": f"{web}/cookie"}, alice)  # gone with it


async def _downloaded(path: Path) -> None:
    """A download is saved as it completes, after the click that started it has returned."""
    for _ in range(200):
        if path.exists():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} was never saved")


async def test_the_runtime_offers_the_browser_when_enabled_and_closes_it_at_stop(start, settings, web: str) -> None:  # type: ignore[no-untyped-def]
    def answer(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        assert "browser" in [spec.name for spec in tools]
        if messages[-1].role is Role.USER:
            return ModelReply(tool_calls=(ToolCall(id="b1", name="browser",
                                                   arguments=json.dumps({"action": "open", "url": web})),))
        lines = messages[-1].content.splitlines()
        heading = next(i for i, line in enumerate(lines) if line.startswith("Page: Shop"))
        return ModelReply(text=f"The page says: {lines[heading + 1]}")

    config = settings.model_copy(update={
        "browser": BrowserSpec(enabled=True, executable=Path(CHROMIUM)), "web_fetch_allowed_hosts": ["127.0.0.1"],
        "tool_policy": ToolPolicy(network="allow")})
    async with start(FunctionModel(answer), config=config) as h:
        final = await h.turn("what does the shop say?")
        pool = h.runtime.browser
    assert final.text == "The page says: Welcome to the shop"
    assert pool is not None and pool.closed
    unused = settings.model_copy(update={"home": settings.home / "off"})
    async with start(FunctionModel(answer), config=unused) as h:
        assert "browser" not in [spec.name for spec in h.runtime.tools.specs()] and h.runtime.browser is None


async def test_a_context_left_unused_is_closed_with_its_cookies(tmp_path: Path, web: str) -> None:
    folders = Workspaces(tmp_path / "local", tmp_path / "workspaces")
    tool, pool = browser_tool(BrowserSpec(enabled=True, executable=Path(CHROMIUM), idle_s=0.3), folders,
                              allowed_hosts=frozenset({"127.0.0.1"}))
    alice = run_of("alice")
    try:
        assert "cookie: none" in await tool.run({"action": "open", "url": f"{web}/cookie?set=alice"}, alice)
        assert pool.people == 1
        for _ in range(200):  # its idle timer closes it a moment after 0.3 s (a look would keep it open)
            if pool.people == 0:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(ToolFailure, match="no page is open"):
            await tool.run({"action": "snapshot"}, alice)
        assert "cookie: none" in await tool.run({"action": "open", "url": f"{web}/cookie"}, alice)
    finally:
        await pool.close()
    assert pool.closed
