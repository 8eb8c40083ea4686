"""The crash harness: `ember serve` killed with SIGKILL at chosen moments while
many clients talk to it, restarted at once on the same port, and every
invariant of DESIGN.md §3 checked on the store and on what the clients got.

    report = run_crash(CrashConfig(kills=30, seed=7, workdir=tmp_path))
    print(report.render())
    assert not any(report.violation_counts().values())

Three parties, one of them killed over and over:

- The model server (tests/modelserver.py's, in a thread of this process) answers every model call
  slowly (5-15 chunks, 10-40 ms apart), deterministically per user message:
  each message has a plan (no tools, one tool step with one or two calls, or
  two steps with three calls in all: `list_dir` / `read_file`, read-risk, so
  no approval) and an answer "answer to <message id>: ...". Some replies
  start with a `<think>SECRET ...</think>` block, some tool steps are nothing
  but one. Consolidation and memory-review calls are recognised by their
  system prompt and answered with a summary / facts (with a think block too).
  The plan of a turn is read off the prompt (its last user message and the
  tool steps after it), so a turn resumed after a crash gets the same answer.
- The clients: one task per session, each sending numbered messages one at a
  time with a `message_id` (native `POST /api/sessions/{key}/messages`, or
  `POST /v1/chat/completions` with `Idempotency-Key`, streamed or not). A
  message without a final (the connection died, the server refused, 409, an
  error event) is sent again with the same id until its final arrives. A few
  attempts are abandoned after their first delta and sent again at once (a
  client timing out), and some answered messages are sent once more (a client
  unsure whether its answer arrived). Everything received is recorded.
- The killer: picks a moment - mid-stream of a final answer, just after a tool
  call was served (before its result is committed), just after the last chunk
  of a final (around the commit), during a consolidation call (at its request,
  mid-summary, or just after it, around the boundary's commit), at a random
  time, right after a restart (while cut-off turns are being resumed), during
  a graceful stop (SIGTERM, then SIGKILL) or during the start itself - arms
  the model server to `kill -9` there (or kills on its own clock), then
  restarts `ember serve` at once on the same port (some restarts with
  `EMBER_INTERRUPTED_TURNS=notice`). After each kill it reads the store
  (read-only SQLite) to check the boundaries (I5) and the rows (I3).

At the end the clients finish their last message, the background jobs settle,
the histories are read over HTTP, the server is stopped with SIGTERM, and the
store is read directly. Violations are counted per invariant, each with an
example, and the outcomes (kills by moment, attempts by outcome, resumed
turns, notices, ...) are counted beside them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import random
import re
import signal
import sqlite3
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.memory.review import REVIEW_INSTRUCTION
from ember.runtime.loop import NOT_RESUMED_TEXT
from ember.skills.review import REVIEW_INSTRUCTION as SKILL_REVIEW_INSTRUCTION
from ember.store.sessions import INTERRUPTED_RESULT
from tests.gatewayproc import GatewayProcess, free_port, gateway_env
from tests.modelserver import ModelServer, Reply

INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "liveness")
DESCRIPTIONS = {
    "I1": "no lost turn: accepted messages and shown finals are durable, finals equal the record",
    "I2": "no duplicate: one user row per message id, one final per turn, equal finals and delivery ids",
    "I3": "protocol-valid history: every tool call followed by all its results, no orphan result",
    "I4": "no thinking in the history, the memory, the outbox or anything a client was shown",
    "I5": "last_consolidated monotonic, never inside a tool chain, summaries chained without overlap",
    "I6": "derived work survives restarts: no job left running or pending after the settle, reviews ran",
    "liveness": "every message a client kept sending got its final within the bound",
}
REVIEW_THRESHOLD = 3  # EMBER_REVIEW_TOOL_CALL_THRESHOLD: tool calls in a turn that ask for the reviews
CHANNEL = "http"  # the gateway's channel in the inbox and the outbox
IDENTITY = "local"  # the gateway's identity when no API keys are configured
MODEL = "crash-model"
THINK_MARKERS = ("<think", "</think", "SECRET")
NOTES = "Crash test notes.\nThe build is green.\nNothing here is a secret.\n".replace("secret", "s3cret")
WORDS = ("green", "build", "notes", "ready", "queue", "river", "amber", "stone", "light", "pixel", "orbit",
         "cedar", "delta", "ember", "flint", "grain", "harbor", "iris", "jade", "kettle", "lumen", "maple")
MID_IN_TEXT = re.compile(r"^\[([A-Za-z0-9._:@+-]+)\]")
HTTP_TIMEOUT = httpx.Timeout(30.0, connect=3.0)


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True, slots=True)
class Plan:
    """What the model does for one user message, whatever the history looks like."""

    steps: tuple[tuple[tuple[str, str], ...], ...]  # per tool step: (tool name, arguments as JSON)
    step_thinks: tuple[bool, ...]
    answer: str  # what the user must be shown
    think: bool  # the final reply starts with a think block

    def raw_answer(self, mid: str) -> str:
        return f"<think>SECRET reasoning about {mid}</think>\n\n{self.answer}" if self.think else self.answer


def _call(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        return "read_file", json.dumps({"path": "notes.txt"})
    return "list_dir", json.dumps({"path": "."})


def message_plan(mid: str) -> Plan:
    rng = random.Random(hashlib.sha256(mid.encode()).digest())
    shape = rng.random()
    if shape < 0.45:
        steps: tuple[tuple[tuple[str, str], ...], ...] = ()
    elif shape < 0.75:
        steps = ((_call(rng),),)
    elif shape < 0.9:
        steps = ((_call(rng), _call(rng)),)
    else:  # three calls in all: the turn also asks for the background memory and skill reviews
        steps = ((_call(rng), _call(rng)), (_call(rng),))
    thinks = tuple(rng.random() < 0.3 for _ in steps)
    answer = f"answer to {mid}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18)))
    return Plan(steps=steps, step_thinks=thinks, answer=answer, think=rng.random() < 0.35)


# --------------------------------------------------------------------------- killing


@dataclass(slots=True)
class Trigger:
    """Kill `target` `delay_s` after the model server reaches (kind, point[, index])."""

    mode: str
    kind: str  # final / tool / consolidate
    point: str  # request / chunk / done
    target: GatewayProcess
    index: int = 0
    delay_s: float = 0.0
    skip: int = 0  # matches to let pass before the one that kills
    fired: threading.Event = field(default_factory=threading.Event)

    def matches(self, kind: str, point: str, index: int) -> bool:
        if kind != self.kind or point != self.point or (point == "chunk" and index != self.index):
            return False
        self.skip -= 1
        return self.skip < 0


def sigkill(gateway: GatewayProcess) -> bool:
    """SIGKILL the gateway's own pid, if it still runs."""
    if gateway.process.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        gateway.process.send_signal(signal.SIGKILL)
    return True


