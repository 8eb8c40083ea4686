"""Streaming turns through `ember serve` under many concurrent clients, against a 50 ms model.

    .venv/bin/python bench/gateway_load.py [--clients 100 500] [--duration S] [--runs N] [--quick]

Three kinds of process share the machine: the model server (tests/modelserver.py
on uvicorn; every streamed chat completion is answered after a fixed 50 ms with a
short answer in a few chunks), a real `ember serve` child pointed at it, and a
load generator: N clients, one keep-alive connection each, sending streamed
turns back to back, on a new Ember session every 20 turns (the window the
default consolidation threshold keeps; consolidation itself is off). At each N:

1. direct: the N clients stream straight from the model server, no Ember (the baseline);
2. ember: the same N clients stream through Ember's OpenAI-compatible gateway.

Each load warms up until every client has finished a turn (so the arrival
burst is over), then measures `--runs` windows of `--duration` seconds back to
back under the same continuous load; the clients then finish the turn they
are in. A run's throughput counts the turns finished inside its window; its
latencies are those of the turns started inside it. Figures are medians of the
per-run figures (p99 likewise).

Every user message carries a tag the model server records with its own times
(request in, first content chunk out, [DONE] out; CLOCK_MONOTONIC is one clock
for all the processes), so each turn through Ember is paired with the model's
own time for the same reply:

  added latency       = the client's turn time - the model server's time for that reply
  first-delta overhead = the client's time to the first content delta - the model's time to its first content chunk

Targets (the gateway issue): >= 0.9 x ideal throughput at 100 clients (ideal:
every client limited only by the model's 50 ms), p99 added latency < 20 ms,
first-delta overhead < 5 ms median, no errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    checkout_on_path,
    ms,
    print_header,
    quantile,
    rerun_command,
    unwind_on_signals,
    verdict,
    without_user_config,
)

MODEL_DELAY_S = 0.050
# A client moves to a new session every this many turns: the window the default consolidation
# threshold (40 messages) keeps. Consolidation itself is off, so its model calls do not mix with
# the turns'; without the move every history would grow for the whole run.
SESSION_TURNS = 20
MODEL_NAME = "bench-model"
ANSWER_CHUNKS = ("The build is green: ", "all 312 tests pass, ", "lint is clean, ", "and the wheel is published.")
ANSWER = "".join(ANSWER_CHUNKS)
QUESTION = "How did last night's build go?"
TAG = re.compile(r"^\[([A-Za-z0-9._-]+)\]")
TARGET_IDEAL = 0.9  # x ideal at 100 clients
TARGET_ADDED_P99_S = 0.020
TARGET_FIRST_DELTA_S = 0.005
TURN_TIMEOUT_S = 60.0  # a turn taking longer is an error
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the model server (its own process) --------------------------------------------------


def model_server(port_file: Path, delay_s: float = MODEL_DELAY_S) -> None:
    """tests/modelserver.py answering ANSWER_CHUNKS after `delay_s`; /bench/stats: what it saw since last asked."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
    from starlette.types import Receive, Scope, Send

    from tests.modelserver import ModelServer, Reply, serve_forever

    server = ModelServer(MODEL_NAME, record=False)
    server.explainer = server.titler = None  # every request is the bench's, answered alike
    replies: dict[str, tuple[float, float, float]] = {}
    connections: set[tuple[str, int]] = set()

    def respond(body: dict[str, Any]) -> Reply:
        received = first = time.monotonic()
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        found = TAG.match(str(users[-1].get("content") or "")) if users else None
        server.counts["untagged"] += found is None

        def watch(event: str, n: int) -> None:
            nonlocal first
            if event == "chunk" and n == 1:
                first = time.monotonic()
            elif event == "done" and found:  # once [DONE] has gone to the transport
                replies[found.group(1)] = (received, first, time.monotonic())

        return Reply(text=ANSWER, pieces=ANSWER_CHUNKS, delay_s=delay_s, watch=watch)

    async def take_stats(request: Request) -> Response:
        out = {"replies": dict(replies), "connections": len(connections), "untagged": server.counts["untagged"],
               "requests": server.counts["chat"]}
        replies.clear()
        connections.clear()
        server.counts.clear()
        return JSONResponse(out)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions" and scope.get("client"):
            connections.add(tuple(scope["client"]))
        await routes(scope, receive, send)

    server.responder = respond
    # The server's own routes beside the bench's, not mounted: one app, one middleware stack per request.
    routes = Starlette(routes=[Route("/bench/stats", take_stats, methods=["POST"]), *server.app.routes])
    serve_forever(app, port_file, backlog=4096, keep_alive_s=30)


