"""Ember left running under mixed load for half an hour, or for hours: does it stay up, stay
small and responsive, and answer every message exactly once while its workers are killed?

    .venv/bin/python bench/soak.py [--minutes 30 | --hours N] [--stores sqlite pg] [--quick]

Each store in turn, everything on 127.0.0.1, started afresh:

- sqlite: one `ember serve` (gateway, web app and turns in one process) on the SQLite file;
- pg: a gateway (`ember serve --workers 0`) and two `ember worker`s on a throwaway PostgreSQL
  and Redis (tests/cluster.py, each in a home of its own).

All get the settings of tests/cluster.py (hashing embedder, no titles) and a model server of
the bench's own (tests/modelserver.py) that answers by content, and the same load at once:

- chat: `--clients` people, each sending tagged messages one after another (a new session every
  20), on the native API with a message id, resent with the same id until an answer comes, as
  a client whose connection dropped would; every 4th message asks to remember something, and
  the model calls the `remember` tool before it answers; every 5th, the person searches their
  memory (GET /api/memory/search);
- cron: a task that fires every minute (POST /api/tasks, `* * * * *`);
- webhooks: a signed webhook every 10 s (POST /webhooks/soak, GitHub's signature);
- kill -9: every `--kill-every` seconds a random worker (pg), or the one process (sqlite), is
  killed by its PID and started again in the same home.

Every `--sample-every` seconds: each Ember process's RSS and open file descriptors (/proc),
and its event loop's lag (ember_event_loop_lag_seconds on its /metrics). At the end, with the
load stopped and the jobs settled, every message's answers are read back from its session's
history: lost (none), duplicated (more than one), or answered with the restart notice.

Targets (issue 29): RSS growth <= 10 % after warm-up (per process life: its RSS at the end
against its RSS once `--warmup` seconds old), event-loop lag p99 <= 50 ms, 0 lost, 0
duplicated, no job stuck. Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import ROOT, print_header, rerun_command, unwind_on_signals, verdict

sys.path.insert(0, str(ROOT))  # tests/ (the model server, the throwaway servers, the cluster) is not installed

import httpx

from ember.runtime.turn_state import NOT_RESUMED_TEXT
from tests.modelserver import ModelServer, Reply, tool_call

PEOPLE_PREFIX = "p"
WEBHOOK_SECRET = secrets.token_hex(16)
TAG = re.compile(r"\[(s\d+-\d+)\]")
TURNS_PER_SESSION = 20
WEBHOOK_EVERY_S = 10.0
RESEND_AFTER_S = 1.0
TURN_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 120.0
LAG_BUCKET = re.compile(r'^ember_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.MULTILINE)
JOBS = re.compile(r'^ember_background_jobs\{status="(\w+)"\} (\S+)$', re.MULTILINE)
TARGETS = {"rss_growth": 0.10, "lag_p99_s": 0.050}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, help="minutes per store (default 30, quick 3)")
    parser.add_argument("--hours", type=float, help="hours per store instead")
    parser.add_argument("--stores", nargs="+", choices=("sqlite", "pg"), default=["sqlite", "pg"])
    parser.add_argument("--clients", type=int, default=6, help="people chatting at once (default 6)")
    parser.add_argument("--kill-every", type=float, help="seconds between kill -9s (default 240, quick 60; 0: none)")
    parser.add_argument("--sample-every", type=float, help="seconds between samples (default 10, quick 5)")
    parser.add_argument("--warmup", type=float, help="seconds of a process's life before its RSS counts "
                                                     "(default 120, quick 20)")
    parser.add_argument("--seed", type=int, help="the kills' random seed (default: a new one)")
    parser.add_argument("--quick", action="store_true", help="3 minutes per store, a kill a minute")
    parser.add_argument("--dir", type=Path, help="where the homes go (default: system temp)")
    args = parser.parse_args()
    args.duration_s = 3600 * args.hours if args.hours else 60 * (args.minutes or (3 if args.quick else 30))
    args.kill_every = args.kill_every if args.kill_every is not None else (60 if args.quick else 240)
    args.sample_every = args.sample_every or (5 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (20 if args.quick else 120)
    args.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**9)
    return args


# --- the model ---------------------------------------------------------------------------------------


def answer(body: dict[str, Any]) -> Reply:
    """The model: a tagged message is answered with its tag, after a `remember` call when it asks
    to remember; anything else (the cron task, the webhooks) with a short text."""
    messages = body.get("messages") or []
    users = [str(m.get("content") or "") for m in messages if m.get("role") == "user"]
    found = TAG.search(users[-1]) if users else None
    if found is None:
        return Reply(text="tick")
    if messages[-1].get("role") == "user" and "remember" in users[-1]:
        return Reply(tool_calls=(tool_call("remember", content=f"soak fact {found[1]}"),))
    return Reply(text=f"answer [{found[1]}]")


# --- the deployments ------------------------------------------------------------------------------------


@dataclass
class Life:
    """One process's life: its samples, (seconds since start, RSS bytes, open fds, lag buckets)."""

    name: str
    pid: int
    started: float
    samples: list[tuple[float, int, int, dict[float, float]]] = field(default_factory=list)