class KillSwitch:
    """Armed with one trigger at a time; the model server reports where it is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trigger: Trigger | None = None

    def arm(self, trigger: Trigger) -> None:
        with self._lock:
            self._trigger = trigger

    def disarm(self) -> Trigger | None:
        """The trigger, if it had not fired yet."""
        with self._lock:
            trigger, self._trigger = self._trigger, None
        return trigger

    def reached(self, kind: str, point: str, index: int = 0) -> None:
        with self._lock:
            trigger = self._trigger
            if trigger is None or not trigger.matches(kind, point, index):
                return
            self._trigger = None

        def fire() -> None:
            sigkill(trigger.target)
            trigger.fired.set()

        if trigger.delay_s <= 0:
            fire()
        else:
            asyncio.get_running_loop().call_later(trigger.delay_s, fire)


# --------------------------------------------------------------------------- the model server


@dataclass(frozen=True, slots=True)
class _Reply:
    kind: str  # final / tool / consolidate / review
    content: str
    calls: tuple[tuple[str, str, str], ...] = ()  # (id, name, arguments)


def _cut(text: str, pieces: int, rng: random.Random) -> list[str]:
    """`text` in about `pieces` pieces cut at random places (tags get split, as real streams split them)."""
    if not text:
        return []
    pieces = max(1, min(pieces, len(text)))
    cuts = sorted(rng.sample(range(1, len(text)), pieces - 1)) if pieces > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


class CrashModelServer(ModelServer):
    """tests/modelserver.py's server, answering as the crash runs' model: each request by its
    message's plan (below), the text streamed in 5-15 pieces cut at random places (2-4 for a tool
    step's), 10-40 ms apart, telling `switch` where it is: the request, each piece, the end."""

    def __init__(self, seed: int, switch: KillSwitch, *, delay_s: tuple[float, float] = (0.010, 0.040)) -> None:
        super().__init__(MODEL)
        self.stats: Counter[str] = Counter()
        self._seed = seed
        self.switch = switch
        self._delay_s = delay_s
        self._numbers = itertools.count(1)
        self.responder = self._respond

    def _respond(self, body: dict[str, Any]) -> Reply:
        number = next(self._numbers)
        reply = self._reply(body.get("messages") or [], number)
        self.stats[f"model calls: {reply.kind}"] += 1
        self.switch.reached(reply.kind, "request")
        rng = random.Random(f"{self._seed}/{number}")
        pieces = _cut(reply.content, rng.randint(2, 4) if reply.kind == "tool" else rng.randint(5, 15), rng)
        return Reply(text=reply.content, pieces=tuple(pieces),
                     tool_calls=tuple((name, arguments) for _, name, arguments in reply.calls),
                     call_ids=tuple(call_id for call_id, _, _ in reply.calls),
                     pause=lambda: rng.uniform(*self._delay_s),
                     watch=lambda point, index: self.switch.reached(reply.kind, point, index))

    def _reply(self, messages: list[dict[str, Any]], number: int) -> _Reply:
        system = str(messages[0].get("content") or "") if messages and messages[0].get("role") == "system" else ""
        if system.startswith(SUMMARY_INSTRUCTION):
            mids = sorted(set(re.findall(r"\[([A-Za-z0-9._:@+-]+)\]", str(messages[-1].get("content") or ""))))
            return _Reply("consolidate", f"<think>SECRET summary plan</think>Summary of messages {', '.join(mids)}: "
                                         "the user asked, the notes were read, answers were given.")
        if system.startswith(REVIEW_INSTRUCTION):
            return _Reply("review", "<think>SECRET review</think>\n- The user runs crash tests.\n"
                                    "- The user keeps notes in notes.txt.")
        if system.startswith(SKILL_REVIEW_INSTRUCTION):
            return _Reply("review", "<think>SECRET skill review</think>" + json.dumps({
                "action": "create", "name": "read-the-notes", "description": "Read the notes before answering.",
                "body": "1. Read notes.txt.\n2. Answer from it.", "reason": "every question needed the notes"}))
        return self._turn(messages, number)

    def _turn(self, messages: list[dict[str, Any]], number: int) -> _Reply:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        after = messages[users[-1] + 1:] if users else messages
        found = MID_IN_TEXT.match(str(messages[users[-1]].get("content") or "")) if users else None
        mid = found.group(1) if found else None
        if mid is None:
            # A resumed turn whose question is not in its prompt: the id is in its tool calls' ids.
            self.stats["turn prompts without their user message"] += 1
            ids = [c.get("id", "") for m in after for c in (m.get("tool_calls") or [])]
            mid = ids[-1].split("-", 3)[3] if ids and ids[-1].count("-") >= 3 else None
            if mid is None:
                self.stats["turn prompts with no message id at all"] += 1
                return _Reply("final", "answer to an unknown message")
        plan = message_plan(mid)
        done = sum(1 for m in after if m.get("role") == "assistant" and m.get("tool_calls"))
        if done < len(plan.steps):
            calls = tuple((f"call-{number}-{i}-{mid}", name, args) for i, (name, args) in enumerate(plan.steps[done]))
            think = f"<think>SECRET planning step {done} of {mid}</think>" if plan.step_thinks[done] else ""
            return _Reply("tool", think, calls)
        return _Reply("final", plan.raw_answer(mid))


# --------------------------------------------------------------------------- the gateway


class Supervisor:
    """Starts `ember serve` on one port, again and again; every process is stopped by its pid."""

    def __init__(self, workdir: Path, model: CrashModelServer, port: int, extra_env: dict[str, str]) -> None:
        self.home = workdir / "home"
        self.port = port
        self.model = model
        self.started: list[GatewayProcess] = []
        self.current: GatewayProcess | None = None
        workspace = self.home / "workspace"
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / "notes.txt").write_text(NOTES)
        self._env = gateway_env(self.home, None, None, EMBER_MODEL_BASE_URL=model.base_url, EMBER_MODEL=MODEL,
                                EMBER_MODEL_API_KEY="crash-key", **extra_env)

    @property
    def db_path(self) -> Path:
        return self.home / "ember.db"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, *, notice: bool = False) -> GatewayProcess:
        env = dict(self._env, EMBER_INTERRUPTED_TURNS="notice" if notice else "resume")
        gateway = GatewayProcess(env, self.port)
        self.started.append(gateway)
        self.current = gateway
        return gateway

    async def ready(self, gateway: GatewayProcess) -> None:
        await asyncio.to_thread(gateway.wait_ready)

    def kill_all(self) -> None:
        for gateway in self.started:
            with contextlib.suppress(Exception):
                gateway.kill()

    def log_lines(self) -> list[str]:
        log = self.home / "ember.log"
        return log.read_text(errors="replace").splitlines() if log.exists() else []


