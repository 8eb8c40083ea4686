"""The `web_fetch` tool: fetch an http(s) URL and return its text, never reaching a private address.

Each hop of a fetch (the URL, then every redirect, followed by hand) is parsed,
its host resolved once, and every resolved address checked; the request then
goes to the checked address itself, with the real host name in the `Host`
header and, for https, in TLS SNI and certificate verification. So a DNS answer
that changes between the check and the connection (rebinding) cannot move the
request to another address. `allow_private` or a host name in `allowed_hosts`
lifts the address check, and only that.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import TypeVar
from urllib.parse import urljoin

import httpx
from pydantic import BaseModel, Field

from ember.core.tools import Risk
from ember.tools.base import FunctionTool, ToolFailure

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
R = TypeVar("R")
# What is made of the response a fetch ends at (no redirect): the URL it came from, the chain before it.
Handle = Callable[[httpx.Response, httpx.URL, list[str]], Awaitable[R]]

ERROR_EXCERPT_CHARS = 2_000
USER_AGENT = "Mozilla/5.0 (compatible; Ember web_fetch)"
ACCEPT = "text/html,application/xhtml+xml,text/plain;q=0.9,application/json;q=0.9,*/*;q=0.5"

_PRIVATE = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_METADATA = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
_TEXT_TYPES = frozenset({"application/json", "application/xml", "application/javascript", "application/x-javascript",
                         "application/ecmascript", "application/xhtml+xml"})


def address_problem(address: IPAddress) -> str | None:
    """Why a fetch must not reach `address`, or None for a public unicast address.

    IPv6 forms that carry an IPv4 address (mapped, NAT64, 6to4) are judged by it.
    """
    if isinstance(address, ipaddress.IPv6Address):
        for form, embedded in (("IPv4-mapped", address.ipv4_mapped), ("6to4", address.sixtofour),
                               ("NAT64", _nat64(address))):
            if embedded is not None:
                problem = address_problem(embedded)
                return problem and f"{problem} ({form} form of {embedded})"
    if address.is_unspecified:
        return "an unspecified address"
    if address.is_loopback:
        return "a loopback address"
    if address in _METADATA:
        return "a cloud metadata address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_multicast:
        return "a multicast address"
    if any(address in network for network in _PRIVATE):
        return "a private address"
    if address in _SHARED:
        return "a shared (carrier-grade NAT) address"
    if address.is_reserved or (isinstance(address, ipaddress.IPv6Address) and address.is_site_local):
        return "a reserved address"
    if not address.is_global:
        return "not a public address"
    return None


def _nat64(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF) if address in _NAT64 else None


@dataclass(frozen=True, slots=True)
class Target:
    """One checked hop: the URL as written and the addresses it may be fetched from."""

    url: httpx.URL
    host: str  # ASCII (IDNA) host name, lower case
    addresses: tuple[IPAddress, ...]

    def request_url(self, address: IPAddress) -> httpx.URL:
        return httpx.URL(scheme=self.url.scheme, host=str(address), port=self.url.port, raw_path=self.url.raw_path)


def _parse(raw: str) -> httpx.URL:
    try:
        url = httpx.URL(raw.strip())
    except httpx.InvalidURL as exc:
        raise ToolFailure(f"{raw} is not a valid URL ({exc})") from None
    if url.scheme not in ("http", "https"):
        scheme = f"{url.scheme}:" if url.scheme else "a URL without a scheme"
        raise ToolFailure(f"only http and https URLs can be fetched, not {scheme}")
    if url.userinfo:
        raise ToolFailure("URLs with credentials (user:password@) are refused")
    if not url.raw_host:
        raise ToolFailure(f"{url} has no host")
    if url.port is not None and not 0 < url.port < 65536:
        raise ToolFailure(f"{url} has an invalid port ({url.port})")
    return url


async def _resolve(host: str, port: int) -> tuple[IPAddress, ...]:
    """Every address the OS resolves `host` to; IP literals, even as integers (2130706433), included."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ToolFailure(f"could not resolve {host}: {exc.strerror}") from None
    return tuple(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


class AddressRefused(ToolFailure):
    """The URL's host is or resolves to an address that must not be reached."""


async def checked_target(raw: str, *, allow_private: bool, allowed_hosts: frozenset[str]) -> Target:
    """`raw` parsed and resolved, every address checked (unless allowed): the addresses to connect to."""
    url = _parse(raw)
    host = url.raw_host.decode("ascii").lower()
    port = url.port or (443 if url.scheme == "https" else 80)
    addresses = await _resolve(host, port)
    if not (allow_private or host.rstrip(".") in allowed_hosts):
        for address in addresses:
            if problem := address_problem(address):
                where = f"{host} is" if host == str(address) else f"{host} resolves to {address},"
                raise AddressRefused(f"{url} is refused: {where} {problem}; only public addresses can be reached")
    return Target(url, host, addresses)


def _is_text(media_type: str) -> bool:
    return media_type.startswith("text/") or media_type in _TEXT_TYPES or media_type.endswith(("+json", "+xml"))


def _decode(body: bytes, charset: str | None) -> str:
    try:
        codec = codecs.lookup(charset or "utf-8").name
    except LookupError:
        codec = "utf-8"
    return body.decode(codec, errors="replace")


_SKIPPED_TAGS = frozenset({"script", "style", "noscript", "template", "svg", "iframe", "object"})
_LINE_BREAKS = {"p": 2, "h1": 2, "h2": 2, "h3": 2, "h4": 2, "h5": 2, "h6": 2, "pre": 2, "blockquote": 2,
                "table": 2, "ul": 1, "ol": 1, "li": 1, "div": 1, "br": 1, "tr": 1, "hr": 1, "dt": 1, "dd": 1,
                "section": 1, "article": 1, "header": 1, "footer": 1, "nav": 1, "main": 1, "aside": 1,
                "form": 1, "figure": 1, "figcaption": 1, "body": 1}


class _Reader(HTMLParser):
    """HTML to readable text: scripts and styles dropped, blocks on their own lines, link targets kept."""

    def __init__(self, base_url: str) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self._base = base_url
        self._out: list[str] = []
        self._skip = 0
        self._pre = 0
        self._in_title = False
        self._link: tuple[str, int] | None = None  # absolute href, where its text starts in _out

    def text(self) -> str:
        lines = "".join(self._out).split("\n")
        body = re.sub(r"\n{3,}", "\n\n", "\n".join(line.rstrip() for line in lines)).strip()
        return f"Title: {self.title}\n\n{body}" if self.title else body

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIPPED_TAGS:
            self._skip += 1
        if self._skip:
            return
        self._in_title = tag == "title"
        self._break(_LINE_BREAKS.get(tag, 0))
        if tag == "li":
            self._out.append("- ")
        elif tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
            self._out.append("#" * int(tag[1]) + " ")
        elif tag == "pre":
            self._pre += 1
        elif tag == "a":
            raw = (dict(attrs).get("href") or "").strip()
            href = urljoin(self._base, raw)
            keep = href.startswith(("http://", "https://")) and not raw.startswith("#")
            self._link = (href, len(self._out)) if keep else None

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED_TAGS:
            self._skip = max(0, self._skip - 1)
            return
        if self._skip:
            return
        if tag == "title":
            self._in_title = False
        elif tag == "pre":
            self._pre = max(0, self._pre - 1)
        elif tag == "a" and self._link:
            href, start = self._link
            label = "".join(self._out[start:]).strip()
            if label and label != href:
                self._out.append(f" ({href})")
            self._link = None
        self._break(_LINE_BREAKS.get(tag, 0))

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        if self._in_title:
            self.title = " ".join(f"{self.title} {data}".split())
            return
        if not self._pre:
            data = re.sub(r"\s+", " ", data)
            if not self._out or self._out[-1][-1:].isspace():
                data = data.lstrip(" ")
        if data:
            self._out.append(data)

    def _break(self, lines: int) -> None:
        """End the line, leaving at least `lines` line breaks (2: a blank line) before what follows."""
        if not self._out:
            return
        tail = "".join(self._out[-4:])
        have = tail[len(tail.rstrip()):].count("\n")
        if lines > have:
            self._out.append("\n" * (lines - have))


def readable_text(html: str, base_url: str) -> str:
    """The text a person would read on an HTML page, with the page title first."""
    reader = _Reader(base_url)
    reader.feed(html)
    reader.close()
    return reader.text()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """certifi's roots with hostname checks on, built once (tens of milliseconds) and shared by every fetch."""
    return httpx.create_ssl_context(trust_env=False)


@dataclass(frozen=True, slots=True)
class _Fetcher:
    allow_private: bool
    allowed_hosts: frozenset[str]
    timeout_s: float
    max_bytes: int
    max_redirects: int

    async def fetch(self, url: str) -> str:
        return await self._fetched(url, self._render)

    async def fetch_file(self, url: str) -> tuple[bytes, str]:
        """The body and its media type; ToolFailure when the server refused or it is over max_bytes."""
        return await self._fetched(url, self._file)

    async def _fetched(self, url: str, handle: Handle[R]) -> R:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._follow(url, handle)
        except (TimeoutError, httpx.TimeoutException):
            raise ToolFailure(f"timed out after {self.timeout_s:g} s fetching {url}") from None
        except httpx.HTTPError as exc:
            raise ToolFailure(f"fetching {url} failed: {type(exc).__name__}: {exc}") from None

    async def _follow(self, url: str, handle: Handle[R]) -> R:
        """Fetch `url`, following up to max_redirects redirects, each checked like the first URL."""
        chain = [url]
        target = await self._target(url)
        while True:
            # A client per hop: a pooled connection must not carry one host's TLS session to another.
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False, verify=_tls_context(),
                                         timeout=self.timeout_s,
                                         headers={"User-Agent": USER_AGENT, "Accept": ACCEPT}) as client:
                response = await self._send(client, target)
                try:
                    if not response.is_redirect:
                        return await handle(response, target.url, chain)
                    location = response.headers["Location"]
                finally:
                    await response.aclose()
            if len(chain) > self.max_redirects:
                raise ToolFailure(f"stopped after {self.max_redirects} redirects; the last one pointed to {location}")
            try:
                location = str(target.url.join(location))
                target = await self._target(location)
            except (httpx.InvalidURL, ToolFailure) as exc:
                raise ToolFailure(f"the redirect from {chain[-1]} to {location} was not followed: {exc}") from None
            chain.append(location)

    async def _target(self, raw: str) -> Target:
        return await checked_target(raw, allow_private=self.allow_private, allowed_hosts=self.allowed_hosts)

    async def _send(self, client: httpx.AsyncClient, target: Target) -> httpx.Response:
        """GET the target from the first of its checked addresses that accepts a connection."""
        sni = {"sni_hostname": target.host.rstrip(".")} if target.url.scheme == "https" else {}
        failures = []
        for address in target.addresses:
            request = client.build_request("GET", target.request_url(address), extensions=sni,
                                           headers={"Host": target.url.netloc.decode("ascii")})
            try:
                return await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                failures.append(f"{address}: {exc or type(exc).__name__}")
        raise ToolFailure(f"could not connect to {target.host} ({'; '.join(failures)})")

    async def _render(self, response: httpx.Response, url: httpx.URL, chain: list[str]) -> str:
        content_type = response.headers.get("Content-Type", "")
        media_type = content_type.split(";")[0].strip().lower()
        head = [f"URL: {url}", f"Status: {response.status_code} {response.reason_phrase}".rstrip(),
                f"Content-Type: {content_type or 'unknown'}"]
        if len(chain) > 1:
            head.append(f"Redirected from: {' -> '.join(chain[:-1])}")
        if media_type and not _is_text(media_type):
            return "\n".join([*head, "", f"[{media_type} content not shown: only text can be read]"])
        body, cut = await self._read(response)
        if not media_type and b"\x00" in body[:1024]:
            return "\n".join([*head, "", "[binary content not shown: only text can be read]"])
        text = _decode(body, response.charset_encoding)
        if media_type in ("text/html", "application/xhtml+xml") or (
                not media_type and text.lstrip()[:15].lower().startswith(("<!doctype html", "<html"))):
            text = await asyncio.to_thread(readable_text, text, str(url))  # seconds of CPU for megabytes
        if not response.is_success:
            head.append("The server answered with an error; the start of its body follows.")
            text = text[:ERROR_EXCERPT_CHARS]
        elif cut:
            text += f"\n[cut: only the first {self.max_bytes} bytes of the body were read]"
        return "\n".join([*head, "", text])

    async def _file(self, response: httpx.Response, url: httpx.URL, chain: list[str]) -> tuple[bytes, str]:
        if not response.is_success:
            raise ToolFailure(f"{url} answered {response.status_code} {response.reason_phrase}".rstrip())
        body, cut = await self._read(response)
        if cut:
            raise ToolFailure(f"{url} is larger than {self.max_bytes} bytes")
        return body, response.headers.get("Content-Type", "").split(";")[0].strip().lower()

    async def _read(self, response: httpx.Response) -> tuple[bytes, bool]:
        """At most max_bytes of the (decompressed) body, and whether there was more."""
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > self.max_bytes:
                return bytes(body[: self.max_bytes]), True
        return bytes(body), False


