"""Many sessions at once, in-process through the bus, with consolidation due as they grow.

    .venv/bin/python bench/sessions_load.py [--sessions N] [--turns K] [--concurrency C] [--runs R]
                                            [--quick] [--dir PATH] [--profile]

N sessions (default 1,000; --quick 100) of K turns each (default 10) run
against one runtime, with a zero-latency scripted model
(ember.models.scripted.FunctionModel answers at once; a consolidation request,
recognised by its instruction, gets a short summary). At most C sessions
(default 100; --quick 50) are in flight at a time; a session's turns run one
after the other, each sent as an InboundEvent on the bus and finished when its
FINAL comes back. Consolidation is due every 20 messages
(consolidation_threshold=20, consolidation_keep_recent=4), so every session of
10 turns queues one consolidation job with its last answer.

It prints, per run and as the median over runs (`--runs`, default 1):

1. throughput (turns/s from the first message to the last FINAL, and in each
   tenth of the run), wall time, turn latency (publish -> FINAL) p50 and p99,
   CPU per turn;
2. the background queue: consolidation jobs queued, done and failed, the
   other jobs the turns queued, the job table's final statuses, and how long
   the queue took to drain to zero pending + running after the last FINAL;
3. the store round trips per turn under load (the delivery marks in batches);
4. a check of every session's stored history: K user and K assistant messages,
   in order, each answer after its own question, no duplicate, no gap; and the
   consolidation boundary each session ended with. Every count must be 0; the
   exit status is 1 otherwise.

Each run starts a fresh runtime in a throwaway EMBER_HOME. `--profile` runs
cProfile on the event-loop thread during the first run (which slows it) and
prints where that thread's time went.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    busy_warning,
    print_header,
    quantile,
    rerun_command,
    store_versions,
    without_user_config,
)
from roundtrips import RoundTrips, per_turn

from ember.app.runtime import Runtime, build_runtime, running
from ember.config.settings import Settings
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.messages import Message, Role
from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store.tx import Statement

CHANNEL = "load"
THRESHOLD = 20  # consolidation due every 20 messages
KEEP_RECENT = 4
SUMMARY = "The user asked a series of short numbered questions and got a short answer to each."
TURN_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 600.0
TAG = re.compile(r"^\[(s\d+)#(\d+)\]")


def question(chat: str, turn: int) -> str:
    return f"[{chat}#{turn}] What is the next step for item {turn}?"


def answer(text: str) -> str:
    return f"Answer to {text[:text.index(']') + 1]}: do it now."


# --- the model --------------------------------------------------------------------------


class Model:
    """Answers a turn with a reply that names its question; a summary request with SUMMARY."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.client = FunctionModel(self._reply, name="bench-zero-latency", chunk_size=1 << 20)

    def _reply(self, messages: list[Message], _tools: object) -> ModelReply:
        requests = getattr(self.client, "requests", None)
        if isinstance(requests, list):
            requests.clear()  # FunctionModel keeps every request; a load run need not
        if messages and messages[0].role is Role.SYSTEM and SUMMARY_INSTRUCTION in messages[0].content:
            self.calls["summary"] += 1
            return ModelReply(text=SUMMARY)
        last = messages[-1] if messages else None
        if last is not None and last.role is Role.USER and TAG.match(last.content):
            self.calls["turn"] += 1
            return ModelReply(text=answer(last.content))
        self.calls["other"] += 1
        return ModelReply(text="[]")


# --- counting what the runtime does --------------------------------------------------------


class Wrapped:
    """Counts calls of one public method of a runtime part (its outcome by `classify`)."""

    def __init__(self, owner: object, name: str, classify: Callable[[tuple[Any, ...], Any], str]) -> None:
        self.counts: Counter[str] = Counter()
        original = getattr(owner, name, None)
        self.active = False
        if original is None:
            return

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                result = await original(*args, **kwargs)
            except Exception:
                self.counts["raised"] += 1
                raise
            self.counts[classify(args, result)] += 1
            return result

        with suppress(AttributeError, TypeError):
            setattr(owner, name, wrapper)
            self.active = True


# --- driving sessions through the bus ----------------------------------------------------


