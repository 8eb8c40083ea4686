"""web_fetch: private addresses refused before any connection, on the first URL and on redirects."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ember.core.messages import ToolCall
from ember.core.tools import Risk
from ember.tools.base import FunctionTool, ToolRegistry
from ember.tools.web import address_problem, readable_text, web_fetch_tool
from tests.conftest import tool_run
from tests.loopback import wait_until

PAGE = """<!doctype html>
<html><head><title>The  Test Page</title>
<style>body { color: red }</style>
<script>var secret = "do not show";</script></head>
<body><h1>Welcome</h1>
<p>First   paragraph with <a href="/next">a link</a> and <a href="#top">an anchor</a>.</p>
<ul><li>one</li><li>two &amp; three</li></ul>
<noscript>enable scripts</noscript>
</body></html>"""


class PageServer:
    """Serves test pages on 127.0.0.1 from a background thread and records each request's path."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
        self._socket.bind(("127.0.0.1", 0))
        app = Starlette(routes=[
            Route("/page", lambda r: HTMLResponse(PAGE)),
            Route("/plain", lambda r: PlainTextResponse("just text")),
            Route("/latin1", lambda r: Response("café".encode("latin-1"), media_type="text/plain; charset=iso-8859-1")),
            Route("/big", lambda r: PlainTextResponse("x" * 50_000)),
            Route("/missing", lambda r: HTMLResponse("<p>no such page here</p>", status_code=404)),
            Route("/binary", lambda r: Response(b"\x89PNG\r\n\x1a\n\x00\x00", media_type="image/png")),
            Route("/host", lambda r: PlainTextResponse(f"host={r.headers['host']}")),
            Route("/redirect", lambda r: RedirectResponse(r.query_params["to"], status_code=302)),
            Route("/hop/{n:int}", self._hop),
            Route("/slow", self._slow),
        ])
        self._app = app
        config = uvicorn.Config(self._record, interface="asgi3", log_config=None, lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="pageserver", daemon=True)

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1]

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"

    async def _record(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            query = scope["query_string"].decode()
            self.requests.append(scope["path"] + (f"?{query}" if query else ""))
        await self._app(scope, receive, send)

    async def _hop(self, request: Request) -> Response:
        n = request.path_params["n"]
        return PlainTextResponse("arrived") if n == 0 else RedirectResponse(f"/hop/{n - 1}", status_code=301)

    async def _slow(self, request: Request) -> Response:
        await asyncio.sleep(1)  # past the tests' 0.5 s timeout, short enough not to delay shutdown
        return PlainTextResponse("too late")

    def start(self) -> None:
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), timeout_s=10, what="the server")
        if not self._server.started:
            raise RuntimeError("the test page server did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


@pytest.fixture(scope="module")
def server() -> Iterator[PageServer]:
    page_server = PageServer()
    page_server.start()
    try:
        yield page_server
    finally:
        page_server.stop()


async def fetch(tool: FunctionTool, url: str) -> str:
    call = ToolCall(id="c", name="web_fetch", arguments=json.dumps({"url": url}))
    return await ToolRegistry([tool]).call(call, tool_run())


def trusted(*, timeout_s: float = 5, max_bytes: int = 2_000_000, max_redirects: int = 5) -> FunctionTool:
    """A tool that may reach the test server by the name "localhost", and no other private host."""
    return web_fetch_tool(allowed_hosts=frozenset({"localhost"}), timeout_s=timeout_s, max_bytes=max_bytes,
                          max_redirects=max_redirects)


# --- the address classifier ---------------------------------------------------------------

@pytest.mark.parametrize(("address", "problem"), [
    ("8.8.8.8", None),
    ("93.184.216.34", None),
    ("2606:4700:4700::1111", None),
    ("::ffff:8.8.8.8", None),
    ("64:ff9b::808:808", None),
    ("2002:808:808::1", None),
    ("127.0.0.1", "loopback"),
    ("127.255.0.9", "loopback"),
    ("::1", "loopback"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("10.0.0.1", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("fd12:3456::1", "private"),
    ("fc00::1", "private"),
    ("169.254.169.254", "cloud metadata"),
    ("fd00:ec2::254", "cloud metadata"),
    ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("100.64.0.1", "shared"),
    ("100.127.255.254", "shared"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "reserved"),
    ("fec0::1", "reserved"),
    ("::127.0.0.1", "reserved"),
    ("0.1.2.3", "not a public address"),
    ("192.0.2.1", "not a public address"),
    ("198.18.0.1", "not a public address"),
    ("::ffff:127.0.0.1", "loopback address (IPv4-mapped form of 127.0.0.1)"),
    ("::ffff:10.1.2.3", "private address (IPv4-mapped"),
    ("::ffff:169.254.169.254", "cloud metadata address (IPv4-mapped"),
    ("64:ff9b::7f00:1", "loopback address (NAT64 form of 127.0.0.1)"),
    ("64:ff9b::a9fe:a9fe", "cloud metadata address (NAT64"),
    ("2002:7f00:1::", "loopback address (6to4 form of 127.0.0.1)"),
    ("2002:c0a8:101::1", "private address (6to4"),
])
def test_address_classifier(address: str, problem: str | None) -> None:
    verdict = address_problem(ipaddress.ip_address(address))
    if problem is None:
        assert verdict is None
    else:
        assert verdict is not None and problem in verdict


# --- refused before any connection ---------------------------------------------------------

@pytest.mark.parametrize(("url", "reason"), [
    ("http://127.0.0.1:{port}/page", "127.0.0.1 is a loopback address"),
    ("http://localhost:{port}/page", "localhost resolves to 127.0.0.1, a loopback address"),
    ("http://[::1]:{port}/page", "loopback"),
    ("http://[::ffff:127.0.0.1]:{port}/page", "IPv4-mapped form of 127.0.0.1"),
    ("http://0.0.0.0:{port}/page", "unspecified"),
    ("http://2130706433:{port}/page", "2130706433 resolves to 127.0.0.1, a loopback"),
    ("http://0x7f000001:{port}/page", "0x7f000001 resolves to 127.0.0.1, a loopback"),
    ("http://0x7f.1:{port}/page", "resolves to 127.0.0.1, a loopback"),
    ("http://127.1:{port}/page", "resolves to 127.0.0.1, a loopback"),
    ("http://[64:ff9b::7f00:1]:{port}/page", "NAT64 form of 127.0.0.1"),
    ("http://10.0.0.1/", "private"),
    ("http://10.255.255.1/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://172.16.0.1/", "private"),
    ("http://100.64.0.1/", "shared"),
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://[fe80::1]/", "link-local"),
    ("https://[fd00::1]/", "private"),
])
async def test_private_addresses_are_refused_without_connecting(server: PageServer, url: str, reason: str) -> None:
    tool = web_fetch_tool(timeout_s=3)
    before = len(server.requests)
    result = await fetch(tool, url.format(port=server.port))
    assert result.startswith("Error: ")
    assert "is refused" in result and reason in result, result
    assert "only public addresses" in result
    assert len(server.requests) == before


@pytest.mark.parametrize(("url", "reason"), [
    ("file:///etc/passwd", "only http and https URLs can be fetched, not file:"),
    ("ftp://example.com/file", "not ftp:"),
    ("gopher://example.com/", "not gopher:"),
    ("data:text/plain,hello", "not data:"),
    ("javascript:alert(1)", "not javascript:"),
    ("example.com/page", "not a URL without a scheme"),
    ("http://user:secret@localhost:{port}/page", "credentials"),
    ("http://user@localhost:{port}/page", "credentials"),
    ("http:///page", "has no host"),
    ("http://0177.0.0.1/", "not a valid URL"),
    ("http://localhost:99999/", "invalid port"),
    ("http://localhost:0/", "invalid port"),
])
async def test_other_urls_are_refused(server: PageServer, url: str, reason: str) -> None:
    before = len(server.requests)
    result = await fetch(trusted(), url.format(port=server.port))
    assert result.startswith("Error: ") and reason in result, result
    assert len(server.requests) == before


async def test_allowed_hosts_lift_the_check_for_that_host_only(server: PageServer) -> None:
    tool = trusted()
    assert "Status: 200" in await fetch(tool, server.url("/plain"))
    assert "is refused" in await fetch(tool, server.url("/plain", host="127.0.0.1"))


# --- redirects --------------------------------------------------------------------------

@pytest.mark.parametrize(("target", "reason"), [
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://10.0.0.1/", "private"),
    ("http://[::1]:{port}/page", "loopback"),
    ("http://127.0.0.1:{port}/page", "loopback"),
    ("http://127.0.0.2:{port}/page", "loopback"),
    ("http://[::ffff:127.0.0.1]:{port}/page", "IPv4-mapped"),
    ("http://2130706433:{port}/page", "loopback"),
    ("file:///etc/passwd", "only http and https"),
    ("http://user:pw@localhost:{port}/page", "credentials"),
])
async def test_redirects_to_forbidden_targets_are_refused(server: PageServer, target: str, reason: str) -> None:
    target = target.format(port=server.port)
    before = len(server.requests)
    start = server.url("/redirect?to=" + target.replace(":", "%3A").replace("/", "%2F").replace("@", "%40"))
    result = await fetch(trusted(), start)
    assert result.startswith("Error: the redirect from ")
    assert f" to {httpx.URL(target)} was not followed: " in result, result
    assert reason in result, result
    assert len(server.requests) == before + 1  # only the redirecting request arrived
    assert server.requests[-1].startswith("/redirect")


async def test_redirects_are_followed_and_shown(server: PageServer) -> None:
    result = await fetch(trusted(), server.url("/hop/3"))
    assert "Status: 200" in result
    assert f"URL: {server.url('/hop/0')}" in result
    assert f"Redirected from: {server.url('/hop/3')} -> {server.url('/hop/2')}" in result
    assert result.endswith("arrived")


async def test_too_many_redirects_stop(server: PageServer) -> None:
    before = len(server.requests)
    result = await fetch(trusted(max_redirects=2), server.url("/hop/5"))
    assert result.startswith("Error: stopped after 2 redirects"), result
    assert len(server.requests) == before + 3


# --- what a fetch returns ---------------------------------------------------------------

async def test_html_is_reduced_to_readable_text(server: PageServer) -> None:
    result = await fetch(trusted(), server.url("/page"))
    head, _, body = result.partition("\n\n")
    assert head.splitlines() == [f"URL: {server.url('/page')}", "Status: 200 OK",
                                 "Content-Type: text/html; charset=utf-8"]
    assert body == "\n".join([
        "Title: The Test Page",
        "",
        "# Welcome",
        "",
        f"First paragraph with a link ({server.url('/next')}) and an anchor.",
        "",
        "- one",
        "- two & three",
    ])


async def test_private_fetch_with_allow_private(server: PageServer) -> None:
    tool = web_fetch_tool(allow_private=True, timeout_s=5)
    result = await fetch(tool, server.url("/host", host="127.0.0.1"))
    assert result.endswith(f"host=127.0.0.1:{server.port}")


async def test_the_host_header_names_the_host_not_the_address(server: PageServer) -> None:
    result = await fetch(trusted(), server.url("/host"))
    assert result.endswith(f"host=localhost:{server.port}")


async def test_a_large_body_is_cut_with_a_note(server: PageServer) -> None:
    result = await fetch(trusted(max_bytes=1_000), server.url("/big"))
    assert "x" * 1_000 + "\n[cut: only the first 1000 bytes of the body were read]" in result
    assert "x" * 1_001 not in result


async def test_an_error_status_is_a_result(server: PageServer) -> None:
    result = await fetch(trusted(), server.url("/missing"))
    assert not result.startswith("Error")
    assert "Status: 404 Not Found" in result
    assert "the start of its body follows" in result
    assert result.endswith("no such page here")


async def test_charset_from_headers(server: PageServer) -> None:
    result = await fetch(trusted(), server.url("/latin1"))
    assert result.endswith("café")


async def test_binary_content_is_not_shown(server: PageServer) -> None:
    result = await fetch(trusted(), server.url("/binary"))
    assert "Content-Type: image/png" in result
    assert result.endswith("[image/png content not shown: only text can be read]")


async def test_a_slow_server_times_out(server: PageServer) -> None:
    result = await fetch(trusted(timeout_s=0.5), server.url("/slow"))
    assert result == f"Error: timed out after 0.5 s fetching {server.url('/slow')}"


async def test_a_closed_port_is_a_connection_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = await fetch(web_fetch_tool(allow_private=True, timeout_s=3), f"http://127.0.0.1:{port}/")
    assert result.startswith("Error: could not connect to 127.0.0.1 (127.0.0.1: "), result


def test_the_action_names_the_url() -> None:
    action = web_fetch_tool().describe({"url": "https://example.com/a"})
    assert action.risk is Risk.NETWORK
    assert action.subject == "https://example.com/a"
    assert action.summary == "fetch the URL https://example.com/a"


def test_readable_text_keeps_preformatted_text() -> None:
    text = readable_text("<p>Run:</p><pre>  if x:\n      go()</pre><p>done</p>", "https://example.com/")
    assert text == "Run:\n\n  if x:\n      go()\n\ndone"