class Deployment:
    """The Ember processes of one store: where to send requests, what to sample, what to kill."""

    base_url: str
    keys: dict[str, str]

    def processes(self) -> dict[str, tuple[int, str]]:
        """name -> (pid, its /metrics URL)."""
        raise NotImplementedError

    def kill_one(self, rng: random.Random) -> str:
        raise NotImplementedError


class SqliteDeployment(Deployment):
    def __init__(self, root: Path, model: ModelServer, keys: dict[str, str]) -> None:
        from tests.cluster import DEFAULTS
        from tests.gatewayproc import GatewayProcess, free_port, gateway_env

        self.keys = keys
        home = root / "home"
        home.mkdir(parents=True)
        (home / "ember.toml").write_text(webhook_config())
        self._env = gateway_env(home, model, keys, **DEFAULTS)
        self._port = free_port()
        self._start = lambda: GatewayProcess(self._env, self._port).wait_ready()
        self.gateway = self._start()
        self.base_url = self.gateway.base_url

    def processes(self) -> dict[str, tuple[int, str]]:
        return {"ember serve": (self.gateway.process.pid, f"{self.base_url}/metrics")}

    def kill_one(self, rng: random.Random) -> str:
        self.gateway.kill()
        self.gateway = self._start()
        return "ember serve"

    def stop(self) -> None:
        self.gateway.stop(timeout_s=20)


class ClusterDeployment(Deployment):
    def __init__(self, root: Path, model: ModelServer, keys: dict[str, str], database_url: str,
                 redis_url: str) -> None:
        from tests.cluster import Cluster, wait_all_ready
        from tests.gatewayproc import free_port

        self.keys = keys
        self.metrics_ports = {"w1": free_port(), "w2": free_port()}
        self.cluster = Cluster(root, database_url=database_url, redis_url=redis_url, model=model, keys=keys,
                               member_env=lambda name: ({"EMBER_WORKER_METRICS_PORT": str(self.metrics_ports[name])}
                                                        if name in self.metrics_ports else {}),
                               EMBER_WORKER_TIMEOUT_S="10")
        workers = [self.cluster.add("worker") for _ in self.metrics_ports]
        gateway = self.cluster.add("gateway", start=False)
        gateway.home.mkdir(parents=True, exist_ok=True)
        (gateway.home / "ember.toml").write_text(webhook_config())
        gateway.spawn()
        wait_all_ready([*workers, gateway])
        self.base_url = gateway.base_url

    def processes(self) -> dict[str, tuple[int, str]]:
        found = {}
        for member in self.cluster.members:
            if member.pid is None:
                continue
            url = (f"{member.base_url}/metrics" if member.role == "gateway"
                   else f"http://127.0.0.1:{self.metrics_ports[member.name]}/metrics")
            found[member.name] = (member.pid, url)
        return found

    def kill_one(self, rng: random.Random) -> str:
        victim = rng.choice(self.cluster.workers)
        victim.kill()
        victim.restart()
        return victim.name

    def stop(self) -> None:
        self.cluster.stop()


def webhook_config() -> str:
    return f'[webhooks.soak]\nscheme = "github"\nsecret = "{WEBHOOK_SECRET}"\nmessage = "{{text}}"\n'


@contextmanager
def deployed(store: str, root: Path, model: ModelServer, keys: dict[str, str]) -> Iterator[Deployment]:
    if store == "sqlite":
        sqlite = SqliteDeployment(root, model, keys)
        try:
            yield sqlite
        finally:
            sqlite.stop()
        return
    from tests.pgserver import throwaway_postgres
    from tests.redisserver import RedisServer

    executable = shutil.which("redis-server") or "/usr/bin/redis-server"
    with throwaway_postgres(durable=True) as pg:
        (root / "redis").mkdir(parents=True)
        redis = RedisServer(executable, root / "redis")
        redis.start()
        try:
            cluster = ClusterDeployment(root, model, keys, pg.fresh_database(), redis.url)
            try:
                yield cluster
            finally:
                cluster.stop()
        finally:
            redis.stop()


