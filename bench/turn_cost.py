"""What one turn costs through `ember serve`, against a zero-latency model, per embedding configuration.

    .venv/bin/python bench/turn_cost.py [--runs 3] [--turns 60] [--quick] [--rival] [--big]
    .venv/bin/python bench/turn_cost.py --configs default none --runs 1

A model server of its own (tests/modelserver.py in a process of its own, 127.0.0.1) answers
at once: `POST /v1/chat/completions` (streamed or not) with a short answer that
names the question ("noted: <its first words>"; a consolidation request gets the
JSON summary it asks for), and `POST /v1/embeddings` in OpenAI's shape with
deterministic vectors (words hashed into 384 dimensions, normalised; base64 when
asked, as the openai client does by default). It counts the calls, so each phase
also reports the model calls and the texts embedded per turn (background included).

For each configuration a real `ember serve` child starts in a throwaway
EMBER_HOME, pointed at the mock (EMBER_MODEL_BASE_URL, EMBER_MODEL,
EMBER_MODEL_API_KEY; open gateway on loopback; rate limits raised, everything
else the default install):

- `default`:  embedding_model e5-small (the local model);
- `provider`: EMBER_EMBEDDING_MODEL=openai:mock-embed, EMBER_EMBEDDING_BASE_URL=<mock>/v1,
              EMBER_EMBEDDING_API_KEY=bench (if the child refuses to start, the line says so);
- `none`:     EMBER_EMBEDDING_MODEL=none.

After a warm-up (one whole session of 20 turns, then the background queue
drained), each of
`--runs` runs measures:

a. sequential request/response turns (`stream: false`) from one keep-alive
   client, a new `X-Ember-Session` every 20 turns: the per-turn latency, median
   and p90 over the run's turns;
b. the server's CPU per turn, background work included: utime + stime of the
   child and of every process under it (and their exited children's), from
   /proc, before the turns and after the queue has drained (that CPU quiet for
   1 s and, for Ember, /metrics showing no pending or running job), divided by
   the turns;
c. 20 sessions x 10 turns at once (20 clients, each its own session, each turn
   after the last): turns/s from the first request to the last answer, and the
   CPU per turn of that phase, drained likewise.

Figures are the medians of the per-run figures. Then (d) the share of each
part of a turn as the trace records it: `ember trace list --json` and `ember
trace show ID --json` in the same home, over a sample of the last run's
sequential turns: every named duration the trace holds (stages, their
sub-steps if any, model calls), median and share of the trace's own turn time.
What the trace does not record is not guessed.

`--rival` installs echo-agent 0.3.7 from PyPI into a venv of its own
(~/.cache/ember-bench/echo-agent-venv, reused when present), starts
`echo-agent gateway` on 127.0.0.1 against the same mock (an OpenAI-compatible
provider; its memory embeds through the mock's /v1/embeddings, as its default
`embedding_backend: auto` picks when the provider answers the probe; rate
limits raised; its local reranker off, see `rival_config`), and measures (a)(b)(c) the same way through its HTTP API
(`POST /api/v1/message` with `wait: true` and a `cli:` session key: it has no
OpenAI-compatible route). The end prints Ember / echo-agent for each
configuration next to the issue's targets, PASS/MISS.

`--big` (default configuration): the plain-turn latency of another session
(median of 10 turns, 0.4 s apart, in a session of the same length) just before,
and while a ~1,000,000-character message (just under the gateway's 1 MiB body
limit) is being answered and remembered; then Stop on the big turn (`POST
/api/sessions/{key}/stop`) and how long until the server's CPU is back to idle
(and Ember's job queue empty). So that there is a turn to stop, the mock takes
`--big-model-s` (30 s) to answer a prompt of more than 100,000 characters, as a
real model reading ~250,000 tokens would take a while.

Every child binds 127.0.0.1 and is stopped by its pid at the end, also on
Ctrl-C or an error. The header prints the machine, the versions, the load
average and the exact command; the end prints the load average again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    asks_for_summary,
    busy_warning,
    checkout_on_path,
    ms,
    outstanding_jobs,
    print_header,
    quantile,
    rerun_command,
    text_of,
    unwind_on_signals,
    verdict,
    without_user_config,
)
from gateway_load import Child, RawHttp, free_port, http_ok, wait_for

MODEL_NAME = "bench-model"
EMBED_MODEL = "mock-embed"
SESSION_TURNS = 20  # a new session every this many sequential turns
CONCURRENT_SESSIONS, CONCURRENT_TURNS = 20, 10
TURN_TIMEOUT_S = 120.0
BIG_CHARS = 1_000_000  # the JSON body stays under the gateway's 1,048,576-byte limit
BIG_PROMPT_CHARS = 100_000  # the mock takes --big-model-s to answer a prompt longer than this
BIG_PACE_S = 0.4  # between another session's timed turns: 10 of them span about 4 s of the big turn
IDLE_CORES = 0.05  # "quiet": the child used at most this share of a core over the last second
QUIET_S = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
RIVAL_PACKAGE, RIVAL_VERSION = "echo-agent", "0.3.7"
# Its OpenAI-compatible provider needs the `openai` extra; its gateway imports `cryptography` (a weixin
# extra) unconditionally, so without it `echo-agent gateway` does not start.
RIVAL_REQUIREMENTS = (f"{RIVAL_PACKAGE}[openai]=={RIVAL_VERSION}", "cryptography")
RIVAL_VENV = Path("~/.cache/ember-bench/echo-agent-venv").expanduser()
CONFIGS = ("default", "provider", "none")
TOPICS = ("the release notes", "Friday's demo", "the flaky login test", "the invoice for March", "the new office",
          "Maria's birthday", "the database migration", "our hiking trip", "the budget review", "the printer")
ASKS = ("What did we decide about {t}?", "Can you remind me what is left to do for {t}?",
        "Please note that {t} moves to next week.", "Who was in charge of {t} again?",
        "Summarise where we stand on {t}, in one line.")
# The targets: Ember against echo-agent measured in the same run.
TARGETS = {
    "default": {"faster": 4.0, "throughput": 5.0, "cpu": 1.5, "p90": 2.0},
    "none": {"faster": 15.0, "throughput": 20.0},
}


# Every message of a bench run is new, and so is its answer: a tag unique in the run, after a nonce
# unique to the run, so that no cache by content (this run's or one kept from another) sees a repeat.
NONCE = secrets.token_hex(3)
_asked = itertools.count()


def question(n: int) -> str:
    """A short message like a person's, about the n-th topic, tagged so that it is never a repeat."""
    ask = ASKS[n % len(ASKS)].format(t=TOPICS[(n // len(ASKS)) % len(TOPICS)])
    return f"{ask} (note {NONCE}-{next(_asked)})"


def expected_answer(text: str) -> str:
    """The mock's answer: the message itself if short, else its first 12 words."""
    words = text.split()
    return "noted: " + " ".join(words if len(words) <= 40 else words[:12])


# --- the model server (its own process) -------------------------------------------------------


def answer_to(messages: list[dict[str, Any]]) -> str:
    """The mock's answer: the JSON summary a consolidation request asks for, else `expected_answer`."""
    if asks_for_summary(messages):
        return json.dumps({"summary": "The user asked a few short questions about their plans.", "facts": []})
    users = [text_of(m.get("content")) for m in messages if m.get("role") == "user"]
    # The new message is the last paragraph of the last user message: echo-agent puts a runtime
    # context block and recalled memories before it.
    return expected_answer(users[-1].strip().split("\n\n")[-1]) if users else "noted."


def model_server(port_file: Path, big_delay_s: float) -> None:
    """tests/modelserver.py answering with `answer_to` at once (one content chunk, as a fast model sends
    a short answer), embedding by hashed words; `POST /bench/stats` hands over its counts since the
    last call and `POST /bench/big-delay` sets how long a prompt over BIG_PROMPT_CHARS takes."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from tests.modelserver import Embedder, ModelServer, Reply, serve_forever

    server = ModelServer(MODEL_NAME, embedder=Embedder(EMBED_MODEL), record=False)
    server.explainer = server.titler = None  # titles and explanations are answered like any request
    delay = {"big": big_delay_s}

    def respond(body: dict[str, Any]) -> Reply:
        messages = body.get("messages") or []
        users = [text_of(m.get("content")) for m in messages if m.get("role") == "user"]
        # A real model takes a while to read ~250,000 tokens.
        slow = bool(users) and len(users[-1]) > BIG_PROMPT_CHARS
        text = answer_to(messages)
        return Reply(text=text, pieces=(text,), delay_s=delay["big"] if slow else 0.0)

    async def set_delay(request: Request) -> Response:
        delay["big"] = float((await request.json())["seconds"])
        return JSONResponse(delay)

    async def take_stats(request: Request) -> Response:
        out = {key: server.counts[key] for key in ("chat", "embedding_requests", "embedded_texts", "embedded_chars")}
        server.counts.clear()
        return JSONResponse(out)

    server.responder = respond
    serve_forever(Starlette(routes=[Route("/bench/stats", take_stats, methods=["POST"]),
                                    Route("/bench/big-delay", set_delay, methods=["POST"]),
                                    *server.app.routes]), port_file)


def set_big_delay(model_base: str, seconds: float) -> None:
    request = urllib.request.Request(f"{model_base}/bench/big-delay", method="POST",
                                     data=json.dumps({"seconds": seconds}).encode())
    urllib.request.urlopen(request, timeout=30).close()


def take_stats(model_base: str) -> dict[str, int]:
    request = urllib.request.Request(f"{model_base}/bench/stats", method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


# --- the servers under test ---------------------------------------------------------------------


def process_cpu(pid: int) -> float:
    """The CPU seconds of `pid` and of every live process under it (each one's utime + stime, all
    threads), plus what their exited children used (cutime + cstime): embedding work moved into a
    helper process counts too."""
    parents: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            stats[int(entry)] = fields
            parents.setdefault(int(fields[1]), []).append(int(entry))
    if pid not in stats:
        raise ProcessLookupError(pid)
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            total += sum(int(stats[current][i]) for i in (11, 12, 13, 14))
            todo += parents.get(current, [])
    return total / CLK_TCK


@dataclass
class Server:
    """A server under test: Ember (OpenAI-compatible route) or echo-agent (its /api/v1/message)."""

    name: str
    kind: str  # "ember" | "echo"
    base: str
    child: Child
    env: dict[str, str] = field(default_factory=dict)
    log: Path | None = None  # Ember's ember.log: its warnings are counted per phase
    model_base: str = ""

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log is not None and self.log.exists() else 0

    def warnings_since(self, offset: int) -> int:
        if self.log is None or not self.log.exists():
            return 0
        with self.log.open("rb") as f:
            f.seek(offset)
            return sum(1 for line in f if b" WARNING " in line or b" ERROR " in line or b" CRITICAL " in line)

    @property
    def pid(self) -> int:
        return self.child.pid

    def request(self, session: str, text: str) -> tuple[str, bytes, dict[str, str]]:
        if self.kind == "ember":
            body = {"model": "ember", "stream": False, "messages": [{"role": "user", "content": text}]}
            return "/v1/chat/completions", json.dumps(body).encode(), {"X-Ember-Session": session}
        body = {"text": text, "session_key": f"cli:{session}", "user_id": "bench", "chat_id": session,
                "platform": "api", "wait": True, "timeout_seconds": int(TURN_TIMEOUT_S)}
        return "/api/v1/message", json.dumps(body).encode(), {}

    def answer(self, raw: bytes) -> str:
        data = json.loads(raw)
        if self.kind == "ember":
            return str(data["choices"][0]["message"]["content"])
        return str((data.get("reply") or {}).get("text") or "")

    def jobs_outstanding(self) -> int | None:
        """Ember's pending + running background jobs (from /metrics); None for a server without them."""
        if self.kind != "ember":
            return None
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as response:
            return outstanding_jobs(response.read().decode())


def ember_env(home: Path, model_base: str, config: str) -> dict[str, str]:
    env = dict(without_user_config(dict(os.environ), home))
    env.update(EMBER_MODEL_BASE_URL=f"{model_base}/v1", EMBER_MODEL=MODEL_NAME, EMBER_MODEL_API_KEY="bench",
               EMBER_GATEWAY_RATE_PER_MINUTE="1000000", EMBER_GATEWAY_RATE_BURST="100000",
               EMBER_GATEWAY_SHUTDOWN_GRACE_S="3")
    if config == "none":
        env["EMBER_EMBEDDING_MODEL"] = "none"
    elif config == "provider":
        env.update(EMBER_EMBEDDING_MODEL=f"openai:{EMBED_MODEL}", EMBER_EMBEDDING_BASE_URL=f"{model_base}/v1",
                   EMBER_EMBEDDING_API_KEY="bench")
    return env


def start_ember(directory: Path, model_base: str, config: str, children: list[Child]) -> Server:
    home = directory / f"home-{config}"
    home.mkdir()
    env = ember_env(home, model_base, config)
    port = free_port()
    ember = ROOT / ".venv" / "bin" / "ember"
    child = Child(f"ember serve ({config})", [str(ember) if ember.exists() else "ember", "serve", "--port", str(port)],
                  env, directory / f"ember-{config}.log")
    children.append(child)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_ok(f"{base}/healthz"), f"ember serve ({config})", child, timeout_s=120)
    return Server(config, "ember", base, child, env, home / "ember.log", model_base)


def start_model(directory: Path, big_delay_s: float, children: list[Child]) -> tuple[Child, str]:
    port_file = directory / "model.port"
    child = Child("model server", [sys.executable, __file__, "--role", "model", "--out", str(port_file),
                                   "--big-model-s", str(big_delay_s)], checkout_on_path(dict(os.environ)),
                  directory / "model.log")
    children.append(child)
    wait_for(lambda: port_file.exists() and port_file.read_text().isdigit(), "the model server", child)
    base = f"http://127.0.0.1:{port_file.read_text()}"
    wait_for(lambda: take_stats(base) is not None, "the model server", child)
    return child, base


def log_problems(home: Path) -> list[str]:
    """The warnings and errors in an Ember home's log: how many, and the first few (counted by kind)."""
    log = home / "ember.log"
    if not log.exists():
        return []
    bad = [line for line in log.read_text(errors="replace").splitlines()
           if " WARNING " in line or " ERROR " in line or " CRITICAL " in line]
    kinds: dict[str, int] = {}
    for line in bad:
        key = re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "#", line.split(" ", 2)[-1])[:160]
        kinds[key] = kinds.get(key, 0) + 1
    if not bad:
        return []
    return [f"ember.log: {len(bad)} warnings or errors"] + [f"  {n} x {k}" for k, n in list(kinds.items())[:4]]


def first_error_line(log: Path) -> str:
    """The line of a failed start-up's log that says what went wrong."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"(Error|error|invalid|Invalid|unknown|not supported)", line) and not line.startswith("File "):
            return line[:200]
    return lines[-1][:200] if lines else "no output"


# --- echo-agent, the rival ------------------------------------------------------------------


def rival_venv(venv: Path) -> tuple[Path | None, str]:
    """echo-agent's command in `venv` (installed there from PyPI if it is not yet), and what happened."""
    command, pip = venv / "bin" / "echo-agent", venv / "bin" / "pip"
    if command.exists():
        shown = subprocess.run([str(pip), "show", RIVAL_PACKAGE], capture_output=True, text=True, timeout=120)
        ready = subprocess.run([str(venv / "bin" / "python"), "-c", "import openai, cryptography"],
                               capture_output=True, timeout=120).returncode == 0
        if f"Version: {RIVAL_VERSION}" in shown.stdout and ready:
            return command, f"{RIVAL_PACKAGE} {RIVAL_VERSION} in {venv} (reused)"
    started = time.monotonic()
    try:
        if not pip.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
        done = subprocess.run([str(pip), "install", "--quiet", *RIVAL_REQUIREMENTS],
                              capture_output=True, text=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"could not create the venv {venv}: {exc}"
    if done.returncode != 0 or not command.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"pip install {' '.join(RIVAL_REQUIREMENTS)} failed: {tail[0][:200]}"
    return command, f"{RIVAL_PACKAGE} {RIVAL_VERSION} installed into {venv} in {time.monotonic() - started:.0f} s"


def rival_config(workspace: Path, model_base: str, port: int) -> str:
    """echo-agent's YAML: the mock as its OpenAI-compatible provider (chat and embeddings), an open
    gateway on loopback, the per-session and per-platform rate limits out of the way, and its local
    reranker off: it downloads BAAI/bge-reranker-base from HuggingFace on first use, and where that
    cannot be reached (offline) the turns with memories to rank wait out its 5 s timeout. Off, it does
    less work than with the model at hand: the ratios against it are conservative for Ember."""
    config = {
        "workspace": str(workspace),
        "models": {"defaultModel": MODEL_NAME, "providers": [
            {"name": "openai", "apiKey": "bench", "apiBase": f"{model_base}/v1", "models": [MODEL_NAME]}]},
        "memory": {"embeddingModel": EMBED_MODEL, "rerankEnabled": False},
        "gateway": {"enabled": True, "host": "127.0.0.1", "port": port, "auth": {"mode": "open"},
                    "platforms": {"api": {"rateLimitRpm": 10_000_000}}},
        "rateLimit": {"sessionRpm": 10_000_000, "sessionBurst": 1_000_000},
    }
    return json.dumps(config, indent=2)  # JSON is YAML


def start_rival(command: Path, directory: Path, model_base: str, children: list[Child]) -> Server:
    home, workspace = directory / "echo-home", directory / "echo-workspace"
    home.mkdir()
    workspace.mkdir()
    port = free_port()
    config = directory / "echo-agent.yaml"
    config.write_text(rival_config(workspace, model_base, port))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ECHO_AGENT_", "OPENAI_", "EMBER_"))}
    env.update(HOME=str(home), NO_COLOR="1")  # its ~/.echo-agent is a throwaway one
    child = Child("echo-agent gateway", [str(command), "gateway", "-c", str(config), "-w", str(workspace),
                                         "--host", "127.0.0.1", "--port", str(port)], env,
                  directory / "echo-agent.log")
    children.append(child)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_ok(f"{base}/api/v1/health"), "echo-agent gateway", child, timeout_s=180)
    return Server("echo-agent", "echo", base, child, env)


# --- measuring ------------------------------------------------------------------------------------


class TurnFailed(Exception):
    pass


async def one_turn(http: RawHttp, server: Server, session: str, text: str) -> tuple[float, bool]:
    """One request/response turn: its seconds, and whether the answer names the question."""
    path, body, headers = server.request(session, text)
    parts: list[bytes] = []
    started = time.monotonic()
    try:
        async with asyncio.timeout(TURN_TIMEOUT_S):
            status = await http.post(body, headers, parts.append, path=path)
    except TimeoutError as exc:
        http.close()
        raise TurnFailed(f"no answer within {TURN_TIMEOUT_S:.0f} s") from exc
    took = time.monotonic() - started
    raw = b"".join(parts)
    if status != 200:
        raise TurnFailed(f"HTTP {status}: {raw[:200]!r}")
    return took, expected_answer(text) in server.answer(raw)


@dataclass
class Phase:
    turns: int = 0
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    drain_s: float = 0.0
    drained: bool = True
    errors: list[str] = field(default_factory=list)
    unnamed: int = 0  # answers that do not name their question
    warnings: int = 0  # lines of ember.log at WARNING or above during the phase and its drain
    model: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_per_turn(self) -> float:
        return self.cpu_s / self.turns if self.turns else float("nan")

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.wall_s if self.wall_s else float("nan")


async def wait_idle(server: Server, timeout_s: float) -> tuple[float, bool]:
    """Waits until the server's CPU has been quiet for QUIET_S (and Ember's job queue is empty): the
    seconds until the quiet second began, and whether it came within `timeout_s`."""
    started = time.monotonic()
    samples: deque[tuple[float, float]] = deque()
    while True:
        now = time.monotonic()
        server.child.check()
        samples.append((now, process_cpu(server.pid)))
        while len(samples) > 1 and samples[1][0] <= now - QUIET_S:
            samples.popleft()
        span = now - samples[0][0]
        if span >= QUIET_S * 0.95 and samples[-1][1] - samples[0][1] <= IDLE_CORES * span:
            jobs = await asyncio.to_thread(server.jobs_outstanding)
            if not jobs:
                return max(0.0, samples[0][0] - started), True
        if now - started > timeout_s:
            return now - started, False
        await asyncio.sleep(0.1)


async def measured(server: Server, model_base: str, drain_timeout_s: float, work: Any) -> Phase:
    """Runs `work(phase)` between two idle points; the CPU, the drain and the model calls in between."""
    await wait_idle(server, drain_timeout_s)
    take_stats(model_base)
    phase = Phase()
    offset = server.log_size()
    cpu = process_cpu(server.pid)
    started = time.monotonic()
    await work(phase)
    phase.wall_s = time.monotonic() - started
    phase.drain_s, phase.drained = await wait_idle(server, drain_timeout_s)
    phase.cpu_s = process_cpu(server.pid) - cpu  # the quiet second that ended the drain included
    phase.model = take_stats(model_base)
    phase.warnings = server.warnings_since(offset)
    return phase


async def _client(server: Server, phase: Phase, turns: list[tuple[str, str, str]]) -> None:
    """Each (who, session, message) of `turns` in order, on one keep-alive connection; a failed
    turn is noted under `who` and the connection opened again."""
    http = RawHttp(server.base)
    try:
        for who, session, message in turns:
            try:
                took, named = await one_turn(http, server, session, message)
            except (TurnFailed, OSError, ValueError, KeyError) as exc:
                phase.errors.append(f"{who}: {type(exc).__name__}: {exc}"[:240])
                http.close()
                await asyncio.sleep(0.05)
                continue
            phase.turns += 1
            phase.latencies.append(took)
            phase.unnamed += not named
    finally:
        http.close()


async def sequential(server: Server, label: str, turns: int, phase: Phase) -> None:
    await _client(server, phase, [(f"turn {n}", f"{label}-s{n // SESSION_TURNS}", question(n)) for n in range(turns)])


async def concurrent(server: Server, label: str, sessions: int, turns: int, phase: Phase) -> None:
    await asyncio.gather(*(_client(server, phase, [(f"client {k} turn {n}", f"{label}-c{k}", question(k * turns + n))
                                                   for n in range(turns)]) for k in range(sessions)))


@dataclass
class Result:
    """One server's figures over the runs: medians of the per-run figures."""

    name: str
    seq: list[Phase] = field(default_factory=list)
    conc: list[Phase] = field(default_factory=list)
    startup_s: float = 0.0
    idle_cores: float = 0.0
    traces: dict[str, list[float]] = field(default_factory=dict)
    trace_note: str = ""
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def _median(values: Iterable[float]) -> float:
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else float("nan")

    @property
    def p50(self) -> float:
        return self._median(statistics.median(p.latencies) for p in self.seq if p.latencies)

    @property
    def p90(self) -> float:
        return self._median(quantile(p.latencies, 0.9) for p in self.seq if p.latencies)

    @property
    def cpu(self) -> float:
        return self._median(p.cpu_per_turn for p in self.seq)

    @property
    def conc_cpu(self) -> float:
        return self._median(p.cpu_per_turn for p in self.conc)

    @property
    def throughput(self) -> float:
        return self._median(p.turns_per_s for p in self.conc)

    @property
    def conc_p50(self) -> float:
        return self._median(statistics.median(p.latencies) for p in self.conc if p.latencies)

    def per_turn(self, key: str) -> float:
        phases = self.seq + self.conc
        turns = sum(p.turns for p in phases)
        return sum(p.model.get(key, 0) for p in phases) / turns if turns else float("nan")

    @property
    def problems(self) -> list[str]:
        out = [e for p in self.seq + self.conc for e in p.errors]
        unnamed = sum(p.unnamed for p in self.seq + self.conc)
        if unnamed:
            out.append(f"{unnamed} answers did not name their question")
        undrained = sum(not p.drained for p in self.seq + self.conc)
        if undrained:
            out.append(f"{undrained} phases did not drain within the timeout (their CPU is a lower bound)")
        return out


async def measure_server(server: Server, model_base: str, args: argparse.Namespace, result: Result) -> None:
    warm = Phase()
    await sequential(server, f"{server.name}-warm", args.warmup, warm)
    if warm.errors:
        raise TurnFailed(f"the warm-up failed: {warm.errors[0]}")
    await wait_idle(server, args.drain_timeout)
    before, t0 = process_cpu(server.pid), time.monotonic()
    await asyncio.sleep(2.0)
    result.idle_cores = (process_cpu(server.pid) - before) / (time.monotonic() - t0)
    for run in range(args.runs):
        label = f"{server.name}-r{run}"
        seq = await measured(server, model_base, args.drain_timeout,
                             lambda phase, label=label: sequential(server, f"{label}-seq", args.turns, phase))
        result.seq.append(seq)
        conc = await measured(server, model_base, args.drain_timeout,
                              lambda phase, label=label: concurrent(server, f"{label}-conc", args.sessions,
                                                                    args.session_turns, phase))
        result.conc.append(conc)
        median = statistics.median(seq.latencies) if seq.latencies else math.nan
        print(f"    run {run + 1}: sequential {len(seq.latencies)} turns, median {ms(median, 0)} ms,"
              f" CPU {ms(seq.cpu_per_turn, 0)} ms/turn (drained in {seq.drain_s:.1f} s);"
              f" {args.sessions} x {args.session_turns} concurrent: {conc.turns_per_s:.1f} turns/s,"
              f" CPU {ms(conc.cpu_per_turn, 0)} ms/turn (drained in {conc.drain_s:.1f} s)"
              + (f"; {len(seq.errors) + len(conc.errors)} errors" if seq.errors or conc.errors else "")
              + (f"; log warnings {seq.warnings} + {conc.warnings}" if seq.warnings or conc.warnings else ""),
              flush=True)


# --- traces (d) -------------------------------------------------------------------------------


def ember_cli(server: Server, *argv: str) -> Any:
    ember = ROOT / ".venv" / "bin" / "ember"
    done = subprocess.run([str(ember) if ember.exists() else "ember", *argv], env=server.env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"ember {' '.join(argv)}: {(done.stderr or done.stdout).strip()[:200]}")
    return json.loads(done.stdout)


def trace_parts(trace: dict[str, Any]) -> dict[str, float]:
    """Every named duration in one trace (ms): stages and what they hold, model calls, tool calls,
    any `*_ms` figure; and the trace's own turn time."""
    parts: dict[str, float] = {}
    if trace.get("finished_at") and trace.get("started_at"):
        parts["turn (trace start to finish)"] = (trace["finished_at"] - trace["started_at"]) * 1000

    def add(name: str, value: float) -> None:
        parts[name] = parts.get(name, 0.0) + float(value)

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            label = next((str(value[k]) for k in ("stage", "step", "name", "part", "kind", "model") if k in value), "")
            here = f"{path} {label}".strip() if label else path
            for key, item in value.items():
                if key == "duration_ms" and isinstance(item, (int, float)):
                    add(here, item)
                elif key.endswith("_ms") and isinstance(item, (int, float)) and key != "at_ms":
                    add(f"{here} {key.removesuffix('_ms')}".strip(), item)
                elif isinstance(item, (dict, list)):
                    walk(item, f"{here} >" if label else f"{here} {key}".strip())
        elif isinstance(value, list):
            for item in value:
                walk(item, path)

    for key, value in trace.items():
        if key in ("model_calls", "tool_calls"):
            for call in value or []:
                if isinstance(call, dict) and isinstance(call.get("duration_ms"), (int, float)):
                    add(f"{key.removesuffix('s').replace('_', ' ')}s (all)", call["duration_ms"])
        elif isinstance(value, (dict, list)) and key not in ("approvals", "progress"):
            walk(value, "" if key == "stages" else key)
    return parts


def collect_traces(server: Server, result: Result, label: str, sample: int) -> None:
    try:
        listed = ember_cli(server, "trace", "list", "--json", "--limit", "500")
        ids = [t["turn_id"] for t in listed if label in t["session"] and t["status"] in ("done", "ok", "completed",
                                                                                        "answered")]
        if not ids:
            statuses = sorted({t["status"] for t in listed})
            ids = [t["turn_id"] for t in listed if label in t["session"]]
            result.trace_note = f"statuses seen: {', '.join(statuses)}"
        step = max(1, len(ids) // sample)
        chosen = ids[::step][:sample]
        for turn_id in chosen:
            for name, value in trace_parts(ember_cli(server, "trace", "show", turn_id, "--json")).items():
                result.traces.setdefault(name, []).append(value)
        result.trace_note = (f"{len(chosen)} of the {len(ids)} traced turns of run {len(result.seq)}'s sequential turns"
                             + (f"; {result.trace_note}" if result.trace_note else ""))
    except (RuntimeError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        result.trace_note = f"traces not available: {exc}"


# --- --big ------------------------------------------------------------------------------------------


def big_message() -> str:
    words = [f"{a}{b}" for a in ("sol", "kar", "ven", "tam", "lor", "pik", "dus", "mer") for b in
             ("a", "eth", "ion", "um", "ric", "os", "ant", "ide", "el", "ur")]
    out, n, size = [], 0, 0
    while size < BIG_CHARS:
        word = words[(n * 7 + n // 13) % len(words)]
        out.append(word)
        size += len(word) + 1
        n += 1
    return ("Please read all of this and remember it: " + " ".join(out))[:BIG_CHARS]


async def paced_turns(http: RawHttp, server: Server, session: str, problems: list[str]) -> list[float]:
    """10 plain turns of `session`, BIG_PACE_S apart: their seconds."""
    out = []
    for n in range(1, 11):
        try:
            out.append((await one_turn(http, server, session, question(n)))[0])
        except TurnFailed as exc:
            problems.append(f"  another session's turn failed: {exc}")
        await asyncio.sleep(BIG_PACE_S)
    return out


async def big_case(server: Server, args: argparse.Namespace, http: RawHttp, normal: float, slow: bool) -> list[str]:
    """One big message: another session's turns while it runs, then Stop, then the wait for idle.
    `slow`: the mock takes --big-model-s to answer it (Stop comes mid-turn); else it answers at once,
    and the big message's remembering is what runs beside the other session's turns."""
    lines: list[str] = []
    sender, during_session = f"big-sender-{int(slow)}", f"big-during-{int(slow)}"
    set_big_delay(server.model_base, args.big_model_s if slow else 0.0)
    await one_turn(http, server, during_session, question(0))  # the same length as the session before
    await wait_idle(server, args.drain_timeout)
    path, body, headers = server.request(sender, big_message())
    big_http, big_parts = RawHttp(server.base), []
    cpu, sent = process_cpu(server.pid), time.monotonic()

    async def big() -> tuple[int, float]:
        status = await big_http.post(body, headers, big_parts.append, path=path)
        return status, time.monotonic() - sent

    big_task = asyncio.create_task(big())
    await asyncio.sleep(0.5)
    during = await paced_turns(http, server, during_session, lines)
    running, d50 = not big_task.done(), statistics.median(during) if during else math.nan
    lines.append(f"    another session's plain turn while it was {'answered' if slow else 'answered and remembered'}:"
                 f" median {ms(d50, 0).strip()} ms over {len(during)} turns in {time.monotonic() - sent:.1f} s"
                 f" (max {ms(max(during, default=math.nan), 0).strip()} ms), {d50 / normal:.2f} x its normal"
                 f" median   target <= 2 x  {verdict(d50 <= 2 * normal)}")
    stop_at, cpu_at_stop = time.monotonic(), process_cpu(server.pid)
    lines.append(f"    server CPU from the big message to Stop: {cpu_at_stop - cpu:.1f} s in {stop_at - sent:.1f} s")
    stop_request = urllib.request.Request(f"{server.base}/api/sessions/{sender}/stop", method="POST", data=b"")
    try:
        with urllib.request.urlopen(stop_request, timeout=30) as response:
            stop_status = f"{response.status} {json.loads(response.read()).get('status', '')}"
    except urllib.error.HTTPError as exc:
        stop_status = f"{exc.code} {exc.read()[:120].decode(errors='replace')}"
    lines.append(f"    Stop {stop_at - sent:.1f} s after the big message (its turn "
                 f"{'still running' if running else 'had ended'}): {stop_status}")
    idle_s, idle = await wait_idle(server, args.big_timeout)
    used = process_cpu(server.pid) - cpu_at_stop
    lines.append(f"    server CPU back to idle {idle_s:.1f} s after Stop ({used:.1f} s of CPU in between)" if idle
                 else f"    server CPU NOT back to idle {idle_s:.0f} s after Stop (gave up; {used:.1f} s of CPU)")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(5.0, args.big_model_s)):
            status, took = await big_task
            answer = b"".join(big_parts)[:110].decode(errors="replace")
            lines.append(f"    the big request: HTTP {status} after {took:.1f} s: {answer}")
    if not big_task.done():
        big_task.cancel()
        lines.append("    the big request had not returned")
    big_http.close()
    return lines


async def big_test(server: Server, args: argparse.Namespace) -> list[str]:
    http = RawHttp(server.base)
    lines: list[str] = [f"  big message: {BIG_CHARS:,} characters, request body"
                        f" {len(server.request('big', big_message())[1]):,} bytes (limit 1,048,576)"]
    try:
        await one_turn(http, server, "big-before", question(0))
        await wait_idle(server, args.drain_timeout)
        normal = statistics.median(await paced_turns(http, server, "big-before", lines))
        lines.append(f"  another session's plain turn before: median {ms(normal, 0).strip()} ms (10 turns)")
        lines.append("  a. the mock answers the big message at once (then it is remembered):")
        lines += await big_case(server, args, http, normal, slow=False)
        lines.append(f"  b. the mock takes {args.big_model_s:g} s to answer it; Stop mid-turn:")
        lines += await big_case(server, args, http, normal, slow=True)
    finally:
        http.close()
    return lines


# --- report ---------------------------------------------------------------------------------------


def fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def report(results: dict[str, Result], unavailable: dict[str, str], rival: Result | None,
           rival_note: str, args: argparse.Namespace) -> None:
    columns = ([rival] if rival else []) + [results[c] for c in CONFIGS if c in results]
    print(f"\n1. Per turn, medians of {args.runs} run(s)  ({args.turns} sequential turns a run, a new session every"
          f" {SESSION_TURNS}; {args.sessions} sessions x {args.session_turns} turns concurrently)")
    names = [("echo-agent 0.3.7" if r is rival else f"ember {r.name}") for r in columns]
    print(f"  {'':44}" + "".join(f"{n:>18}" for n in names))
    rows = [
        ("sequential per turn, median (ms)", lambda r: fmt(r.p50 * 1e3)),
        ("sequential per turn, p90 (ms)", lambda r: fmt(r.p90 * 1e3)),
        ("p90 / median", lambda r: fmt(r.p90 / r.p50, 2)),
        ("server CPU per turn, background incl. (ms)", lambda r: fmt(r.cpu * 1e3)),
        ("  the same under the concurrent load (ms)", lambda r: fmt(r.conc_cpu * 1e3)),
        ("concurrent throughput (turns/s)", lambda r: fmt(r.throughput)),
        ("concurrent per turn, median (ms)", lambda r: fmt(r.conc_p50 * 1e3)),
        ("model calls per turn (bg incl.)", lambda r: fmt(r.per_turn("chat"), 2)),
        ("texts embedded by the mock per turn", lambda r: fmt(r.per_turn("embedded_texts"), 2)),
        ("idle CPU after the warm-up (% of a core)", lambda r: fmt(r.idle_cores * 100)),
        ("start-up until healthy (s)", lambda r: fmt(r.startup_s)),
    ]
    for label, value in rows:
        print(f"  {label:<44}" + "".join(f"{value(r):>18}" for r in columns))
    for name, why in unavailable.items():
        print(f"  {name}: not available ({why})")
    for r in columns:
        for problem in r.notes + r.problems[:5]:
            print(f"  {r.name}: {problem}")
    print("\n2. Where a turn's time goes, from its trace (`ember trace show --json`), median ms and share of the"
          " trace's turn time")
    for r in columns:
        if r is rival:
            continue
        print(f"  ember {r.name}: {r.trace_note}")
        total = statistics.median(r.traces.get("turn (trace start to finish)", [math.nan]))
        for name, values in r.traces.items():
            med = statistics.median(values)
            share = f"{med / total:6.1%}" if total and not math.isnan(total) else ""
            print(f"    {name:<44} {med:9.2f} ms {share}  (in {len(values)} of the sampled turns)")
    print("    (the trace records the stages and model calls; recall, embedding, titles, usage, skills index and"
          "\n     store writes appear only if the trace names them: the background share is in the CPU figures above)")
    print("\n3. Targets (the issue's): Ember / echo-agent, measured in this run")
    for r in [results[c] for c in CONFIGS if c in results]:
        t = TARGETS.get(r.name, {})
        print(f"  {r.name}:")
        if "p90" in t:
            ok = r.p90 <= t["p90"] * r.p50
            print(f"    p90 {r.p90 / r.p50:6.2f} x its median{'':29}target <= {t['p90']:g} x  {verdict(ok)}")
        if rival is None:
            print(f"    echo-agent not measured: {rival_note}")
            continue
        ratios = [("per turn, x faster", rival.p50 / r.p50, "faster", f"{ms(r.p50, 0)} vs {ms(rival.p50, 0)} ms"),
                  ("throughput, x", r.throughput / rival.throughput, "throughput",
                   f"{r.throughput:.1f} vs {rival.throughput:.1f} turns/s"),
                  ("CPU per turn, echo-agent's / Ember's", rival.cpu / r.cpu, "cpu",
                   f"{ms(r.cpu, 0)} vs {ms(rival.cpu, 0)} ms")]
        for label, value, key, detail in ratios:
            goal = f"target >= {t[key]:g} x  {verdict(value >= t[key])}" if key in t else "(no target)"
            print(f"    {label:<37}{value:6.2f}  ({detail:<24}) {goal}")


def header(args: argparse.Namespace, directory: Path) -> None:
    import starlette
    import uvicorn

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "ember"],
                           capture_output=True, text=True).stdout.strip()
    print_header("Ember turn cost benchmark", f"uvicorn {uvicorn.__version__}, starlette {starlette.__version__}", [
        ("ember", f"checkout {commit}" + (" + uncommitted changes under ember/" if dirty else "")
         + f"; `ember serve` children in {directory}"),
        ("model", "own process: answers at once (no delay), chat and /v1/embeddings (hashed 384-d vectors)"
                  + (f"; in --big case b a prompt over {BIG_PROMPT_CHARS:,} characters after {args.big_model_s:g} s"
                     if args.big else "")),
        ("client", "this process: raw HTTP/1.1 keep-alive, request/response (stream false)"),
        *([("rival", "echo-agent gateway, provider = the mock (chat + embeddings), reranker off, rate limits"
                     " raised; HTTP /api/v1/message with wait: true")] if args.rival else []),
        ("configs", ", ".join(args.configs) + ("; --big in default" if args.big else "")
         + ("; --rival echo-agent 0.3.7" if args.rival else "")),
        ("settings", f"{args.runs} run(s); warm-up {args.warmup} turns; {args.turns} sequential turns a run;"
                     f" {args.sessions} x {args.session_turns} concurrent; drain timeout {args.drain_timeout:g} s"),
    ], rerun_command(__file__))


# --- main -------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--turns", type=int, default=60, help="sequential turns a run (default 60)")
    parser.add_argument("--warmup", type=int, default=SESSION_TURNS,
                        help="warm-up turns, in sessions of 20 (default 20: one whole session, its consolidation"
                             " and archive included)")
    parser.add_argument("--sessions", type=int, default=CONCURRENT_SESSIONS)
    parser.add_argument("--session-turns", type=int, default=CONCURRENT_TURNS)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="1 run, 20 sequential turns, 5 traces read")
    parser.add_argument("--rival", action="store_true", help="measure echo-agent 0.3.7 (PyPI) in the same run")
    parser.add_argument("--rival-venv", type=Path, default=RIVAL_VENV)
    parser.add_argument("--big", action="store_true", help="a 1 MiB message in another session, then Stop")
    parser.add_argument("--big-model-s", type=float, default=30.0,
                        help="how long the mock takes to answer a prompt over 100,000 characters")
    parser.add_argument("--big-timeout", type=float, default=240.0, help="how long to wait for idle after Stop")
    parser.add_argument("--drain-timeout", type=float, default=180.0)
    parser.add_argument("--trace-sample", type=int, default=12, help="traces read per configuration")
    parser.add_argument("--dir", type=Path, default=None, help="where the throwaway homes go")
    parser.add_argument("--keep", action="store_true", help="keep the homes and logs (their folder is printed)")
    parser.add_argument("--role", choices=("model",), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.turns, args.trace_sample = 1, 20, 5
        args.big_timeout = min(args.big_timeout, 120.0)
    return args


def stop_since(children: list[Child], count: int) -> None:
    """Stops (by pid) the children started after the first `count`."""
    for child in reversed(children[count:]):
        child.stop()


async def run(args: argparse.Namespace, directory: Path, children: list[Child]) -> None:
    model, model_base = start_model(directory, args.big_model_s, children)
    print(f"  pids    : model server {model.pid}", flush=True)
    results: dict[str, Result] = {}
    unavailable: dict[str, str] = {}
    rival: Result | None = None
    rival_note = "not asked for (--rival)"
    if args.rival:
        command, rival_note = await asyncio.to_thread(rival_venv, args.rival_venv)
        print(f"\n  rival: {rival_note}", flush=True)
        if command is not None:
            started, mine = time.monotonic(), len(children)
            try:
                server = start_rival(command, directory, model_base, children)
                rival = Result("echo-agent", startup_s=time.monotonic() - started)
                print(f"  echo-agent gateway pid {server.pid} at {server.base}", flush=True)
                await measure_server(server, model_base, args, rival)
            except (RuntimeError, TurnFailed, OSError) as exc:
                rival_note = f"echo-agent did not run: {str(exc).splitlines()[0][:240]}"
                print(f"  {rival_note}", flush=True)
                rival = None
            finally:
                stop_since(children, mine)
    for config in args.configs:
        print(f"\n  ember, configuration {config}:", flush=True)
        started, mine = time.monotonic(), len(children)
        try:
            server = start_ember(directory, model_base, config, children)
        except RuntimeError:
            unavailable[config] = first_error_line(directory / f"ember-{config}.log")
            print(f"  {config}: not available ({unavailable[config]})", flush=True)
            stop_since(children, mine)
            continue
        result = Result(config, startup_s=time.monotonic() - started)
        results[config] = result
        try:
            print(f"    ember serve pid {server.pid} at {server.base}, healthy after {result.startup_s:.1f} s",
                  flush=True)
            take_stats(model_base)
            await measure_server(server, model_base, args, result)
            if config == "provider" and not any(p.model.get("embedded_texts") for p in result.seq + result.conc):
                result.notes.append("the mock saw no /v1/embeddings call: the provider setting did not take effect")
                print(f"    NOTE: {result.notes[-1]}", flush=True)
            collect_traces(server, result, f"{config}-r{args.runs - 1}-seq", args.trace_sample)
            result.notes += log_problems(directory / f"home-{config}")
            if args.big and config == "default":
                print("\n  --big, configuration default:", flush=True)
                for line in await big_test(server, args):
                    print(line, flush=True)
        finally:
            stop_since(children, mine)
    report(results, unavailable, rival, rival_note, args)


def main() -> int:
    args = parse_args()
    if args.role == "model":
        model_server(args.out, args.big_model_s)
        return 0
    unwind_on_signals()
    load_before = os.getloadavg()[0]
    children: list[Child] = []
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        directory = Path(tempfile.mkdtemp(prefix="ember-turn-cost-", dir=args.dir) if args.keep else
                         stack.enter_context(tempfile.TemporaryDirectory(prefix="ember-turn-cost-", dir=args.dir)))
        header(args, directory)
        try:
            asyncio.run(run(args, directory, children))
        except KeyboardInterrupt:
            print("\n  interrupted", file=sys.stderr)
            return 130
        finally:
            for child in reversed(children):
                child.stop()
    print(f"\n  total {time.monotonic() - started:.0f} s")
    busy_warning(load_before, "the figures are noisier than usual", own_cores=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
