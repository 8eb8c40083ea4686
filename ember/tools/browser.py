"""`browser`: a real Chromium, driven through Playwright, for pages web_fetch cannot read (scripts,
forms, logins). Actions: open, snapshot (the page as text, its elements numbered), click, type,
screenshot, back, close. Off unless `[browser] enabled`.

- Each person gets a browser context of their own (cookies, storage and history apart), closed
  after `idle_s` unused, and all of them when Ember stops.
- Every connection a page makes (navigations, each hop of a redirect, images, scripts, WebSockets)
  goes through a proxy of its own that lets it through only to an address web_fetch's rules
  allow (browser_proxy.py). A refused one is reported in the action's result.
- Downloads and screenshots land in the person's workspace, under `browser/`.
- Submitting a form is a call of its own (`"submit": true`), which the tool policy judges as a
  write (by default: the person is asked). Clicking a submit button without it is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from ember.core.errors import ConfigError
from ember.core.tools import Risk, ToolAction, ToolRun, ToolSpec
from ember.tools.base import ToolFailure, parsed_arguments
from ember.tools.browser_config import BrowserSpec
from ember.tools.browser_proxy import REFUSED_HEADER, CheckingProxy
from ember.tools.workspace import Workspace, Workspaces

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, Download, Page, Playwright

log = logging.getLogger(__name__)

TOOL = "browser"
FOLDER = "browser"  # in the person's workspace: downloads and screenshots
_SNAPSHOT = (Path(__file__).parent / "browser_snapshot.js").read_text(encoding="utf-8")
_ARGS = ["--headless", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--disable-sync",
         "--disable-background-networking", "--disable-component-update"]


class BrowserArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: Literal["open", "snapshot", "click", "type", "screenshot", "back", "close"]
    url: str | None = Field(default=None, max_length=8_192, description="open: the http(s) URL")
    element: int | None = Field(default=None, ge=1, description="click, type: its number in the last snapshot")
    text: str | None = Field(default=None, max_length=20_000, description="type: what to type into the element")
    submit: bool = Field(default=False, description="click, type: this submits a form (the person may be asked)")


@dataclass
class _Tab:
    """One person's browser context and its page."""

    context: BrowserContext
    page: Page
    workspace: Workspace
    proxy: CheckingProxy  # its only way out
    closer: asyncio.TimerHandle | None = None

    @property
    def refused(self) -> list[str]:
        """Why each connection refused since the current action began was."""
        return self.proxy.refused


class BrowserPool:
    """The Chromium process, started on first use, and a context per person."""

    def __init__(self, spec: BrowserSpec, folders: Workspaces, *, allow_private: bool = False,
                 allowed_hosts: frozenset[str] = frozenset()) -> None:
        self._spec = spec
        self._folders = folders
        self._allow_private = allow_private
        self._allowed_hosts = allowed_hosts
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._tabs: dict[str, _Tab] = {}
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[bool]] = set()  # idle contexts being closed (kept: tasks are weakly held)

    def check(self) -> None:
        """ConfigError, saying what to install, unless both Playwright and the Chromium are there."""
        try:
            import playwright.async_api  # noqa: F401
        except ImportError:
            raise ConfigError("[browser] enabled needs Playwright: pip install 'ember[browser]'") from None
        if not os.access(self._spec.executable, os.X_OK):
            raise ConfigError(f"[browser] enabled, but there is no Chromium at {self._spec.executable}: "
                              "apt-get install chromium, or set [browser] executable") from None

    async def tab(self, run: ToolRun, *, opening: bool) -> _Tab:
        """The person's tab; a new one only when `opening` (else ToolFailure: nothing is open)."""
        async with self._lock:
            tab = self._tabs.get(run.identity)
            if tab is None:
                if not opening:
                    raise ToolFailure('no page is open: use {"action": "open", "url": ...} first')
                tab = self._tabs[run.identity] = await self._new_tab(await self._folders.for_run(run))
            if tab.closer is not None:
                tab.closer.cancel()
            loop = asyncio.get_running_loop()
            tab.closer = loop.call_later(self._spec.idle_s, self._close_idle, run.identity)
            tab.refused.clear()
            return tab

    def _close_idle(self, identity: str) -> None:
        task = asyncio.get_running_loop().create_task(self.close_tab(identity), name="ember-browser-idle")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close_tab(self, identity: str) -> bool:
        tab = self._tabs.pop(identity, None)
        if tab is None:
            return False
        if tab.closer is not None:
            tab.closer.cancel()
        await tab.context.close()
        await tab.proxy.close()
        return True

    @property
    def people(self) -> int:
        """How many people have a browser context open now."""
        return len(self._tabs)

    @property
    def closed(self) -> bool:
        """No Chromium runs for this pool (none started yet, or stopped)."""
        return self._browser is None

    async def close(self) -> None:
        for identity in list(self._tabs):
            await self.close_tab(identity)
        if self._browser is not None:
            await self._browser.close()
        if self._playwright is not None:
            await self._playwright.stop()
        self._browser = self._playwright = None

    async def _new_tab(self, workspace: Workspace) -> _Tab:
        if self._browser is None:
            from playwright.async_api import async_playwright

            self._playwright = await async_playwright().start()
            self._browser = await self._playwright.chromium.launch(executable_path=self._spec.executable,
                                                                   args=_ARGS)
        proxy = CheckingProxy(allow_private=self._allow_private, allowed_hosts=self._allowed_hosts)
        # "<-loopback>": Chromium would otherwise reach loopback addresses without asking the proxy.
        context = await self._browser.new_context(accept_downloads=True, service_workers="block",
                                                  proxy={"server": await proxy.start(), "bypass": "<-loopback>"})
        context.set_default_timeout(self._spec.timeout_s * 1000)
        tab = _Tab(context, await context.new_page(), workspace, proxy)
        tab.page.on("download", lambda download: asyncio.ensure_future(_save_download(download, tab)))
        return tab