@contextlib.asynccontextmanager
async def gateway_with_model(workdir: Path, *, seed: int = 1, delay_s: tuple[float, float] = (0.010, 0.040),
                             **extra_env: str) -> AsyncIterator[Supervisor]:
    """One `ember serve` on the crash model server, for targeted tests; both stopped at the end."""
    model = CrashModelServer(seed, KillSwitch(), delay_s=delay_s)
    model.start()
    supervisor: Supervisor | None = None
    try:
        supervisor = Supervisor(workdir, model, free_port(), extra_env)
        await supervisor.ready(supervisor.spawn())
        yield supervisor
    finally:
        if supervisor is not None:
            supervisor.kill_all()
        model.stop()


def plain_message_id(prefix: str) -> str:
    """The first `<prefix>.mNNN` whose plan answers at once, with no tool and no think block."""
    for number in itertools.count(1):
        mid = f"{prefix}.m{number:03d}"
        plan = message_plan(mid)
        if not plan.steps and not plan.think:
            return mid
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- the clients


@dataclass(slots=True)
class Attempt:
    route: str  # native / openai-stream / openai
    started: float
    after_final: bool = False
    ended: float = 0.0
    outcome: str = ""  # final / error / disconnect / refused / timeout / in_flight / abandoned / http_<code>
    text: str | None = None  # the final's text
    delivery_id: str | None = None
    turn_id: str | None = None
    shown: list[str] = field(default_factory=list)  # every text the client was shown


@dataclass(slots=True)
class Sent:
    mid: str
    session: str
    text: str
    first_sent: float
    attempts: list[Attempt] = field(default_factory=list)
    done_at: float | None = None
    gave_up: bool = False

    @property
    def finals(self) -> list[Attempt]:
        return [a for a in self.attempts if a.outcome == "final"]


BACKOFF_S = {"refused": (0.05, 0.1), "disconnect": (0.0, 0.1), "timeout": (0.0, 0.1), "in_flight": (0.1, 0.3),
             "error": (0.05, 0.2), "abandoned": (0.0, 0.0), "http_429": (0.3, 0.6)}