class WebFetchArgs(BaseModel):
    url: str = Field(max_length=8_192, description="The http:// or https:// URL to fetch")


def file_fetcher(*, allow_private: bool, allowed_hosts: frozenset[str], max_bytes: int,
                 timeout_s: float = 20) -> Callable[[str], Awaitable[tuple[bytes, str]]]:
    """Fetch a file by http(s) URL under web_fetch's address rules: (its bytes, its media type), or
    ToolFailure saying why not."""
    return _Fetcher(allow_private, frozenset(h.lower().rstrip(".") for h in allowed_hosts), timeout_s, max_bytes,
                    5).fetch_file


def web_fetch_tool(*, allow_private: bool = False, allowed_hosts: frozenset[str] = frozenset(),
                   timeout_s: float = 20, max_bytes: int = 2_000_000, max_redirects: int = 5) -> FunctionTool:
    """`web_fetch`: GET a public http(s) URL and return status, final URL, content type and readable text.

    `allow_private` lifts the address check for every host; `allowed_hosts`
    (exact host names, or IP literals as written in URLs) lifts it for those
    hosts only, on the first URL and on redirects alike.
    """
    fetcher = _Fetcher(allow_private, frozenset(h.lower().rstrip(".") for h in allowed_hosts), timeout_s, max_bytes,
                       max_redirects)

    async def web_fetch(args: WebFetchArgs) -> str:
        return await fetcher.fetch(args.url)

    return FunctionTool(
        "web_fetch",
        "Fetch a web page or other text resource by http(s) URL and return its status, final URL, content type "
        "and text (HTML reduced to readable text). Only public internet addresses can be fetched.",
        WebFetchArgs, web_fetch, risk=Risk.NETWORK, subject=lambda a: a.url, verb="fetch the URL",
    )