async def _save_download(download: Download, tab: _Tab) -> None:
    name = os.path.basename(download.suggested_filename) or "download"
    try:
        data = Path(await download.path()).read_bytes()
        _write(tab.workspace, f"{FOLDER}/{name}", data)
    except Exception as exc:  # a download's failure is the page's, not the turn's
        log.warning("a browser download (%s) could not be saved: %s", name, exc)


def _write(workspace: Workspace, relative: str, data: bytes) -> str:
    path = workspace.resolve(relative)
    file, _info = workspace.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_parents=True)
    with file:
        file.write(data)
    return workspace.display(path)


class BrowserTool:
    """The `browser` tool over a pool: each action's risk is its own (a form's submission is a write)."""

    def __init__(self, pool: BrowserPool, spec: BrowserSpec) -> None:
        self._pool = pool
        self._spec = spec
        self._tool_spec = ToolSpec(
            name=TOOL, parameters=BrowserArgs.model_json_schema(),
            description="A real web browser, for pages that need scripts, forms or a login. open a URL, then "
                        "read it with snapshot (its text, with numbered elements), click or type into an "
                        "element by its number, screenshot it (saved in your workspace), go back, close. "
                        "Submitting a form needs submit: true. Only public addresses can be reached.")

    @property
    def spec(self) -> ToolSpec:
        return self._tool_spec

    def describe(self, arguments: dict[str, Any]) -> ToolAction:
        args = _parse(arguments)
        if args.action == "open":
            if not args.url:
                raise ToolFailure('open needs a "url"')
            return ToolAction(TOOL, Risk.NETWORK, args.url, f"open {args.url} in the browser")
        if args.action in ("click", "type") and args.element is None:
            raise ToolFailure(f'{args.action} needs an "element" number from the last snapshot')
        if args.submit:
            return ToolAction(TOOL, Risk.WRITE, f"element {args.element}",
                              f"submit a form in the browser ({args.action} element {args.element})")
        return ToolAction(TOOL, Risk.READ, args.action, f"{args.action} in the browser")

    async def run(self, arguments: dict[str, Any], run: ToolRun) -> str:
        args = _parse(arguments)
        if args.action == "close":
            closed = await self._pool.close_tab(run.identity)
            return "The browser is closed." if closed else "No page was open."
        tab = await self._pool.tab(run, opening=args.action == "open")
        try:
            said = await _ACTIONS[args.action](tab, args)
        except ToolFailure:
            raise
        except Exception as exc:  # Playwright's errors (a timeout, a detached element) are the model's to read
            if args.url and (refused := _refusal_of(tab, args.url)):  # an https page refused: a failed tunnel
                raise ToolFailure(refused) from exc
            raise ToolFailure(f"{args.action} failed: {str(exc).splitlines()[0][:300]}") from exc
        refused = "".join(f"\nRefused: {reason}" for reason in tab.refused)
        if args.action == "screenshot":
            return said + refused
        return f"{said}{refused}\n\n{await _snapshot(tab, self._spec.snapshot_chars)}"