class SessionClient:
    """One conversation: numbered messages, one at a time, each sent until its final arrives."""

    def __init__(self, run: CrashRun, index: int) -> None:
        self._run = run
        self._index = index
        self.key = f"crash-s{index:02d}"
        self.rng = random.Random(f"{run.config.seed}/client/{index}")
        self.sent: list[Sent] = []

    async def run(self) -> None:
        config = self._run.config
        number = 0
        while not self._run.stop_sending.is_set():
            number += 1
            mid = f"r{config.seed}.s{self._index:02d}.m{number:03d}"
            message = Sent(mid, self.key, f"[{mid}] please check the notes (message {number} of {self.key})",
                           time.monotonic())
            self.sent.append(message)
            await self._deliver(message)
            if message.gave_up:
                return
            if self.rng.random() < config.resend_after_final_share:
                await self._deliver(message, after_final=True)  # unsure the answer arrived: send it again
            await asyncio.sleep(self.rng.uniform(0.0, 0.15))

    async def _deliver(self, message: Sent, *, after_final: bool = False) -> None:
        config, started = self._run.config, time.monotonic()
        refused = 0  # in a row: a client backs off exponentially while the server is down
        while True:
            if self._run.past_liveness_bound(started):
                message.gave_up = True
                return
            roll = self.rng.random()
            route = ("native" if roll >= config.openai_share else
                     "openai-stream" if roll < config.openai_share / 2 else "openai")
            abandon = (not after_final and route in config.abandon_routes
                       and self.rng.random() < config.abandon_share)
            attempt = Attempt(route, time.monotonic(), after_final=after_final)
            message.attempts.append(attempt)
            try:
                if route == "native":
                    await self._native(message, attempt, abandon)
                else:
                    await self._openai(message, attempt, abandon, stream=route == "openai-stream")
            except httpx.ConnectError:
                attempt.outcome = "refused"
            except httpx.TimeoutException:
                attempt.outcome = "timeout"
            except (httpx.HTTPError, json.JSONDecodeError):
                attempt.outcome = attempt.outcome or "disconnect"
            attempt.ended = time.monotonic()
            if attempt.outcome == "final":
                if message.done_at is None:
                    message.done_at = attempt.ended
                return
            refused = refused + 1 if attempt.outcome == "refused" else 0
            low, high = BACKOFF_S.get(attempt.outcome, (0.1, 0.3))
            await asyncio.sleep(self.rng.uniform(low, high) * min(2 ** (refused - 1), 4) if refused else
                                self.rng.uniform(low, high))

    async def _native(self, message: Sent, attempt: Attempt, abandon: bool) -> None:
        body = {"text": message.text, "message_id": message.mid}
        async with self._run.http.stream("POST", f"/api/sessions/{self.key}/messages", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                attempt.outcome = "in_flight" if response.status_code == 409 else f"http_{response.status_code}"
                return
            kind = ""
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    kind = line.removeprefix("event: ")
                    continue
                if not line.startswith("data: "):
                    continue
                data = json.loads(line.removeprefix("data: "))
                attempt.shown.append(str(data.get("text", "")))
                if kind == "delta" and abandon:
                    attempt.outcome = "abandoned"
                    return
                if kind == "final":
                    attempt.outcome, attempt.text = "final", data.get("text")
                    attempt.delivery_id, attempt.turn_id = data.get("delivery_id"), data.get("turn_id")
                    return
                if kind == "error":
                    attempt.outcome = "error"
                    return
            attempt.outcome = "disconnect"

    async def _openai(self, message: Sent, attempt: Attempt, abandon: bool, *, stream: bool) -> None:
        headers = {"Idempotency-Key": message.mid, "X-Ember-Session": self.key}
        body = {"model": "ember", "stream": stream, "messages": [{"role": "user", "content": message.text}]}
        if not stream:
            response = await self._run.http.post("/v1/chat/completions", json=body, headers=headers)
            if response.status_code != 200:
                attempt.outcome = {409: "in_flight", 502: "error"}.get(response.status_code,
                                                                      f"http_{response.status_code}")
                attempt.shown.append(response.text)
                return
            attempt.outcome, attempt.text = "final", response.json()["choices"][0]["message"]["content"]
            attempt.shown.append(attempt.text or "")
            return
        async with self._run.http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                attempt.outcome = "in_flight" if response.status_code == 409 else f"http_{response.status_code}"
                return
            content: list[str] = []
            finished = error = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    if error:
                        attempt.outcome = "error"
                    elif finished:
                        attempt.outcome, attempt.text = "final", "".join(content)
                    return
                data = json.loads(payload)
                if "error" in data:
                    error = True
                    attempt.shown.append(str(data["error"].get("message", "")))
                    continue
                for choice in data.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        content.append(piece)
                        attempt.shown.append(piece)
                        if abandon:
                            attempt.outcome = "abandoned"
                            return
                    finished = finished or choice.get("finish_reason") == "stop"
            attempt.outcome = "disconnect"


# --------------------------------------------------------------------------- the store


@dataclass(frozen=True, slots=True)
class Row:
    session: str
    seq: int
    role: str
    content: str
    call_ids: tuple[str, ...]
    tool_call_id: str | None
    turn_id: str | None
    created_at: float


@dataclass(slots=True)
class StoreView:
    """The store as one read transaction saw it."""

    heads: dict[str, tuple[int, int]]  # session key -> (last_consolidated, next_seq)
    rows: dict[str, list[Row]]
    inbox: list[dict[str, Any]]
    outbox: list[dict[str, Any]]
    jobs: list[dict[str, Any]]
    memories: list[dict[str, Any]]
    quarantine: list[dict[str, Any]]

    def job_counts(self) -> Counter[str]:
        return Counter(job["status"] for job in self.jobs)


def read_store(path: Path) -> StoreView | None:
    """Read-only, in one transaction; never checkpoints or removes the WAL a crash left."""
    if not path.exists():
        return None
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("BEGIN")

        def table(sql: str) -> list[dict[str, Any]]:
            return [dict(r) for r in conn.execute(sql)]

        try:
            sessions = table(_VIEW_SESSIONS)
        except sqlite3.OperationalError:  # killed before its tables were created
            return None
        view = _store_view(sessions, table)
        conn.execute("COMMIT")
        return view
    finally:
        conn.close()


def read_pg_store(url: str) -> StoreView | None:
    """The same view of a PostgreSQL store (several processes' on one database), read in one
    REPEATABLE READ read-only transaction; None before its tables exist."""
    import asyncpg  # only the cluster's runs need it

    async def read() -> StoreView | None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                tables = {r["tablename"] for r in await conn.fetch(
                    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")}
                if not {"sessions", "messages", "inbox", "outbox", "jobs", "memory_items",
                        "quarantine"} <= tables:
                    return None
                results: dict[str, list[dict[str, Any]]] = {}
                for sql in (_VIEW_SESSIONS, *_VIEW_TABLES):
                    results[sql] = [dict(r) for r in await conn.fetch(sql, timeout=60)]
                return _store_view(results[_VIEW_SESSIONS], results.__getitem__)
        finally:
            await conn.close()

    # On a thread of its own: the caller may be inside an event loop (or a thread of one).
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, read()).result(timeout=120)


_VIEW_SESSIONS = "SELECT key, last_consolidated, next_seq FROM sessions"
_VIEW_MESSAGES = "SELECT * FROM messages ORDER BY session_key, seq"
_VIEW_INBOX = "SELECT * FROM inbox ORDER BY received_at"
_VIEW_OUTBOX = "SELECT * FROM outbox ORDER BY created_at"
_VIEW_JOBS = "SELECT * FROM jobs"
_VIEW_MEMORIES = "SELECT * FROM memory_items"
_VIEW_QUARANTINE = "SELECT * FROM quarantine"
_VIEW_TABLES = (_VIEW_MESSAGES, _VIEW_INBOX, _VIEW_OUTBOX, _VIEW_JOBS, _VIEW_MEMORIES, _VIEW_QUARANTINE)


def _store_view(sessions: list[dict[str, Any]], table: Callable[[str], list[dict[str, Any]]]) -> StoreView:
    """The view of one read transaction, whichever engine `table` (a query's rows) reads."""
    rows: dict[str, list[Row]] = defaultdict(list)
    for r in table(_VIEW_MESSAGES):
        calls = json.loads(r["tool_calls"]) if r["tool_calls"] else []
        rows[r["session_key"]].append(Row(r["session_key"], r["seq"], r["role"], r["content"],
                                          tuple(c.get("id", "") for c in calls), r["tool_call_id"],
                                          r["turn_id"], r["created_at"]))
    return StoreView(
        heads={s["key"]: (s["last_consolidated"], s["next_seq"]) for s in sessions},
        rows=dict(rows),
        inbox=table(_VIEW_INBOX),
        outbox=table(_VIEW_OUTBOX),
        jobs=table(_VIEW_JOBS),
        memories=table(_VIEW_MEMORIES),
        quarantine=table(_VIEW_QUARANTINE),
    )


def protocol_errors(messages: Iterable[tuple[str, tuple[str, ...], str | None, Any]]) -> list[str]:
    """I3 over (role, call ids, tool_call_id, where) in order: each call followed by exactly its results."""
    problems = []
    items = list(messages)
    i = 0
    while i < len(items):
        role, call_ids, _, where = items[i]
        if role == "tool":
            problems.append(f"tool result without its call at {where}")
            i += 1
            continue
        if not call_ids:
            i += 1
            continue
        owed = Counter(call_ids)
        j = i + 1
        while j < len(items) and items[j][0] == "tool":
            result_of = items[j][2] or ""
            if owed[result_of] > 0:
                owed[result_of] -= 1
            else:
                problems.append(f"tool result {result_of!r} at {items[j][3]} does not answer the call at {where}")
            j += 1
        if +owed:
            problems.append(f"tool calls {sorted(+owed)} at {where} have no result")
        i = j
    return problems


# --------------------------------------------------------------------------- checks


class Checker:
    """Counts violations per invariant, keeping every example."""

    def __init__(self) -> None:
        self.violations: dict[str, list[str]] = {name: [] for name in INVARIANTS}
        self._boundaries: dict[str, int] = {}
        self._jobs_by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def add(self, invariant: str, example: str) -> None:
        self.violations[invariant].append(example)

    def observe(self, view: StoreView, when: str) -> None:
        """What must hold of the store at any instant, a crash's included (I3, I5, I6's dedupe)."""
        for key, (boundary, next_seq) in view.heads.items():
            before = self._boundaries.get(key, 0)
            if boundary < before:
                self.add("I5", f"{when}: last_consolidated of {key} went back from {before} to {boundary}")
            self._boundaries[key] = max(before, boundary)
            if boundary > next_seq:
                self.add("I5", f"{when}: last_consolidated {boundary} of {key} is past next_seq {next_seq}")
            rows = view.rows.get(key, [])
            kept = [r for r in rows if r.seq >= boundary]
            if kept and kept[0].role == "tool":
                self.add("I5", f"{when}: the boundary {boundary} of {key} splits a tool call from its result "
                               f"(seq {kept[0].seq} is a tool result)")
            for problem in protocol_errors((r.role, r.call_ids, r.tool_call_id, f"{key}#{r.seq}") for r in rows):
                self.add("I3", f"{when}: stored rows: {problem}")
            episodes = sorted((m["seq_start"], m["seq_end"]) for m in view.memories
                              if m["session_key"] == key and m["kind"] == "episodic")
            end = 0
            for start, stop in episodes:
                if start != end or stop <= start:
                    self.add("I5", f"{when}: summaries of {key} overlap or leave a gap: {episodes}")
                    break
                end = stop
            if episodes and end != boundary:
                self.add("I5", f"{when}: the summaries of {key} end at {end}, last_consolidated is {boundary}")
        pending = Counter((j["kind"], j["dedupe_key"]) for j in view.jobs if j["status"] == "pending")
        for (kind, key), count in pending.items():
            if count > 1:
                self.add("I6", f"{when}: {count} pending {kind} jobs for {key}")

    def final(self, view: StoreView, sent: list[Sent], histories: dict[str, list[dict[str, Any]]]) -> None:
        """Everything the clients were told against the store, message by message."""
        self.observe(view, "final store")
        by_mid = {m.mid: m for m in sent}
        inbox = {r["message_id"]: r for r in view.inbox if r["channel"] == CHANNEL}
        for message_id, count in Counter(r["message_id"] for r in view.inbox).items():
            if count > 1:  # each client sends a message id to one session only
                self.add("I2", f"{count} receipts for the message {message_id}")
        rows_by_turn: dict[str, list[Row]] = defaultdict(list)
        user_rows_by_mid: dict[str, list[Row]] = defaultdict(list)
        for rows in view.rows.values():
            for row in rows:
                rows_by_turn[row.turn_id or ""].append(row)
                if row.role == "user":
                    found = MID_IN_TEXT.match(row.content)
                    user_rows_by_mid[found.group(1) if found else ""].append(row)
        outbox_by_turn: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for record in view.outbox:
            outbox_by_turn[record["turn_id"]].append(record)
        for job in view.jobs:
            self._jobs_by_session[job["session_key"] or ""].append(job)

        for stray in user_rows_by_mid.get("", []):
            self.add("I2", f"a user row no client sent: {stray.session}#{stray.seq} {stray.content[:60]!r}")
        for message_id, receipt in inbox.items():
            if message_id.removeprefix(f"{IDENTITY}:") not in by_mid:
                self.add("I2", f"a receipt for a message no client sent: {message_id}")
            elif receipt["answered_at"] is None:
                self.add("I1", f"{message_id} was accepted but its turn never committed an answer")
        for mid, message in by_mid.items():
            self._check_message(message, inbox.get(f"{IDENTITY}:{mid}"), rows_by_turn, user_rows_by_mid[mid],
                                outbox_by_turn)
        for key, rows in view.rows.items():
            for row in rows:
                if any(marker in row.content for marker in THINK_MARKERS):
                    self.add("I4", f"stored {row.role} row {key}#{row.seq}: {row.content[:80]!r}")
        for memory in view.memories:
            if any(marker in memory["content"] for marker in THINK_MARKERS):
                self.add("I4", f"memory {memory['kind']} of {memory['session_key']}: {memory['content'][:80]!r}")
        for record in view.outbox:
            if any(marker in record["text"] for marker in THINK_MARKERS):
                self.add("I4", f"outbox {record['delivery_id']}: {record['text'][:80]!r}")
        for key, history in histories.items():
            for problem in protocol_errors(
                (m["role"], tuple(c["id"] for c in m.get("tool_calls") or []), m.get("tool_call_id"),
                 f"{key}@{m.get('seq')}") for m in history
            ):
                self.add("I3", f"history over HTTP: {problem}")
            for m in history:
                if any(marker in (m.get("content") or "") for marker in THINK_MARKERS):
                    self.add("I4", f"history over HTTP of {key}: {m['content'][:80]!r}")
            stored = [(r.role, r.content) for r in view.rows.get(f"{CHANNEL}:{IDENTITY}:{key}", [])]
            if [(m["role"], m["content"]) for m in history] != stored:
                self.add("I1", f"the history of {key} over HTTP differs from its stored rows")

    def _check_message(self, message: Sent, receipt: dict[str, Any] | None, rows_by_turn: dict[str, list[Row]],
                       user_rows: list[Row], outbox_by_turn: dict[str, list[dict[str, Any]]]) -> None:
        mid, finals = message.mid, message.finals
        for attempt in message.attempts:
            for text in attempt.shown:
                if any(marker in text for marker in THINK_MARKERS):
                    self.add("I4", f"{mid}: a client was shown {text[:80]!r} ({attempt.route})")
        if message.gave_up:
            self.add("liveness", f"{mid}: no final after {len(message.attempts)} attempts; "
                                 f"outcomes {Counter(a.outcome for a in message.attempts)}")
        if len(user_rows) > 1:
            self.add("I2", f"{mid}: {len(user_rows)} user rows ({[f'{r.session}#{r.seq}' for r in user_rows]})")
        if receipt is None:
            if finals or user_rows:
                self.add("I1", f"{mid}: got a final or has a user row, but no receipt in the inbox")
            return
        turn_id = receipt["turn_id"]
        turn_rows = rows_by_turn.get(turn_id, [])
        users = [r for r in turn_rows if r.role == "user"]
        answers = [r for r in turn_rows if r.role == "assistant" and not r.call_ids]
        if len(users) != 1 or users[0].content != message.text:
            self.add("I1" if not users else "I2",
                     f"{mid}: turn {turn_id} has user rows {[r.content[:40] for r in users]}, expected one")
        if len(answers) > 1:
            self.add("I2", f"{mid}: turn {turn_id} committed {len(answers)} final answers "
                           f"{[f'{r.session}#{r.seq}' for r in answers]}")
        finals_out = [o for o in outbox_by_turn.get(turn_id, []) if o["kind"] == "final"]
        if len(finals_out) > 1:
            self.add("I2", f"{mid}: turn {turn_id} has {len(finals_out)} final outbox records")
        if not answers:
            if finals:
                self.add("I1", f"{mid}: a client was shown {finals[0].text!r:.60} but turn {turn_id} has no answer")
            return
        answer = answers[0]
        if answer.content not in (message_plan(mid).answer, NOT_RESUMED_TEXT):
            self.add("I1", f"{mid}: the committed answer {answer.content[:60]!r} is not this message's answer")
        calls = sum(len(r.call_ids) for r in turn_rows)
        if calls >= REVIEW_THRESHOLD and answer.content != NOT_RESUMED_TEXT:
            for kind in ("review_memory", "review_skills"):  # derived work the turn asked for (I6)
                if not any(job["kind"] == kind and job["status"] in ("done", "failed")
                           and job["updated_at"] >= answer.created_at
                           for job in self._jobs_by_session[answer.session]):
                    self.add("I6", f"{mid}: turn {turn_id} made {calls} tool calls, no {kind} job ran after its "
                                   "answer")
        expected_delivery = f"{turn_id}:{answer.seq}"
        for record in finals_out:
            if record["delivery_id"] != expected_delivery or record["text"] != answer.content:
                self.add("I1", f"{mid}: outbox {record['delivery_id']} does not match the answer at seq {answer.seq}")
        texts = {a.text for a in finals}
        if len(texts) > 1:
            self.add("I2", f"{mid}: clients got {len(texts)} different finals: {sorted(map(str, texts))}")
        deliveries = {a.delivery_id for a in finals if a.route == "native"}
        if len(deliveries) > 1:
            self.add("I2", f"{mid}: finals with different delivery ids {sorted(map(str, deliveries))}")
        for attempt in finals:
            if attempt.text != answer.content and (attempt.text or "").endswith(answer.content):
                self.add("I2", f"{mid}: a client ({attempt.route}) was shown a draft and then the whole answer "
                               f"again: {attempt.text!r:.160}")
            elif attempt.text != answer.content:
                self.add("I1", f"{mid}: a client ({attempt.route}) was shown {attempt.text!r:.80}, "
                               f"the record is {answer.content!r:.80}")
            if attempt.route == "native" and (attempt.delivery_id != expected_delivery
                                              or attempt.turn_id != turn_id):
                self.add("I2", f"{mid}: final with delivery {attempt.delivery_id} / turn {attempt.turn_id}, "
                               f"the record is {expected_delivery}")


# --------------------------------------------------------------------------- the run


async def read_histories(http: httpx.AsyncClient, clients: Iterable[SessionClient],
                         checker: Checker) -> dict[str, list[dict[str, Any]]]:
    """Every client's session history as the gateway shows it; a client whose history cannot be
    read though it sent something is an I1 violation."""
    histories = {}
    for client in clients:
        response = await http.get(f"/api/sessions/{client.key}/messages")
        if response.status_code == 200:
            histories[client.key] = response.json()["messages"]
        elif client.sent:
            checker.add("I1", f"GET the history of {client.key}: HTTP {response.status_code}")
    return histories


def sent_attempts(sent: list[Sent]) -> list[Attempt]:
    return [a for m in sent for a in m.attempts]


def count_attempts(counts: Counter[str], sent: list[Sent]) -> None:
    """The report's counts of messages, attempts and their outcomes, and the time to each final."""
    attempts = sent_attempts(sent)
    counts["turns sent (distinct message ids)"] = len(sent)
    counts["turns answered (a final reached the client)"] = sum(1 for m in sent if m.done_at is not None)
    counts["attempts"] = len(attempts)
    counts["resends (attempts after the first)"] = len(attempts) - len(sent)
    for outcome, number in sorted(Counter(a.outcome for a in attempts).items()):
        counts[f"attempts: {outcome}"] = number
    latencies = [m.done_at - m.first_sent for m in sent if m.done_at is not None]
    if latencies:
        counts["time to final, median (s)"] = round(statistics.median(latencies), 2)
        counts["time to final, max (s)"] = round(max(latencies), 2)


@dataclass(slots=True)
class CrashConfig:
    workdir: Path
    kills: int = 30
    sessions: int = 12
    seed: int = 20240607
    consolidation_threshold: int = 6
    consolidation_keep_recent: int = 2
    notice_every: int = 6  # every n-th restart answers cut-off turns with a notice instead of resuming them
    openai_share: float = 0.3
    abandon_share: float = 0.03
    abandon_routes: tuple[str, ...] = ("native", "openai-stream")
    resend_after_final_share: float = 0.1
    # While the kills go on, clients resend without end (a turn may be cut off again and again);
    # once the last restart is ready, every message must get its final within this bound.
    liveness_bound_s: float = 60.0
    trigger_timeout_s: float = 6.0
    settle_timeout_s: float = 45.0
    verbose: bool = False  # a line per start and per kill
    log: Callable[[str], None] = print


# The moments the killer aims at, with their weights: dealt from a shuffled deck (each round of 22
# kills has every moment its weight's number of times), so even a short run covers them all.
MODES = {"stream": 4, "tool_gap": 4, "commit": 4, "consolidation": 3, "random": 3, "recovery": 2, "graceful": 1,
         "startup": 1}


@dataclass(slots=True)
class CrashReport:
    config: CrashConfig
    counts: dict[str, Any]
    violations: dict[str, list[str]]
    wall_s: float

    def violation_counts(self) -> dict[str, int]:
        return {name: len(self.violations[name]) for name in INVARIANTS}

    def render(self, examples: int = 5) -> str:
        lines = [f"crash run: seed {self.config.seed}, {self.config.kills} kills, {self.config.sessions} sessions, "
                 f"wall {self.wall_s:.1f} s", "", "outcomes:"]
        width = max(len(name) for name in self.counts)
        lines += [f"  {name:<{width}}  {value}" for name, value in self.counts.items()]
        lines += ["", "violations per invariant:"]
        for name in INVARIANTS:
            found = self.violations[name]
            lines.append(f"  {name:<8} {len(found):>5}   {DESCRIPTIONS[name]}")
            lines += [f"           - {example}" for example in found[:examples]]
            if len(found) > examples:
                lines.append(f"           ... and {len(found) - examples} more")
        return "\n".join(lines)


class CrashRun:
    def __init__(self, config: CrashConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.switch = KillSwitch()
        self.model = CrashModelServer(config.seed, self.switch)
        self.checker = Checker()
        self.counts: Counter[str] = Counter()
        self.stop_sending = asyncio.Event()
        self.clients = [SessionClient(self, i) for i in range(config.sessions)]
        self.http: httpx.AsyncClient
        # Built here (it only prepares the home): cleanup() can always reach it.
        self.supervisor = Supervisor(config.workdir, self.model, free_port(), {
            "EMBER_CONSOLIDATION_THRESHOLD": str(config.consolidation_threshold),
            "EMBER_CONSOLIDATION_KEEP_RECENT": str(config.consolidation_keep_recent),
            "EMBER_JOB_BACKOFF_BASE_S": "0.2",
            "EMBER_GATEWAY_RATE_PER_MINUTE": "1000000",
            "EMBER_GATEWAY_RATE_BURST": "100000",
            "EMBER_GATEWAY_SHUTDOWN_GRACE_S": "10",
            "EMBER_MODEL_TIMEOUT_S": "30",
            "EMBER_REVIEW_TOOL_CALL_THRESHOLD": str(REVIEW_THRESHOLD),
            # Every message joins the archival memory and is embedded in the background. The embed
            # job still runs (and is killed) like any other, but with word hashing, not e5: e5 needs
            # ~0.15 s a text on two cores, and a run's ~1300 messages would not settle in time.
            "EMBER_EMBEDDING_MODEL": "hashing",
        })
        self.final_ready_at: float | None = None
        self._model_stopped = False
        self._restarts = 0
        self._ready_s: list[float] = []

    def past_liveness_bound(self, since: float) -> bool:
        if self.final_ready_at is None:
            return False
        return time.monotonic() > max(since, self.final_ready_at) + self.config.liveness_bound_s

    async def run(self) -> CrashReport:
        started = time.monotonic()
        config = self.config
        self.model.start()
        try:
            await self._ready(self.supervisor.spawn())
            limits = httpx.Limits(max_connections=config.sessions * 2 + 8)
            async with httpx.AsyncClient(base_url=self.supervisor.base_url, timeout=HTTP_TIMEOUT,
                                         limits=limits) as self.http:
                tasks = [asyncio.create_task(client.run(), name=client.key) for client in self.clients]
                try:
                    await self._kill_loop(started)
                    self.stop_sending.set()
                    config.log(f"[{time.monotonic() - started:6.1f}s] {config.kills} kills done; "
                               "the clients finish their last messages")
                    await asyncio.wait_for(asyncio.gather(*tasks), timeout=config.liveness_bound_s + 60)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                await self._settle()
                histories = await read_histories(self.http, self.clients, self.checker)
            gateway = self.supervisor.current
            assert gateway is not None
            code = await asyncio.to_thread(gateway.stop, signal.SIGTERM, 60.0)
            self.counts["exit code of the final SIGTERM stop"] = code
            view = read_store(self.supervisor.db_path)
            assert view is not None, "the store is missing"
            sent = [message for client in self.clients for message in client.sent]
            self.checker.final(view, sent, histories)
            self._outcomes(view, sent)
        finally:
            self.cleanup()
        wall = time.monotonic() - started
        self.counts["wall time (s)"] = round(wall, 1)
        self.counts["kills per minute"] = round(self.counts["kills"] / (wall / 60), 1)
        return CrashReport(config, dict(self.counts), self.checker.violations, wall)

    def cleanup(self) -> None:
        """Stop every process this run started, by pid, and the model server. Idempotent."""
        self.supervisor.kill_all()
        if not self._model_stopped:
            self._model_stopped = True
            self.model.stop()

    async def _kill_loop(self, started: float) -> None:
        config = self.config
        deck: list[str] = []
        gateway: GatewayProcess | None = self.supervisor.current
        while self.counts["kills"] < config.kills:
            if not deck:
                deck = [mode for mode, weight in MODES.items() for _ in range(weight)]
                self.rng.shuffle(deck)
            mode = deck.pop()
            if gateway is None:
                gateway = self._restart()
                if mode == "startup":  # killed while it opens the store, recovers, binds
                    await asyncio.sleep(self.rng.uniform(0.2, 1.6))
                    await self._kill(gateway, "during start-up", started)
                    gateway = None
                    continue
                await self._ready(gateway)
                if config.verbose:
                    config.log(f"[{time.monotonic() - started:6.1f}s] ready")
            if mode == "recovery":
                await asyncio.sleep(self.rng.uniform(0.0, 0.3))
                await self._kill(gateway, "right after a restart", started)
            elif mode == "graceful":  # SIGTERM, then SIGKILL while the graceful stop is under way
                await asyncio.sleep(self.rng.uniform(0.1, 1.0))
                with contextlib.suppress(ProcessLookupError):
                    gateway.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(self.rng.uniform(0.0, 0.5))
                await self._kill(gateway, "during a graceful stop (SIGTERM, then SIGKILL)", started, stopping=True)
            elif mode in ("random", "startup"):  # "startup" dealt for the first, already started server
                await asyncio.sleep(self.rng.uniform(0.05, 1.5))
                await self._kill(gateway, "at a random time", started)
            else:
                await asyncio.sleep(self.rng.uniform(0.3, 1.5))  # let resends and resumed turns get going
                await self._aimed_kill(gateway, mode, started)
            gateway = None
        await self._ready(self._restart())
        self.final_ready_at = time.monotonic()

    async def _ready(self, gateway: GatewayProcess) -> None:
        spawned = time.monotonic()
        await self.supervisor.ready(gateway)
        self._ready_s.append(time.monotonic() - spawned)

    def _restart(self) -> GatewayProcess:
        self._restarts += 1
        notice = self.config.notice_every > 0 and self._restarts % self.config.notice_every == 0
        self.counts["restarts"] += 1
        self.counts["restarts in notice mode"] += notice
        return self.supervisor.spawn(notice=notice)

    def _trigger(self, mode: str, gateway: GatewayProcess) -> Trigger:
        rng = self.rng
        if mode == "stream":
            return Trigger("mid-stream of a final", "final", "chunk", gateway, index=rng.randint(1, 4))
        if mode == "tool_gap":
            return Trigger("after a tool call, before its result", "tool", "done", gateway,
                           delay_s=rng.uniform(0.0, 0.012))
        if mode == "commit":
            return Trigger("around the commit of a final", "final", "done", gateway, delay_s=rng.uniform(0.0, 0.015))
        point = rng.choice(("request", "chunk", "done"))
        return Trigger(f"during consolidation ({point})", "consolidate", point, gateway,
                       index=rng.randint(1, 4), delay_s=rng.uniform(0.0, 0.015))

    async def _aimed_kill(self, gateway: GatewayProcess, mode: str, started: float) -> None:
        trigger = self._trigger(mode, gateway)
        self.switch.arm(trigger)
        fired = await asyncio.to_thread(trigger.fired.wait, self.config.trigger_timeout_s)
        if not fired and self.switch.disarm() is None:  # taken just now: its kill is on its way
            fired = await asyncio.to_thread(trigger.fired.wait, 2.0)
        if fired:
            await self._kill(gateway, trigger.mode, started)
        else:
            self.counts["aimed kills that fell back to a kill at the timeout"] += 1
            await self._kill(gateway, f"{trigger.mode} (timed out)", started)

    async def _kill(self, gateway: GatewayProcess, how: str, started: float, *, stopping: bool = False) -> None:
        code = gateway.process.poll()
        if stopping and code == 0:
            self.counts["graceful stops that finished before the SIGKILL"] += 1
        elif code is not None and code != -signal.SIGKILL:
            self.counts["gateway exits nobody asked for"] += 1
            self.config.log(f"ember serve exited by itself with {code}:\n{gateway.output()[-2000:]}")
        sigkill(gateway)
        await asyncio.to_thread(gateway.process.wait, 30)
        self.counts["kills"] += 1
        self.counts[f"kills: {how}"] += 1
        if self.config.verbose:
            self.config.log(f"[{time.monotonic() - started:6.1f}s] kill {self.counts['kills']}: {how}")
        view = await asyncio.to_thread(read_store, self.supervisor.db_path)
        if view is not None:
            self.checker.observe(view, f"after kill {self.counts['kills']} ({how})")
            cut_off = sum(1 for r in view.inbox if r["answered_at"] is None)
            key = "cut-off turns noticed at a restart (per restart)" if self._next_is_notice() else \
                "cut-off turns resumed at a restart (per restart)"
            self.counts[key] += cut_off
            self.counts["jobs left running by a kill (requeued at the restart)"] += view.job_counts()["running"]
        if self.counts["kills"] % 10 == 0:
            self.config.log(f"[{time.monotonic() - started:6.1f}s] {self.counts['kills']} kills, "
                            f"{sum(len(c.sent) for c in self.clients)} messages sent")

    def _next_is_notice(self) -> bool:
        every = self.config.notice_every
        return every > 0 and (self._restarts + 1) % every == 0

    async def _settle(self) -> None:
        """After the last restart: wait for the jobs to drain, then judge what is left (I6)."""
        deadline = time.monotonic() + self.config.settle_timeout_s
        while True:
            view = await asyncio.to_thread(read_store, self.supervisor.db_path)
            assert view is not None
            jobs = view.job_counts()
            if (not jobs["pending"] and not jobs["running"]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        self.checker.observe(view, "after the final settle")
        for job in view.jobs:
            if job["status"] in ("running", "pending"):
                self.checker.add("I6", f"{job['kind']} job for {job['dedupe_key']} still {job['status']} "
                                       f"{self.config.settle_timeout_s:.0f}s after the last restart "
                                       f"(attempts {job['attempts']}, last error {job['last_error']})")

    def _outcomes(self, view: StoreView, sent: list[Sent]) -> None:
        counts = self.counts
        count_attempts(counts, sent)
        counts["answered messages sent again (same id)"] = sum(any(a.after_final for a in m.attempts) for m in sent)
        for route, number in sorted(Counter(a.route for a in sent_attempts(sent) if a.outcome == "final").items()):
            counts[f"finals via {route}"] = number
        assert self.final_ready_at is not None
        drained = [m.done_at - self.final_ready_at for m in sent if m.done_at and m.done_at > self.final_ready_at]
        counts["time to final after the last restart, max (s)"] = round(max(drained, default=0.0), 2)
        counts["start to ready of ember serve, median (s)"] = round(statistics.median(self._ready_s), 2)
        counts["harness CPU (s)"] = round(time.process_time(), 1)
        counts["messages that needed more than one attempt"] = sum(1 for m in sent if len(m.attempts) > 1)
        rows = [r for rows in view.rows.values() for r in rows]
        counts["notices committed (turns not resumed)"] = sum(1 for r in rows if r.content == NOT_RESUMED_TEXT)
        counts["tool results repaired as interrupted"] = sum(1 for r in rows if r.content == INTERRUPTED_RESULT)
        counts["rows quarantined"] = len(view.quarantine)
        counts["stored messages"] = len(rows)
        folded = 0
        for key, (boundary, _) in view.heads.items():
            rows = view.rows.get(key, [])
            kept = [r for r in rows if r.seq >= boundary]
            before = [r for r in rows if r.seq < boundary]
            folded += bool(kept and kept[0].call_ids and before and before[-1].role == "user")
        counts["windows starting at a tool call whose question was summarised"] = folded
        counts["consolidations (episodic summaries)"] = sum(1 for m in view.memories if m["kind"] == "episodic")
        counts["sessions consolidated"] = sum(1 for lc, _ in view.heads.values() if lc > 0)
        for status, number in sorted(view.job_counts().items()):
            counts[f"jobs {status}"] = number
        for kind, number in sorted(self.model.stats.items()):
            counts[kind] = number
        lines = self.supervisor.log_lines()
        counts["ember log: ERROR lines"] = sum(1 for line in lines if " ERROR " in line)
        counts["ember log: WARNING lines"] = sum(1 for line in lines if " WARNING " in line)
        failed = [j for j in view.jobs if j["status"] == "failed"]
        if failed:
            self.config.log("failed jobs: " + "; ".join(f"{j['kind']} {j['dedupe_key']}: {j['last_error']}"
                                                       for j in failed[:5]))


def run_crash(config: CrashConfig) -> CrashReport:
    config.workdir.mkdir(parents=True, exist_ok=True)
    run = CrashRun(config)
    try:
        return asyncio.run(run.run())
    finally:
        run.cleanup()