class Channel:
    """The bench's channel: reads every outbound event and hands each turn's
    FINAL (or ERROR) to the session waiting for it."""

    def __init__(self, runtime: Runtime) -> None:
        self._bus = runtime.bus
        self._waiting: dict[str, asyncio.Future[OutboundEvent]] = {}
        self.kinds: Counter[str] = Counter()
        self.unexpected = 0  # a FINAL or ERROR nobody waited for: a duplicate answer
        self._reader = asyncio.create_task(self._read(), name="bench-channel")

    async def _read(self) -> None:
        while True:
            out = await self._bus.next_outbound(CHANNEL)
            self.kinds[out.kind.value] += 1
            if out.kind not in (OutboundKind.FINAL, OutboundKind.ERROR):
                continue
            waiter = self._waiting.pop(out.chat_id, None)
            if waiter is None or waiter.done():
                self.unexpected += 1
            else:
                waiter.set_result(out)

    async def turn(self, chat: str, turn: int) -> tuple[OutboundEvent, float]:
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[chat] = waiter
        started = time.perf_counter()
        await self._bus.publish_inbound(InboundEvent(
            channel=CHANNEL, chat_id=chat, sender_id=f"user-{chat}", text=question(chat, turn),
            message_id=f"{chat}-{turn}",
        ))
        out = await asyncio.wait_for(waiter, TURN_TIMEOUT_S)
        return out, time.perf_counter() - started

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


@dataclass
class Run:
    sessions: int
    turns: int
    wall_s: float = 0.0
    cpu_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    finished: list[float] = field(default_factory=list)  # seconds since the start, per turn
    drain_s: float | None = None
    errors: int = 0
    timeouts: int = 0
    wrong_answers: int = 0
    unexpected: int = 0
    model_calls: Counter[str] = field(default_factory=Counter)
    jobs_by_kind: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> status -> count
    consolidations: Counter[str] = field(default_factory=Counter)
    job_statuses: dict[str, int] = field(default_factory=dict)
    round_trips: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    boundaries: Counter[int] = field(default_factory=Counter)

    @property
    def turns_total(self) -> int:
        return len(self.latencies)

    @property
    def throughput(self) -> float:
        return self.turns_total / self.wall_s if self.wall_s else 0.0

    def window_rates(self, windows: int = 10) -> list[float]:
        """Turns/s in each of `windows` equal slices of the run's wall time."""
        width = self.wall_s / windows
        counts = Counter(min(windows - 1, int(t / width)) for t in self.finished)
        return [counts[i] / width for i in range(windows)]


async def one_run(home: Path, sessions: int, turns: int, concurrency: int, profile: cProfile.Profile | None) -> Run:
    settings = Settings(home=home, consolidation_threshold=THRESHOLD, consolidation_keep_recent=KEEP_RECENT,
                        job_backoff_base_s=0.05, sqlite_synchronous="FULL")
    model = Model()
    runtime = await build_runtime(settings, model.client)
    run = Run(sessions, turns)
    consolidated = Wrapped(runtime.consolidation, "consolidate",
                           lambda _args, moved: "done (boundary moved)" if moved else "done (nothing to move)")
    counter = RoundTrips(settings.database_path)
    await counter.attach(runtime.db)
    gate = asyncio.Semaphore(concurrency)
    chats = [f"s{i:05d}" for i in range(sessions)]
    try:
        async with running(runtime):
            channel = Channel(runtime)

            async def session(chat: str) -> None:
                async with gate:
                    for t in range(turns):
                        try:
                            out, latency = await channel.turn(chat, t)
                        except TimeoutError:
                            run.timeouts += 1
                            return
                        run.latencies.append(latency)
                        run.finished.append(time.perf_counter() - started)
                        if out.kind is OutboundKind.ERROR:
                            run.errors += 1
                        elif out.text != answer(question(chat, t)):
                            run.wrong_answers += 1

            if profile is not None:
                profile.enable()
            before, cpu, started = counter.snapshot(), time.process_time(), time.perf_counter()
            await asyncio.gather(*(session(chat) for chat in chats))
            run.wall_s, run.cpu_s = time.perf_counter() - started, time.process_time() - cpu
            if profile is not None:
                profile.disable()
            run.round_trips = counter.snapshot() - before
            run.drain_s = await drained(runtime)
            run.unexpected = channel.unexpected
            await channel.close()
            run.job_statuses = await runtime.jobs.counts()
            run.jobs_by_kind = await jobs_by_kind(runtime)
            await verify(runtime, chats, turns, run)
    finally:
        counter.close()
    run.model_calls = model.calls
    run.consolidations = consolidated.counts if consolidated.active else Counter()
    return run


async def jobs_by_kind(runtime: Runtime) -> dict[str, dict[str, int]]:
    """The job table by kind and status: every row is a job a turn queued with its answer."""
    rows = await runtime.db.run_read(lambda tx: tx.execute(
        Statement("SELECT kind, status, count(*) FROM jobs GROUP BY kind, status")).fetchall())
    table: dict[str, dict[str, int]] = {}
    for kind, status, count in rows:
        table.setdefault(kind, {})[status] = count
    return table


async def drained(runtime: Runtime) -> float | None:
    """Seconds until the job queue has nothing pending or running; None on timeout."""
    started = time.perf_counter()
    while time.perf_counter() - started < DRAIN_TIMEOUT_S:
        counts = await runtime.jobs.counts()
        if not counts.get("pending") and not counts.get("running"):
            return time.perf_counter() - started
        await asyncio.sleep(0.01)
    return None