def _parse(arguments: dict[str, Any]) -> BrowserArgs:
    return parsed_arguments(BrowserArgs, arguments, TOOL)


async def _open(tab: _Tab, args: BrowserArgs) -> str:
    assert args.url is not None
    response = await tab.page.goto(args.url, wait_until="domcontentloaded")
    if response is not None and response.headers.get(REFUSED_HEADER):
        raise ToolFailure(_refusal_of(tab, tab.page.url) or f"{tab.page.url} is refused")
    return f"Opened {tab.page.url} (HTTP {response.status if response else '?'})."


async def _click(tab: _Tab, args: BrowserArgs) -> str:
    element = _element(tab, args)
    if await element.evaluate(_SUBMITS) and not args.submit:
        raise ToolFailure(f'element {args.element} submits a form: click it with "submit": true, which may '
                          "ask the person first")
    await element.click()
    await _settled(tab)
    return f"Clicked element {args.element}; now at {tab.page.url}."


async def _type(tab: _Tab, args: BrowserArgs) -> str:
    element = _element(tab, args)
    await element.fill(args.text or "")
    if args.submit:
        await element.press("Enter")
        await _settled(tab)
        return f"Typed into element {args.element} and submitted; now at {tab.page.url}."
    return f"Typed into element {args.element}."


async def _screenshot(tab: _Tab, args: BrowserArgs) -> str:
    shown = _write(tab.workspace, f"{FOLDER}/screenshot-{time.strftime('%Y%m%d-%H%M%S')}.png",
                   await tab.page.screenshot(full_page=True))
    return f"Saved a screenshot of {tab.page.url} as {shown} in your workspace."


async def _back(tab: _Tab, args: BrowserArgs) -> str:
    response = await tab.page.go_back(wait_until="domcontentloaded")
    return f"Went back to {tab.page.url}." if response is not None else "There is no page to go back to."


async def _snapshot_action(tab: _Tab, args: BrowserArgs) -> str:
    return f"At {tab.page.url}."


_ACTIONS = {"open": _open, "click": _click, "type": _type, "screenshot": _screenshot, "back": _back,
            "snapshot": _snapshot_action}
# Whether an element submits its form when clicked.
_SUBMITS = "e => !!(e.form && (e.type === 'submit' || e.type === 'image'))"


def _refusal_of(tab: _Tab, url: str) -> str | None:
    """Why the proxy refused `url`'s host during this action, if it did (a page's other requests
    may have been refused too)."""
    host = urlsplit(url).hostname or ""
    return next((reason for reason in reversed(tab.refused) if f"//{host}" in reason), None)


def _element(tab: _Tab, args: BrowserArgs) -> Any:
    return tab.page.locator(f'[data-ember-ref="{args.element}"]')


async def _settled(tab: _Tab) -> None:
    """A click or a submission may start a navigation: wait for its page to load, if it does."""
    try:
        await tab.page.wait_for_load_state("domcontentloaded")
    except Exception:  # no navigation, or a slow one: the snapshot shows where things are
        log.debug("no page load after a browser action", exc_info=True)


async def _snapshot(tab: _Tab, limit: int) -> str:
    text = await tab.page.evaluate(_SNAPSHOT)
    title = await tab.page.title()
    if len(text) > limit:
        text = text[:limit] + f"\n[snapshot truncated: {limit} of {len(text)} characters]"
    return f"Page: {title or '(no title)'} — {tab.page.url}\n{text}"


def browser_tool(spec: BrowserSpec, folders: Workspaces, *, allow_private: bool = False,
                 allowed_hosts: frozenset[str] = frozenset()) -> tuple[BrowserTool, BrowserPool]:
    """The tool and its pool (which the runtime closes when it stops); ConfigError when it cannot run."""
    pool = BrowserPool(spec, folders, allow_private=allow_private, allowed_hosts=allowed_hosts)
    pool.check()
    return BrowserTool(pool, spec), pool