# --- the load generator (its own process) ------------------------------------------------


def load_generator(spec: dict[str, Any], out: Path) -> None:
    asyncio.run(_load(spec, out))


class RawHttp:
    """Just enough HTTP/1.1 for this bench: one keep-alive connection to one server,
    a POST at a time, the body chunked or sized. Far less CPU than a general client,
    which leaves more of the machine to the servers under test."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, content: bytes, headers: dict[str, str], consume: Callable[[bytes], None],
                   path: str | None = None) -> int:
        """Send one request (to `path` on the same server, default the URL's), feed the body to
        `consume` piece by piece; the status."""
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)  # asyncio sets TCP_NODELAY
        reader, writer = self._streams
        lines = [f"POST {path or self.path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Content-Type: application/json", f"Content-Length: {len(content)}",
                 *(f"{k}: {v}" for k, v in headers.items())]
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + content)
            status = int((await reader.readline()).split(None, 2)[1])
            fields = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                fields[name.strip().lower()] = value.strip().lower()
            if fields.get("transfer-encoding") == "chunked":
                while size := int((await reader.readline()).split(b";")[0], 16):
                    consume((await reader.readexactly(size + 2))[:-2])
                while await reader.readline() not in (b"\r\n", b""):
                    pass  # trailers
            elif "content-length" in fields:
                consume(await reader.readexactly(int(fields["content-length"])))
            else:
                consume(await reader.read())
                fields["connection"] = "close"
        except BaseException:
            self.close()
            raise
        if fields.get("connection") == "close":
            self.close()
        return status

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


class HttpxHttp:
    """The same through httpx, for a cross-check: one client (and pool) per simulated client,
    since one shared httpcore pool costs O(connections) per request (encode/httpcore#1035)."""

    def __init__(self, url: str) -> None:
        import httpx

        self.url = url
        self._client = httpx.AsyncClient(verify=False, timeout=httpx.Timeout(60.0), trust_env=False)

    async def post(self, content: bytes, headers: dict[str, str], consume: Callable[[bytes], None]) -> int:
        async with self._client.stream("POST", self.url, content=content,
                                       headers={"content-type": "application/json", **headers}) as response:
            async for raw in response.aiter_raw():  # to the end, so the connection is reused
                consume(raw)
            return response.status_code

    def close(self) -> None:
        pass  # the process ends right after


class Turn:
    """One streamed turn as the client sees it: SSE events, the first content delta, [DONE]."""

    def __init__(self) -> None:
        self.buffer = b""
        self.first: float | None = None
        self.finished: float | None = None
        self.text: list[str] = []
        self.problem: str | None = None
        self.raw: list[bytes] = []

    def feed(self, data: bytes) -> None:
        self.raw.append(data)
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        for item in events:
            if not item.startswith(b"data: "):
                continue  # keep-alive comments
            payload = item[6:]
            if payload == b"[DONE]":
                self.finished = time.monotonic()
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                self.problem = f"error chunk: {json.dumps(chunk)[:200]}"
                continue
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if delta.get("content"):
                self.first = self.first or time.monotonic()
                self.text.append(delta["content"])


async def _load(spec: dict[str, Any], out: Path) -> None:
    """Warm up until every client has finished a turn (the arrival burst is over), then measure
    `windows` back-to-back windows of `duration` seconds under the same continuous load."""
    n, url, ember = spec["clients"], spec["url"], spec["mode"] == "ember"
    transport = {"raw": RawHttp, "httpx": HttpxHttp}[spec["http"]]
    turns: list[list[Any]] = []  # [tag, start, first content delta, [DONE]]
    errors: list[tuple[float, str]] = []
    finished_one: set[int] = set()
    stop = float("inf")  # no turn starts after this

    async def one_client(index: int) -> None:
        await asyncio.sleep(index / n * spec["ramp"])  # arrivals spread out, not one burst
        http = transport(url)
        turn = 0
        while time.monotonic() < stop:
            tag = f"{spec['prefix']}-{index}-{turn}"
            turn += 1
            body: dict[str, Any] = {"model": "ember" if ember else MODEL_NAME, "stream": True,
                                    "messages": [{"role": "user", "content": f"[{tag}] {QUESTION}"}]}
            if not ember:
                body["stream_options"] = {"include_usage": True}  # as Ember asks the model
            headers = {"X-Ember-Session": f"{spec['prefix']}-{index}-s{turn // SESSION_TURNS}"} if ember else {}
            result = Turn()
            start = time.monotonic()
            try:
                async with asyncio.timeout(TURN_TIMEOUT_S):
                    status = await http.post(json.dumps(body).encode(), headers, result.feed)
                if status != 200:
                    result.problem = f"HTTP {status}: {b''.join(result.raw)[:200]!r}"
            except Exception as exc:  # connection, timeout, protocol or parse errors, httpx's included
                result.problem = f"{type(exc).__name__}: {exc}"[:200]
            if result.problem is None and result.finished is None:
                result.problem = "the stream ended without [DONE]"
            if result.problem is None and "".join(result.text) != ANSWER:
                result.problem = f"wrong answer: {''.join(result.text)[:100]!r}"
            if result.problem is not None:
                errors.append((start, f"client {index} turn {tag}: {result.problem}"))
                await asyncio.sleep(0.05)  # no hot loop on a failing server
                continue
            turns.append([tag, start, result.first, result.finished])
            finished_one.add(index)
        http.close()

    def cpu_now() -> dict[str, float]:
        sample = {name: cpu_seconds(pid, tid) for name, (pid, tid) in spec["pids"].items()}
        return {**sample, "load generator": time.process_time()}

    tasks = [asyncio.create_task(one_client(i)) for i in range(n)]
    started = time.monotonic()
    await asyncio.sleep(spec["min_warmup"])
    while len(finished_one) < n and time.monotonic() - started < spec["max_warmup"]:
        await asyncio.sleep(0.1)
    warmup = time.monotonic() - started
    windows = []
    for _ in range(spec["windows"]):
        begin, cpu = time.monotonic(), cpu_now()
        await asyncio.sleep(spec["duration"])
        end, cpu_end = time.monotonic(), cpu_now()
        windows.append({"begin": begin, "end": end, "cpu": {k: (cpu_end[k] - cpu[k]) / (end - begin) for k in cpu}})
    stop = time.monotonic()
    _, stuck = await asyncio.wait(tasks, timeout=TURN_TIMEOUT_S + 10)
    for task in stuck:
        task.cancel()
    errors += [(stop, "a client's last turn never ended")] * len(stuck)
    out.write_text(json.dumps({"turns": turns, "errors": errors, "windows": windows, "warmup_s": warmup,
                               "warm": len(finished_one), "drain_s": time.monotonic() - stop}))


# --- the orchestrator ----------------------------------------------------------------------


class Child:
    """A child process in its own session (Ctrl-C reaches only us), stopped by its pid."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} (pid {self.pid}) exited with {self.proc.returncode}:\n{tail}")

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: uvicorn (Ember, the model server) stops gracefully on it
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def wait_for(condition: Any, what: str, child: Child, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        child.check()
        with contextlib.suppress(OSError, ValueError):
            if condition():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_model(directory: Path) -> tuple[Child, str]:
    port_file = directory / "model.port"
    child = Child("model server", [sys.executable, __file__, "--role", "model", "--out", str(port_file)],
                  checkout_on_path(dict(os.environ)), directory / "model.log")
    wait_for(lambda: port_file.exists() and port_file.read_text().isdigit(), "the model server", child)
    base = f"http://127.0.0.1:{port_file.read_text()}"
    wait_for(lambda: take_model_stats(base) is not None, "the model server", child)
    return child, base


def ember_command(profile: Path | None) -> list[str]:
    """How to start `ember`: the venv's script, or under cProfile (stats written when it stops)."""
    if profile is not None:
        return [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "ember"]
    ember = ROOT / ".venv" / "bin" / "ember"
    return [str(ember) if ember.exists() else "ember"]


def start_ember(directory: Path, model_base: str, synchronous: str, command: list[str]) -> tuple[Child, str]:
    port = free_port()
    env = without_user_config(dict(os.environ), directory / "home")
    env.update(
        EMBER_MODEL_BASE_URL=f"{model_base}/v1",
        EMBER_MODEL=MODEL_NAME,
        EMBER_MODEL_API_KEY="x",
        EMBER_GATEWAY_RATE_PER_MINUTE="1000000",
        EMBER_GATEWAY_RATE_BURST="100000",
        EMBER_CONSOLIDATION_THRESHOLD="100000",
        EMBER_GATEWAY_SHUTDOWN_GRACE_S="3",
        EMBER_SQLITE_SYNCHRONOUS=synchronous,
    )
    child = Child("ember serve", [*command, "serve", "--port", str(port)], env, directory / "ember-serve.log")
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_ok(f"{base}/healthz"), "ember serve", child, timeout_s=60)
    return child, base


def take_model_stats(base: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{base}/bench/stats", method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@dataclass
class Window:
    """One measured window: its throughput and its turns' figures (seconds, or CPU cores)."""

    turns_per_s: float
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class Load:
    """One load generator at one N, through Ember or direct: its windows, and what spans them."""

    clients: int
    mode: str
    windows: list[Window]
    errors: list[str]
    warmup_s: float
    warm: int  # clients that had finished a turn when the windows began
    drain_s: float
    unpaired: int
    model_connections: int

    def median(self, key: str) -> float:
        values = [w.figures[key] for w in self.windows if key in w.figures]
        return statistics.median(values) if values else float("nan")

    @property
    def turns_per_s(self) -> float:
        return statistics.median(w.turns_per_s for w in self.windows)


def measure(directory: Path, label: str, mode: str, clients: int, url: str, model_base: str,
            args: argparse.Namespace, ember_pid: int, model_pid: int) -> Load:
    take_model_stats(model_base)  # forget what came before
    spec = {"clients": clients, "url": url, "mode": mode, "prefix": label, "http": args.http,
            "ramp": args.warmup / 2, "min_warmup": args.warmup, "max_warmup": args.max_warmup,
            "windows": args.runs, "duration": args.duration,
            "pids": {"ember": (ember_pid, None), "ember main thread": (ember_pid, ember_pid),
                     "model": (model_pid, None)}}
    out = directory / f"{label}.json"
    load = Child("load generator", [sys.executable, __file__, "--role", "load", "--spec", json.dumps(spec),
                                    "--out", str(out)], dict(os.environ), directory / f"{label}.log")
    try:
        load.proc.wait(timeout=args.max_warmup + args.runs * args.duration + TURN_TIMEOUT_S + 60)
        if load.proc.returncode:
            load.check()
    finally:
        load.stop()
    result = json.loads(out.read_text())
    model = take_model_stats(model_base)
    replies = model["replies"]
    errors = [text for _, text in sorted(result["errors"])]
    if model["untagged"]:
        errors.append(f"the model server got {model['untagged']} requests without a tag")
    unpaired = 0
    windows = []
    for spec_window in result["windows"]:
        begin, end = spec_window["begin"], spec_window["end"]
        done = sum(1 for t in result["turns"] if begin <= t[3] < end)
        window = Window(done / (end - begin))
        total, first, added, first_ovh, before, after, model_span = [], [], [], [], [], [], []
        for tag, t_start, t_first, t_done in result["turns"]:
            if not begin <= t_start < end:
                continue
            total.append(t_done - t_start)
            first.append(t_first - t_start)
            if tag not in replies:
                unpaired += 1
                continue
            received, model_first, model_done = replies[tag]
            model_span.append(model_done - received)
            added.append((t_done - t_start) - (model_done - received))
            first_ovh.append((t_first - t_start) - (model_first - received))
            before.append(received - t_start)
            after.append(t_done - model_done)
        f = window.figures
        if total:
            f.update(samples=len(total), turn_p50=statistics.median(total), turn_p99=quantile(total, 0.99),
                     first_p50=statistics.median(first), first_p99=quantile(first, 0.99))
        if added:
            f.update(added_p50=statistics.median(added), added_p99=quantile(added, 0.99),
                     first_ovh_p50=statistics.median(first_ovh), first_ovh_p99=quantile(first_ovh, 0.99),
                     before_p50=statistics.median(before), after_p50=statistics.median(after),
                     model_p50=statistics.median(model_span))
        f.update({f"cpu {name}": cores for name, cores in spec_window["cpu"].items()})
        windows.append(window)
    return Load(clients, mode, windows, errors, result["warmup_s"], result["warm"], result["drain_s"], unpaired,
                model["connections"])


# --- report --------------------------------------------------------------------------------


def header(args: argparse.Namespace, directory: Path) -> None:
    import openai
    import starlette
    import uvicorn

    versions = (f"uvicorn {uvicorn.__version__}, starlette {starlette.__version__},"
                f" openai {openai.__version__} (Ember's model client)")
    client = "a minimal HTTP/1.1 client on asyncio streams" if args.http == "raw" else "httpx"
    print_header("Ember gateway load benchmark", versions, [
        ("clients", f"own process, {client}; one keep-alive connection per client,"
                    f" a new Ember session every {SESSION_TURNS} turns"),
        ("model", f"own process (uvicorn), answers after {MODEL_DELAY_S * 1e3:.0f} ms,"
                  f" {len(ANSWER_CHUNKS)} content chunks, no further delay"),
        ("ember", f"`ember serve` child, home {directory / 'home'}, sqlite synchronous={args.synchronous}"),
        ("settings", f"clients {', '.join(map(str, args.clients))}; each N direct, then through Ember: warm-up"
                     f" >= {args.warmup:g} s until every client has finished a turn (at most {args.max_warmup:g} s),"
                     f" then {args.runs} runs of {args.duration:g} s back to back"),
    ], rerun_command(__file__))


def report(results: dict[tuple[int, str], Load], args: argparse.Namespace) -> None:
    targets: list[tuple[str, bool]] = []
    pairs = [(n, results[(n, "direct")], results[(n, "ember")]) for n in args.clients]
    print(f"\n1. Throughput, turns/s (median of {args.runs} runs; ideal = clients / {MODEL_DELAY_S * 1e3:.0f} ms)")
    print(f"  {'clients':>7} {'ideal':>7} {'direct':>8} {'x ideal':>8} {'ember':>8} {'x ideal':>8} {'x direct':>8}"
          f" {'errors':>7}")
    for n, direct, ember in pairs:
        ideal = n / MODEL_DELAY_S
        d, e = direct.turns_per_s, ember.turns_per_s
        errors = len(direct.errors) + len(ember.errors)
        print(f"  {n:>7} {ideal:7.0f} {d:8.0f} {d / ideal:8.2f} {e:8.1f} {e / ideal:8.3f}"
              f" {e / d if d else float('nan'):8.3f} {errors:>7}")
        if n == 100:
            targets.append((f"throughput at 100 clients >= {TARGET_IDEAL} x ideal: {e / ideal:.3f} x ideal",
                            e / ideal >= TARGET_IDEAL))

    print("\n2. Latency per turn, ms (each turn paired with the model server's own time for its reply)")
    print(f"  {'clients':>7} {'mode':>6} {'turns':>6} {'turn p50':>9} {'p99':>8} {'model':>6}"
          f" {'added p50':>9} {'p99':>8}   {'in p50':>8} {'out p50':>8}")
    for n, *loads in pairs:
        for load in loads:
            print(f"  {n:>7} {load.mode:>6} {load.median('samples'):6.0f} {ms(load.median('turn_p50'), 9)}"
                  f" {ms(load.median('turn_p99'))} {ms(load.median('model_p50'), 6)}"
                  f" {ms(load.median('added_p50'), 9)} {ms(load.median('added_p99'))}"
                  f"   {ms(load.median('before_p50'))} {ms(load.median('after_p50'))}")
        p99 = loads[1].median("added_p99")
        targets.append((f"p99 added latency < {TARGET_ADDED_P99_S * 1e3:.0f} ms at {n} clients: {p99 * 1e3:.1f} ms",
                        p99 < TARGET_ADDED_P99_S))
    print("  turns: turns started in a run (the samples); model: the model server's own time, request in to")
    print("  [DONE] out; added = turn - model = in + out; in: client sends -> the model server has Ember's request;")
    print("  out: the model's [DONE] -> the client's [DONE]. Direct rows: the same through no Ember (the floor).")

    print("\n3. Time to the first content delta, ms")
    print(f"  {'clients':>7} {'mode':>6} {'first p50':>9} {'p99':>8} {'overhead p50':>12} {'p99':>8}")
    for n, *loads in pairs:
        for load in loads:
            print(f"  {n:>7} {load.mode:>6} {ms(load.median('first_p50'), 9)} {ms(load.median('first_p99'))}"
                  f" {ms(load.median('first_ovh_p50'), 12)} {ms(load.median('first_ovh_p99'))}")
        p50 = loads[1].median("first_ovh_p50")
        targets.append((f"first-delta overhead median < {TARGET_FIRST_DELTA_S * 1e3:.0f} ms at {n} clients:"
                        f" {p50 * 1e3:.1f} ms", p50 < TARGET_FIRST_DELTA_S))
    print("  overhead = the client's first content delta - the model server's first content chunk, same reply")

    print(f"\n4. CPU while measuring, cores (of {os.cpu_count()}), Ember's CPU per turn, and how each load went")
    print(f"  {'clients':>7} {'mode':>6} {'ember':>6} {'main thr':>8} {'model':>6} {'load gen':>8}"
          f" {'ember ms/turn':>13} {'model conns':>11} {'warm-up s':>9} {'drain s':>7}")
    for n, *loads in pairs:
        for load in loads:
            rate = load.turns_per_s
            per_turn = load.median("cpu ember") / rate * 1e3 if load.mode == "ember" and rate else float("nan")
            warm = f"{load.warmup_s:.1f}" + ("" if load.warm == n else f" ({load.warm}/{n} warm)")
            print(f"  {n:>7} {load.mode:>6} {load.median('cpu ember'):6.2f} {load.median('cpu ember main thread'):8.2f}"
                  f" {load.median('cpu model'):6.2f} {load.median('cpu load generator'):8.2f} {per_turn:13.1f}"
                  f" {load.model_connections:11} {warm:>9} {load.drain_s:7.1f}")
    print("  main thr: Ember's event loop thread; model conns: connections the model server saw during the load;")
    print("  warm-up: until every client had finished one turn; drain: the clients' last turns, after the runs")

    errors = [f"{load.clients} {load.mode}: {e}" for load in results.values() for e in load.errors]
    unpaired = sum(load.unpaired for load in results.values())
    targets.append((f"errors (non-200, error chunks, broken or wrong streams, timeouts): {len(errors)}", not errors))
    if unpaired:
        print(f"\n  {unpaired} turns had no model record to pair with (left out of added and overhead)")
    if errors:
        print("\n  first errors:")
        for line in errors[:10]:
            print(f"    {line}")
    print("\nTargets (the gateway issue)")
    for text, ok in targets:
        print(f"  {verdict(ok)}  {text}")


def ember_log_problems(directory: Path) -> None:
    log = directory / "home" / "ember.log"
    if not log.exists():
        return
    lines = log.read_text(errors="replace").splitlines()
    bad = [line for line in lines if " WARNING " in line or " ERROR " in line or " CRITICAL " in line]
    print(f"\n  ember.log: {len(lines)} lines, {len(bad)} warnings or errors")
    for line in bad[:5]:
        print(f"    {line[:200]}")


def print_profile(path: Path) -> None:
    """Own time summed by package (where Ember's CPU goes), then the top functions."""
    import pstats

    stats = pstats.Stats(str(path))
    by_package: dict[str, float] = {}
    for (filename, _line, function), (_cc, _nc, own, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        by_package[_package(filename, function)] = by_package.get(_package(filename, function), 0.0) + own
    total = sum(by_package.values())
    print(f"\n  cProfile of ember serve, whole process life (start-up included), own time by package ({path}):")
    for name, own in sorted(by_package.items(), key=lambda item: -item[1])[:16]:
        print(f"  {own:8.2f} s {own / total:6.1%}  {name}")
    print("\n  top functions by own time:")
    stats.sort_stats("tottime").print_stats(20)


def _package(filename: str, function: str) -> str:
    if filename == "~":
        return "waiting in epoll (idle)" if "epoll" in function else f"builtins ({function})"[:60]
    parts = Path(filename).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    if "ember" in parts:
        return "/".join(parts[parts.index("ember"):parts.index("ember") + 2]).removesuffix(".py")
    return "stdlib " + Path(filename).stem if "lib" in parts else filename


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", help="concurrent clients, each N in turn (default 100 500)")
    parser.add_argument("--duration", type=float, help="seconds per run (default 8, quick 3)")
    parser.add_argument("--runs", type=int, help="runs: measured windows, back to back (default 3, quick 2)")
    parser.add_argument("--warmup", type=float,
                        help="least warm-up, seconds; it lasts until every client has finished a turn (default 2)")
    parser.add_argument("--max-warmup", type=float, help="most warm-up, seconds (default 45, quick 12)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs, shorter warm-up (< 1.5 min)")
    parser.add_argument("--synchronous", choices=("FULL", "NORMAL"), default="FULL",
                        help="Ember's EMBER_SQLITE_SYNCHRONOUS (default FULL, Ember's own default)")
    parser.add_argument("--http", choices=("raw", "httpx"), default="raw",
                        help="the load generator's HTTP client: a minimal HTTP/1.1 one (default, least CPU)"
                             " or httpx, one AsyncClient per simulated client")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="run ember serve under cProfile, write its stats to FILE and print the top functions"
                             " (slows Ember: its figures are then not comparable)")
    parser.add_argument("--dir", type=Path, help="where to create the temporary home (default: system temp)")
    parser.add_argument("--role", choices=("model", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.clients = args.clients or [100, 500]
    args.duration = args.duration or (3.0 if args.quick else 8.0)
    args.runs = args.runs or (2 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else 2.0
    args.max_warmup = args.max_warmup or (12.0 if args.quick else 45.0)
    return args


def main() -> int:
    args = parse_args()
    if args.role == "model":
        model_server(args.out)
        return 0
    if args.role == "load":
        load_generator(json.loads(args.spec), args.out)
        return 0
    # Ctrl-C and SIGTERM unwind, so the children are stopped below (also when started with SIGINT ignored).
    unwind_on_signals()
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="ember-gateway-bench-", dir=args.dir) as tmp:
        directory = Path(tmp)
        header(args, directory)
        started = time.perf_counter()
        try:
            model, model_base = start_model(directory)
            children.append(model)
            ember, ember_base = start_ember(directory, model_base, args.synchronous, ember_command(args.profile))
            children.append(ember)
            print(f"  pids    : model server {model.pid}, ember serve {ember.pid}", flush=True)
            results: dict[tuple[int, str], Load] = {}
            for n in args.clients:
                for mode, url in (("direct", f"{model_base}/v1/chat/completions"),
                                  ("ember", f"{ember_base}/v1/chat/completions")):
                    load = measure(directory, f"n{n}-{mode}", mode, n, url, model_base, args, ember.pid, model.pid)
                    results[(n, mode)] = load
                    runs = ", ".join(f"{w.turns_per_s:.0f}" for w in load.windows)
                    print(f"  {n:>4} clients {mode:>6}: turns/s by run {runs}; warm-up {load.warmup_s:.1f} s,"
                          f" drain {load.drain_s:.1f} s, errors {len(load.errors)}", flush=True)
                    ember.check()
            report(results, args)
            ember_log_problems(directory)
        except KeyboardInterrupt:
            print("\n  interrupted", file=sys.stderr)
            return 130
        finally:
            for child in reversed(children):
                child.stop()
        if args.profile is not None and args.profile.exists():
            print_profile(args.profile)
        print(f"\n  total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