# --- the load ------------------------------------------------------------------------------------------


@dataclass
class Outcomes:
    sent: dict[str, tuple[str, str]] = field(default_factory=dict)  # tag -> (person, session)
    got: dict[str, str] = field(default_factory=dict)  # tag -> the final text its client got
    resends: int = 0
    gave_up: list[str] = field(default_factory=list)
    searches: Counter[int] = field(default_factory=Counter)  # by HTTP status
    webhooks: Counter[int] = field(default_factory=Counter)
    kills: list[tuple[float, str]] = field(default_factory=list)


def auth(keys: dict[str, str], person: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {keys[person]}"}


async def one_turn(http: httpx.AsyncClient, deployment: Deployment, person: str, session: str, text: str,
                   message_id: str) -> str | None:
    """The final's text, or None if the request ended without one (an error event, a dropped connection)."""
    async with http.stream("POST", f"{deployment.base_url}/api/sessions/{session}/messages",
                           json={"text": text, "message_id": message_id}, headers=auth(deployment.keys, person),
                           timeout=httpx.Timeout(TURN_TIMEOUT_S, connect=5.0)) as response:
        if response.status_code != 200:
            return None
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and name == "final":
                return str(json.loads(line.removeprefix("data: "))["text"])
    return None


async def chat(deployment: Deployment, index: int, until: float, outcomes: Outcomes) -> None:
    person = f"{PEOPLE_PREFIX}{index}"
    async with httpx.AsyncClient() as http:
        n = 0
        while time.monotonic() < until:
            tag, session = f"s{index}-{n}", f"soak-{index}-{n // TURNS_PER_SESSION}"
            text = f"please remember this [{tag}]" if n % 4 == 3 else f"hello [{tag}]"
            outcomes.sent[tag] = (person, session)
            deadline = time.monotonic() + 5 * TURN_TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    final = await one_turn(http, deployment, person, session, text, tag)
                except httpx.HTTPError:
                    final = None
                if final is not None:
                    outcomes.got[tag] = final
                    break
                outcomes.resends += 1
                await asyncio.sleep(RESEND_AFTER_S)
            else:
                outcomes.gave_up.append(tag)
            if n % 5 == 4:
                try:
                    found = await http.get(f"{deployment.base_url}/api/memory/search", params={"q": "soak fact"},
                                           headers=auth(deployment.keys, person), timeout=30)
                    outcomes.searches[found.status_code] += 1
                except httpx.HTTPError:
                    outcomes.searches[0] += 1
            n += 1


async def webhooks(deployment: Deployment, until: float, outcomes: Outcomes) -> None:
    async with httpx.AsyncClient() as http:
        n = 0
        while time.monotonic() < until:
            body = json.dumps({"text": f"webhook number {n}"}).encode()
            digest = "sha256=" + hmac.new(WEBHOOK_SECRET.encode(), body, hashlib.sha256).hexdigest()
            try:
                sent = await http.post(f"{deployment.base_url}/webhooks/soak", content=body, timeout=30,
                                       headers={"X-Hub-Signature-256": digest, "content-type": "application/json"})
                outcomes.webhooks[sent.status_code] += 1
            except httpx.HTTPError:
                outcomes.webhooks[0] += 1
            n += 1
            await asyncio.sleep(WEBHOOK_EVERY_S)


async def killer(deployment: Deployment, until: float, every_s: float, rng: random.Random, started: float,
                 outcomes: Outcomes) -> None:
    while every_s and time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        name = await asyncio.to_thread(deployment.kill_one, rng)
        outcomes.kills.append((time.monotonic() - started, name))
        print(f"    {time.monotonic() - started:7.0f} s  kill -9 {name}, started again", flush=True)


# --- sampling -------------------------------------------------------------------------------------------


def rss_and_fds(pid: int) -> tuple[int, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return (int(rss[1]) * 1024 if rss else 0), fds


async def metrics_text(http: httpx.AsyncClient, url: str, deployment: Deployment) -> str:
    try:
        response = await http.get(url, headers=auth(deployment.keys, f"{PEOPLE_PREFIX}0"), timeout=10)
        return response.text if response.status_code == 200 else ""
    except httpx.HTTPError:
        return ""


async def sampler(deployment: Deployment, until: float, every_s: float, started: float,
                  lives: dict[tuple[str, int], Life], model: ModelServer) -> None:
    async with httpx.AsyncClient() as http:
        while time.monotonic() < until:
            now = time.monotonic()
            for name, (pid, url) in deployment.processes().items():
                life = lives.setdefault((name, pid), Life(name, pid, now))
                seen = rss_and_fds(pid)
                text = await metrics_text(http, url, deployment)
                if seen is not None:
                    buckets = {float(le): float(n) for le, n in LAG_BUCKET.findall(text)}
                    life.samples.append((now - life.started, *seen, buckets))
            del model.requests[:]  # the model server keeps every body: a soak would grow the bench, not Ember
            await asyncio.sleep(max(0.0, every_s - (time.monotonic() - now)))


async def settled(deployment: Deployment, timeout_s: float) -> dict[str, float]:
    """The job counts once none is pending or running (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    counts: dict[str, float] = {}
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            url = f"{deployment.base_url}/metrics"
            counts = {status: float(n) for status, n in JOBS.findall(await metrics_text(http, url, deployment))}
            if counts and not counts.get("pending") and not counts.get("running"):
                break
            await asyncio.sleep(1)
    return counts


# --- the run and its report -----------------------------------------------------------------------------


@dataclass
class Report:
    store: str
    wall_s: float
    outcomes: Outcomes
    lives: dict[tuple[str, int], Life]
    jobs: dict[str, float]
    cron_runs: int
    answered: int = 0
    noticed: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)


async def history_check(deployment: Deployment, report: Report) -> None:
    """Each message's answers, from its session's history: those between it and the next message."""
    sessions: dict[tuple[str, str], list[str]] = defaultdict(list)
    for tag, (person, session) in report.outcomes.sent.items():
        sessions[person, session].append(tag)
    async with httpx.AsyncClient() as http:
        for (person, session), tags in sessions.items():
            got = await http.get(f"{deployment.base_url}/api/sessions/{session}/messages",
                                 headers=auth(deployment.keys, person), timeout=30)
            messages = got.json().get("messages", []) if got.status_code == 200 else []
            answers: dict[str, list[str]] = defaultdict(list)
            current = None
            for message in messages:
                content = str(message.get("content") or "")
                if message.get("role") == "user":
                    found = TAG.search(content)
                    current = found[1] if found else None
                elif message.get("role") == "assistant" and current is not None and content:
                    answers[current].append(content)
            for tag in tags:
                said = answers.get(tag, [])
                if not said:
                    report.lost.append(tag)
                elif len(said) > 1:
                    report.duplicated.append(tag)
                elif said[0] == NOT_RESUMED_TEXT:
                    report.noticed += 1
                elif f"[{tag}]" in said[0]:
                    report.answered += 1
                else:
                    report.wrong.append(tag)
    for tag, text in report.outcomes.got.items():  # what each client was given must be its own answer
        if f"[{tag}]" not in text and text != NOT_RESUMED_TEXT and tag not in report.wrong:
            report.wrong.append(tag)


async def run_store(store: str, root: Path, args: argparse.Namespace, model: ModelServer) -> Report:
    keys = {f"{PEOPLE_PREFIX}{i}": secrets.token_hex(12) for i in range(args.clients)}
    rng = random.Random(f"{args.seed}-{store}")
    with deployed(store, root, model, keys) as deployment:
        async with httpx.AsyncClient() as http:
            task = (await http.post(f"{deployment.base_url}/api/tasks",
                                    json={"prompt": "soak tick", "cron": "* * * * *"},
                                    headers=auth(keys, f"{PEOPLE_PREFIX}0"), timeout=30)).raise_for_status().json()
        started = time.monotonic()
        until = started + args.duration_s
        outcomes, lives = Outcomes(), {}
        await asyncio.gather(*(chat(deployment, i, until, outcomes) for i in range(args.clients)),
                             webhooks(deployment, until, outcomes),
                             killer(deployment, until, args.kill_every, rng, started, outcomes),
                             sampler(deployment, until, args.sample_every, started, lives, model))
        wall = time.monotonic() - started
        jobs = await settled(deployment, SETTLE_TIMEOUT_S)
        async with httpx.AsyncClient() as http:
            runs = (await http.get(f"{deployment.base_url}/api/tasks/{task['id']}", headers=auth(keys, "p0"),
                                   timeout=30)).json().get("recent_runs", [])
        report = Report(store, wall, outcomes, lives, jobs, len(runs))
        await history_check(deployment, report)
    return report


def lag_p99(lives: list[Life], warmup_s: float) -> float:
    """The p99 of the lag samples after warm-up, by the upper bound of the bucket that holds it."""
    total: Counter[float] = Counter()
    for life in lives:
        warm = [s for s in life.samples if s[0] >= warmup_s and s[3]]
        if len(warm) >= 2:
            first, last = warm[0][3], warm[-1][3]
            for le, n in last.items():
                total[le] += n - first.get(le, 0.0)
    if not total:
        return float("nan")
    bounds = sorted(total)
    count = total[bounds[-1]]
    return next((le for le in bounds if total[le] >= 0.99 * count), float("inf")) if count else float("nan")


def growth(life: Life, warmup_s: float) -> float | None:
    warm = [s for s in life.samples if s[0] >= warmup_s]
    return (warm[-1][1] / warm[0][1] - 1.0) if len(warm) >= 2 and warm[0][1] else None


def render(report: Report, args: argparse.Namespace) -> bool:
    o = report.outcomes
    print(f"\n  {report.store}: {report.wall_s / 60:.1f} minutes, {len(o.sent)} messages, {o.resends} resends, "
          f"{len(o.kills)} kill -9s, cron runs {report.cron_runs} (one a minute), webhooks {dict(o.webhooks)}, "
          f"memory searches {dict(o.searches)}")
    print(f"    answers: {report.answered} with their own text, {report.noticed} with the restart notice, "
          f"lost {len(report.lost)}, duplicated {len(report.duplicated)}, another's {len(report.wrong)}, "
          f"clients gave up on {len(o.gave_up)}")
    for label, tags in (("lost", report.lost), ("duplicated", report.duplicated), ("another's", report.wrong)):
        if tags:
            print(f"      {label}: {', '.join(tags[:10])}")
    print(f"    jobs after settling: {report.jobs}")
    print("    process       lives   RSS MB (warm -> end)   growth   fds (warm -> end)   loop lag p99")
    ok = not (report.lost or report.duplicated or report.wrong)
    stuck = report.jobs.get("pending", 0) + report.jobs.get("running", 0)
    ok = ok and not stuck
    by_name: dict[str, list[Life]] = defaultdict(list)
    for life in report.lives.values():
        by_name[life.name].append(life)
    worst_growth, worst_lag = 0.0, 0.0
    for name, lives in sorted(by_name.items()):
        longest = max(lives, key=lambda life: len(life.samples))
        warm = [s for s in longest.samples if s[0] >= args.warmup]
        grown = growth(longest, args.warmup)
        p99 = lag_p99(lives, args.warmup)
        worst_growth = max(worst_growth, grown or 0.0)
        worst_lag = max(worst_lag, p99 if p99 == p99 else 0.0)
        rss = f"{warm[0][1] / 2**20:6.1f} -> {warm[-1][1] / 2**20:6.1f}" if len(warm) >= 2 else "  (too short)  "
        fds = f"{warm[0][2]:4d} -> {warm[-1][2]:4d}" if len(warm) >= 2 else "     -     "
        print(f"    {name:<12} {len(lives):6d}   {rss:>20}   {'' if grown is None else f'{grown:+.1%}':>7}"
              f"   {fds:>17}   {p99 * 1000:8.1f} ms")
    checks = [("0 lost, 0 duplicated, none another's", not (report.lost or report.duplicated or report.wrong)),
              ("no job stuck", not stuck),
              (f"RSS growth <= {TARGETS['rss_growth']:.0%} after warm-up (worst {worst_growth:+.1%})",
               worst_growth <= TARGETS["rss_growth"]),
              (f"event-loop lag p99 <= {TARGETS['lag_p99_s'] * 1000:.0f} ms (worst {worst_lag * 1000:.1f} ms)",
               worst_lag <= TARGETS["lag_p99_s"])]
    for label, passed in checks:
        print(f"    {verdict(passed)}  {label}")
        ok = ok and passed
    return ok


def main() -> int:
    args = parse_args()
    unwind_on_signals()
    directory = Path(tempfile.mkdtemp(prefix="ember-soak-", dir=args.dir))
    print_header("Ember soak: mixed load, kill -9s, for a long time", f"httpx {httpx.__version__}", [
        ("run", f"{args.duration_s / 60:g} minutes per store ({', '.join(args.stores)}), {args.clients} people, "
                f"a kill -9 every {args.kill_every:.0f} s, samples every {args.sample_every:.0f} s, "
                f"warm-up {args.warmup:.0f} s, seed {args.seed}"),
    ], rerun_command(__file__, [*sys.argv[1:], *([] if "--seed" in sys.argv else ["--seed", str(args.seed)])]))
    model = ModelServer()
    model.responder = answer
    model.start()
    ok = True
    try:
        for store in args.stores:
            report = asyncio.run(run_store(store, directory / store, args, model))
            ok = render(report, args) and ok
    except KeyboardInterrupt:
        print("\n  interrupted", file=sys.stderr)
        return 130
    finally:
        model.stop()
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\n  verdict: {'PASS' if ok else 'MISS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