async def verify(runtime: Runtime, chats: list[str], turns: int, run: Run) -> None:
    """Every session's full stored history: turns x (question, its answer), in order."""
    for chat in chats:
        history = await runtime.sessions.history(f"{CHANNEL}:{chat}")
        users = [m for m in history if m.role is Role.USER]
        assistants = [m for m in history if m.role is Role.ASSISTANT]
        v = run.violations
        v["sessions missing a user message"] += len(users) < turns
        v["sessions missing an answer"] += len(assistants) < turns
        v["sessions with extra messages"] += len(history) > 2 * turns
        contents = [m.content for m in history]
        v["duplicated messages"] += len(contents) - len(set(contents))
        expected = [text for t in range(turns) for text in (question(chat, t), answer(question(chat, t)))]
        v["sessions out of order or altered"] += contents != expected and len(history) == 2 * turns
        seqs = [m.seq for m in history]
        v["sessions with a seq gap"] += seqs != list(range(len(history)))
    for summary in await runtime.sessions.list_sessions(f"{CHANNEL}:"):
        run.boundaries[summary.last_consolidated] += 1


# --- report ------------------------------------------------------------------------------


def header(args: argparse.Namespace, directory: Path) -> None:
    print_header("Ember sessions under load (in-process, through the bus)", store_versions(), [
        ("files", f"{directory} (WAL, synchronous=FULL)"),
        ("load", f"{args.sessions:,} sessions x {args.turns} turns, at most {args.concurrency} sessions in flight,"
                 f" {args.runs} run(s); consolidation_threshold={THRESHOLD}, keep_recent={KEEP_RECENT};"
                 " zero-latency model"),
    ], rerun_command(__file__))


def report_run(index: int, run: Run) -> None:
    drain = "NOT DRAINED" if run.drain_s is None else f"{run.drain_s:.2f} s"
    print(f"  run {index + 1}: {run.turns_total:,} turns in {run.wall_s:.1f} s = {run.throughput:.1f} turns/s;"
          f" latency p50 {quantile(run.latencies, 0.5) * 1e3:.1f} ms, p99 {quantile(run.latencies, 0.99) * 1e3:.1f} ms;"
          f" CPU {run.cpu_s / max(1, run.turns_total) * 1e3:.2f} ms/turn ({run.cpu_s / run.wall_s:.2f} cores);"
          f" queue drained in {drain}")


def report(runs: list[Run], elapsed: float, load_before: float) -> int:
    med = statistics.median
    print("\n1. Turns")
    print(f"  throughput    : {med(r.throughput for r in runs):.1f} turns/s (median of {len(runs)} run(s))")
    rates = sorted(rate for r in runs for rate in r.window_rates())
    print(f"                  per tenth of a run: min {rates[0]:.1f}, median {med(rates):.1f}, max {rates[-1]:.1f}")
    print(f"  wall time     : {med(r.wall_s for r in runs):.1f} s for {runs[0].sessions * runs[0].turns:,} turns")
    print(f"  latency       : p50 {med(quantile(r.latencies, 0.5) for r in runs) * 1e3:.1f} ms,"
          f" p99 {med(quantile(r.latencies, 0.99) for r in runs) * 1e3:.1f} ms  (publish -> FINAL)")
    print(f"  CPU           : {med(r.cpu_s / max(1, r.turns_total) for r in runs) * 1e3:.2f} ms per turn"
          " (this process, all threads)")

    last = runs[-1]
    print("\n2. Background jobs (last run)")
    queued = last.jobs_by_kind.get("consolidate", {})
    print(f"  consolidation : queued {sum(queued.values()):,} (a turn asking while one is pending"
          " for its session is covered by it)")
    outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(last.consolidations.items())) or "n/a"
    print(f"                  runs: {outcomes}; summary requests to the model {last.model_calls['summary']:,}")
    failed = last.consolidations.get("raised", 0)
    print(f"                  failed attempts {failed:,}")
    others = {kind: sum(statuses.values()) for kind, statuses in last.jobs_by_kind.items() if kind != "consolidate"}
    if others:
        print("  other jobs    : " + ", ".join(f"{k} {v:,}" for k, v in sorted(others.items())))
    print("  job table     : " + ", ".join(f"{k} {v:,}" for k, v in sorted(last.job_statuses.items())))
    drains = [r.drain_s for r in runs if r.drain_s is not None]
    drain = (f"{med(drains):.2f} s (median)" if len(drains) == len(runs)
             else f"NOT DRAINED within {DRAIN_TIMEOUT_S:.0f} s")
    print(f"  queue drain   : {drain} from the last FINAL to 0 pending + 0 running")
    boundaries = ", ".join(f"seq {b}: {n:,}" for b, n in sorted(last.boundaries.items()))
    print(f"  boundaries    : sessions by last_consolidated: {boundaries}")

    print("\n3. Store round trips per turn under load (last run; delivery marks written in batches)")
    for line in per_turn(last.round_trips, last.turns_total):
        print(f"  {line}")
    print("  (counted while the turns ran: consolidation work that ran meanwhile is included)")

    print("\n4. Checks (each must be 0)")
    checks: Counter[str] = Counter()
    for r in runs:
        checks["error answers"] += r.errors
        checks["turns timed out"] += r.timeouts
        checks["answers to the wrong question"] += r.wrong_answers
        checks["answers nobody waited for (duplicates)"] += r.unexpected
        checks["unexpected model requests"] += r.model_calls["other"]
        checks["runs whose queue did not drain"] += r.drain_s is None
        checks["job failures (status failed)"] += r.job_statuses.get("failed", 0)
        checks.update(r.violations)
        for key in r.violations:
            checks[key] += 0
    width = max(len(k) for k in checks)
    for name, value in checks.items():
        print(f"  {name:<{width}} : {value}")
    total = sum(checks.values())
    print(f"  {'all checks':<{width}} : {'PASS' if total == 0 else f'FAIL ({total} violations)'}")
    print(f"\n  total {elapsed:.1f} s")
    busy_warning(load_before, "throughput and latency are lower than it can do",
                 own_cores=1)  # the bench itself keeps about one core busy
    return 0 if total == 0 else 1


def report_profile(profile: cProfile.Profile, turns: int) -> None:
    stats = pstats.Stats(profile)
    by_package: Counter[str] = Counter()
    total = 0.0
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        by_package[_package(filename, name)] += tottime
    print("\n5. Profile of the event-loop thread during run 1 (cProfile; own time by package)")
    for package, seconds in by_package.most_common(10):
        print(f"  {package:<34} {seconds:7.2f} s  {seconds / total:6.1%}")
    # Each call aiosqlite hands to a connection's thread is one put on that thread's queue.
    hops = sum(counts[1] for (_f, _l, name), (*_, callers) in stats.stats.items()  # type: ignore[attr-defined]
               if "put_nowait" in name for (caller, *_), counts in callers.items() if "aiosqlite" in caller)
    if hops and turns:
        print(f"\n  calls handed to aiosqlite's threads (queue puts from aiosqlite): {hops / turns:.0f} per turn")
    print("\n  top functions by own time:")
    stats.sort_stats("tottime").print_stats(20)


def _package(filename: str, name: str) -> str:
    if filename == "~":  # C functions
        for marker, label in (("poll", "idle (epoll wait)"), ("put_nowait", "queue puts (hand-offs to threads)"),
                              ("switch", "greenlet switches")):
            if marker in name:
                return label
        return "other C functions"
    for marker, label in (("/ember/", "ember"), ("sqlalchemy", "sqlalchemy"), ("aiosqlite", "aiosqlite"),
                          ("/asyncio/", "asyncio"), ("pydantic", "pydantic"), ("greenlet", "greenlet")):
        if marker in filename:
            return label
    return "other python"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, help="sessions per run (default 1,000; quick 100)")
    parser.add_argument("--turns", type=int, default=10, help="turns per session (default 10)")
    parser.add_argument("--concurrency", type=int, help="sessions in flight at a time (default 100; quick 50)")
    parser.add_argument("--runs", type=int, default=1, help="runs, each on a fresh runtime (default 1)")
    parser.add_argument("--quick", action="store_true", help="100 sessions, 50 in flight (< 1 min)")
    parser.add_argument("--dir", type=Path, help="where to create the temporary homes (default: system temp)")
    parser.add_argument("--profile", action="store_true", help="cProfile the event loop during run 1")
    args = parser.parse_args()
    args.sessions = args.sessions or (100 if args.quick else 1_000)
    args.concurrency = args.concurrency or (50 if args.quick else 100)
    return args


async def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="ember-load-", dir=args.dir) as tmp:
        directory = Path(tmp)
        without_user_config(os.environ, directory / "home")
        header(args, directory)
        load_before, started = os.getloadavg()[0], time.perf_counter()
        profile = cProfile.Profile() if args.profile else None
        runs = []
        print()
        for index in range(args.runs):
            run = await one_run(directory / f"home-{index}", args.sessions, args.turns, args.concurrency,
                                profile if index == 0 else None)
            report_run(index, run)
            runs.append(run)
        status = report(runs, time.perf_counter() - started, load_before)
        if profile is not None:
            report_profile(profile, runs[0].turns_total)
        return status


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
