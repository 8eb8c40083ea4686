"""What a turn's commit costs, and whether it grows with the session (DESIGN.md §4);
what a whole turn costs the runtime, against the fsync floor.

    .venv/bin/python bench/commit_cost.py [--runs N] [--commits N] [--turns K] [--session-turns K]
                                          [--quick] [--dir PATH]

1. Commit cost: `SqlSessionStore.append` of one final answer (a real durable
   transaction, WAL, synchronous=FULL) on sessions of 10 ... 100,000 messages.
   Each session is filled once through the store itself, and every run starts
   from a fresh copy of that file, so from exactly n messages. The lengths take
   turns in blocks of 10 commits (round-robin) so drift hits all alike.
   Target: median(100,000) / median(10) <= 1.2.
2. The floor: one single-row INSERT in its own transaction with the stdlib
   sqlite3 module, same settings, same directory, in the same round-robin:
   what one durable commit costs on this disk.
3. Whole turns through the bus with a zero-latency scripted model, with and
   without streaming: latency to the FINAL event and until the turn has
   finished (its trace recorded), against the target of <= 10 x floor (the
   floor timed again after each turn, under the same load); where
   the time goes (the turn's own stage timings, CPU); and the store round trips
   a turn makes (statements and transactions, reads and writes apart), counted
   over all the timed turns, the delivery marks that the runtime writes in
   batches off the turn's path included.

Medians are medians of per-run medians; p90 likewise; min is over all samples.
Only Ember's public interfaces are used (the runtime, the bus, the stores'
public methods), and SQLAlchemy's engine events to count statements.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    busy_warning,
    print_header,
    quantile,
    rerun_command,
    store_versions,
    us,
    verdict,
    without_user_config,
)
from roundtrips import RoundTrips, per_turn

from ember.app.runtime import Runtime, build_runtime, running
from ember.config.settings import Settings
from ember.core.events import InboundEvent, OutboundKind
from ember.core.messages import Message, Session
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store.sessions import SqlSessionStore
from ember.store.sqlite.database import SqliteDatabase

TARGET_RATIO = 1.2  # median(100,000 messages) / median(10 messages)
TARGET_X_FLOOR = 10.0  # a whole turn's overhead, in durable commits
ANSWER = "Here is the final answer to your question, in a couple of plain sentences. " * 3
QUESTION = "Could you look into this for me and tell me what you find? " * 2
PREFILL_BATCH = 20_000
WARMUP = 5
BLOCK = 10  # commits per length before the round-robin moves on
FLOOR_BETWEEN_TURNS = 1  # floor commits timed after each turn
CHANNEL = "bench"


@dataclass
class Timing:
    """Samples in seconds, one list per run."""

    label: str
    runs: list[list[float]] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(statistics.median(run) for run in self.runs if run)

    @property
    def p90(self) -> float:
        return statistics.median(quantile(run, 0.9) for run in self.runs if run)

    @property
    def min(self) -> float:
        return min(min(run) for run in self.runs if run)

    @property
    def flat(self) -> list[float]:
        return [s for run in self.runs for s in run]


# --- 1. commit cost at several session lengths ------------------------------------------


class PrefilledSession:
    """A session of exactly `n` messages: filled once, through the store, into a
    template file; every run works on a fresh copy of it."""

    def __init__(self, directory: Path, n: int) -> None:
        self.n = n
        self.key = f"{CHANNEL}:len{n}"
        self.template = directory / f"template-{n}.db"
        self.path = directory / f"session-{n}.db"
        self.db: SqliteDatabase | None = None
        self.store: SqlSessionStore | None = None
        self.session = Session(key=self.key)
        self.load_s = 0.0

    async def fill(self) -> None:
        db = SqliteDatabase(self.template)
        await db.open()
        try:
            store = SqlSessionStore(db)
            session = await store.load(self.key)
            for start in range(0, self.n, PREFILL_BATCH):
                batch = [_prefill_message(seq) for seq in range(start, min(start + PREFILL_BATCH, self.n))]
                await store.append(session, batch)
            await store.list_sessions()  # opens the read connection, so the load below times only itself
            started = time.perf_counter()
            loaded = await store.load(self.key)
            self.load_s = time.perf_counter() - started
            assert len(loaded.messages) == self.n == loaded.next_seq, (len(loaded.messages), loaded.next_seq)
        finally:
            await db.close()
        checkpoint(self.template)

    async def reset(self) -> None:
        """Back to exactly n messages: a fresh copy of the template, opened and loaded."""
        await self.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(self.template, self.path)
        self.db = SqliteDatabase(self.path)
        await self.db.open()
        self.store = SqlSessionStore(self.db)
        self.session = await self.store.load(self.key)
        assert self.session.next_seq == self.n

    async def close(self) -> None:
        if self.db is not None:
            await self.db.close()
            self.db = self.store = None

    async def time_commits(self, count: int) -> list[float]:
        assert self.store is not None
        samples = []
        for _ in range(count):
            message = Message.assistant(ANSWER, turn_id=f"turn-{self.session.next_seq}")
            started = time.perf_counter()
            await self.store.append(self.session, [message])
            samples.append(time.perf_counter() - started)
        return samples


def _prefill_message(seq: int) -> Message:
    turn_id = f"prefill-{seq // 2}"
    return Message.user(QUESTION, turn_id=turn_id) if seq % 2 == 0 else Message.assistant(ANSWER, turn_id=turn_id)


def checkpoint(path: Path) -> None:
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


# --- 2. the floor: one durable SQLite commit ---------------------------------------------


class Floor:
    """A single-row INSERT in its own transaction, stdlib sqlite3, WAL, synchronous=FULL."""

    def __init__(self, directory: Path, name: str = "floor.db") -> None:
        self.path = directory / name
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")

    async def reset(self) -> None:
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    async def close(self) -> None:
        self.conn.close()

    async def time_commits(self, count: int) -> list[float]:
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute("INSERT INTO t (body) VALUES (?)", (ANSWER,))
            self.conn.execute("COMMIT")
            samples.append(time.perf_counter() - started)
        return samples


async def commit_bench(directory: Path, lengths: list[int], runs: int,
                       commits: int) -> tuple[Timing, list[Timing], list[PrefilledSession]]:
    """The floor's timing, one timing per length, and the sessions (for their load time)."""
    sessions = [PrefilledSession(directory, n) for n in lengths]
    for target in sessions:
        await target.fill()
    floor = Floor(directory)
    targets: list[tuple[Timing, Floor | PrefilledSession]] = [(Timing("floor"), floor)]
    targets += [(Timing(f"{s.n:,} msgs"), s) for s in sessions]
    try:
        for _ in range(runs):
            for timing, target in targets:
                await target.reset()
                await target.time_commits(WARMUP)
                timing.runs.append([])
            # Round-robin in small blocks, so drift in disk or CPU load hits every length alike.
            for block in range(0, commits, BLOCK):
                for timing, target in targets:
                    timing.runs[-1] += await target.time_commits(min(BLOCK, commits - block))
    finally:
        for _, target in targets:
            await target.close()
    return targets[0][0], [timing for timing, _ in targets[1:]], sessions


# --- 3. whole turns through the bus ------------------------------------------------------


class TurnEnds:
    """Learns when a turn's trace is recorded and when its answer's delivery mark is
    written, through the stores' public methods `record` and `mark_delivered`
    (wrapped on the runtime's instances); if they cannot be wrapped, by polling
    the trace store's `get`, and the delivery store's `undelivered`."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._done: set[str] = set()
        self._changed = asyncio.Event()
        self.traces_hooked = self._hook(runtime.traces, "record", lambda trace, *_: [trace.turn_id])
        self.marks_hooked = self._hook(getattr(runtime.deliveries, "store", None), "mark_delivered",
                                       lambda ids, *_: list(ids))

    def _hook(self, owner: object, name: str, keys: Callable[..., list[str]]) -> bool:
        original = getattr(owner, name, None)
        if original is None:
            return False

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = await original(*args, **kwargs)
            self._done.update(keys(*args))
            self._changed.set()
            return result

        try:
            setattr(owner, name, wrapper)
        except (AttributeError, TypeError):
            return False
        return True

    async def _until(self, key: str, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while key not in self._done:
                self._changed.clear()
                await self._changed.wait()
            self._done.discard(key)

    async def trace_recorded(self, turn_id: str, timeout_s: float = 30.0) -> None:
        if self.traces_hooked:
            return await self._until(turn_id, timeout_s)
        async with asyncio.timeout(timeout_s):
            while await self._runtime.traces.get(turn_id) is None:
                await asyncio.sleep(0.0002)

    async def marked(self, delivery_id: str | None, timeout_s: float = 30.0) -> None:
        if self.marks_hooked and delivery_id is not None:
            return await self._until(delivery_id, timeout_s)
        await marks_written(self._runtime, timeout_s)


@dataclass
class TurnFigures:
    stream: bool
    to_final: Timing
    to_done: Timing
    by_position: dict[int, list[float]]  # to_final by the turn's position in its session


@dataclass
class TurnBench:
    figures: list[TurnFigures]
    turns: int
    session_turns: int
    counts: Counter[str]
    cpu_s: float
    stages: dict[str, list[float]]  # the turns' own stage timings (ms), from their traces
    floor: Timing  # the floor again, measured between the turns
    traces_polled: bool  # the trace store's record could not be wrapped


async def turn_bench(directory: Path, turns: int, runs: int, session_turns: int) -> TurnBench:
    settings = Settings(home=directory / "home", consolidation_threshold=10**9, sqlite_synchronous="FULL")
    model = FunctionModel(lambda _messages, _tools: ModelReply(text=ANSWER), chunk_size=1 << 20)
    runtime = await build_runtime(settings, model)
    counter = RoundTrips(settings.database_path)
    counter.ignore = asyncio.current_task()
    await counter.attach(runtime.db)
    modes = (False, True)
    finals = {mode: Timing("to final") for mode in modes}
    dones = {mode: Timing("to done") for mode in modes}
    positions: dict[bool, dict[int, list[float]]] = {mode: {} for mode in modes}
    per_run = max(1, turns // runs)
    chats = Chats(session_turns)
    floor, floor_timing = Floor(directory, "turn-floor.db"), Timing("floor")
    try:
        async with running(runtime):
            ends = TurnEnds(runtime)
            for mode in modes:
                for _ in range(WARMUP):
                    await one_turn(runtime, ends, mode, "warmup")
            await marks_written(runtime)
            before, cpu = counter.snapshot(), time.process_time()
            for run in range(runs):
                for mode in modes:
                    finals[mode].runs.append([])
                    dones[mode].runs.append([])
                floor_timing.runs.append([])
                for _ in range(per_run):
                    for mode in modes:  # alternate so drift hits both alike
                        chat, position = chats.next(mode, run)
                        to_final, to_done = await one_turn(runtime, ends, mode, chat)
                        finals[mode].runs[-1].append(to_final)
                        dones[mode].runs[-1].append(to_done)
                        positions[mode].setdefault(position, []).append(to_final)
                        # The floor under the same conditions as the turns (disk and CPU load drift).
                        floor_timing.runs[-1] += await floor.time_commits(FLOOR_BETWEEN_TURNS)
            cpu = time.process_time() - cpu
            await marks_written(runtime)  # already awaited turn by turn; a safety net
            counts = counter.snapshot() - before
            stages = await stage_timings(runtime, chats.used)
    finally:
        counter.close()
        await floor.close()
    figures = [TurnFigures(mode, finals[mode], dones[mode], positions[mode]) for mode in modes]
    return TurnBench(figures, per_run * runs * len(modes), session_turns, counts, cpu, stages,
                     floor_timing, not ends.traces_hooked)


class Chats:
    """A fresh chat (session) every `session_turns` turns, per mode and run, so the
    sessions stay as short as consolidation keeps them in use (the default
    threshold of 40 messages is 20 turns)."""

    def __init__(self, session_turns: int) -> None:
        self.session_turns = session_turns
        self._done: Counter[tuple[bool, int]] = Counter()
        self.used: list[str] = []

    def next(self, stream: bool, run: int) -> tuple[str, int]:
        n = self._done[(stream, run)]
        self._done[(stream, run)] += 1
        chat = f"{'stream' if stream else 'plain'}-r{run}-s{n // self.session_turns}"
        if n % self.session_turns == 0:
            self.used.append(chat)
        return chat, n % self.session_turns


async def one_turn(runtime: Runtime, ends: TurnEnds, stream: bool, chat_id: str) -> tuple[float, float]:
    """Seconds from publishing the user message to the FINAL, and to the turn's end (trace recorded)."""
    started = time.perf_counter()
    await runtime.bus.publish_inbound(
        InboundEvent(channel=CHANNEL, chat_id=chat_id, sender_id="bench", text=QUESTION, stream=stream)
    )
    while (out := await runtime.bus.next_outbound(CHANNEL)).kind is not OutboundKind.FINAL:
        if out.kind is OutboundKind.ERROR:
            raise RuntimeError(f"turn failed: {out.text}")
    to_final = time.perf_counter() - started
    await ends.trace_recorded(out.turn_id)  # the trace is recorded after the final is published
    to_done = time.perf_counter() - started
    # Untimed: the delivery mark, written in a batch off the turn's path, so that
    # the next turn and the floor start on a quiet runtime.
    await ends.marked(out.delivery_id)
    return to_final, to_done


async def marks_written(runtime: Runtime, timeout_s: float = 10.0) -> float:
    """Seconds until no answer of the bench's channel awaits its delivery mark."""
    started = time.perf_counter()
    undelivered: Callable[..., Awaitable[list[Any]]] | None = getattr(
        getattr(runtime.deliveries, "store", None), "undelivered", None)
    if undelivered is None:
        await asyncio.sleep(0.2)
        return time.perf_counter() - started
    async with asyncio.timeout(timeout_s):
        while await undelivered([CHANNEL]):
            await asyncio.sleep(0.001)
    return time.perf_counter() - started


async def stage_timings(runtime: Runtime, chats: list[str]) -> dict[str, list[float]]:
    """Each stage's duration (ms) over the timed turns, from their traces."""
    stages: dict[str, list[float]] = {}
    for chat in chats:
        for trace in await runtime.traces.for_session(f"{CHANNEL}:{chat}"):
            for stage in trace.detail.get("stages", []):
                stages.setdefault(stage["stage"], []).append(stage["duration_ms"])
    return stages


# --- report ------------------------------------------------------------------------------


def header(args: argparse.Namespace, directory: Path) -> None:
    print_header("Ember commit-cost benchmark", store_versions(), [
        ("files", f"{directory} (WAL, synchronous=FULL)"),
        ("settings", f"{args.runs} runs x {args.commits} commits per length; {args.turns} turns per mode,"
                     f" a new session every {args.session_turns} turns"),
    ], rerun_command(__file__))


def report_commits(floor: Timing, lengths: list[Timing], sessions: list[PrefilledSession]) -> None:
    print("\n1-2. Commit of one final answer (SqlSessionStore.append), microseconds")
    print(f"  {'session':>14} {'median':>9} {'p90':>9} {'min':>9}  {'x floor':>7}  {'load once':>9}")
    print(f"  {'sqlite3 floor':>14} {us(floor.median)} {us(floor.p90)} {us(floor.min)}  {1:7.2f}")
    for timing, s in zip(lengths, sessions):
        print(f"  {timing.label:>14} {us(timing.median)} {us(timing.p90)} {us(timing.min)}"
              f"  {timing.median / floor.median:7.2f}  {us(s.load_s)}")
    base, base_n = lengths[0], sessions[0].n
    for timing, s in zip(lengths, sessions):
        if s.n >= 10_000:
            ratio = timing.median / base.median
            print(f"  commit-cost ratio median({s.n:,}) / median({base_n:,}) = {ratio:.2f}"
                  f"   target <= {TARGET_RATIO}  {verdict(ratio <= TARGET_RATIO)}")
    if sessions[-1].n < 100_000:
        print("  (100,000 messages not measured in this run: run without --quick for the target's ratio)")


def report_turns(bench: TurnBench) -> None:
    floor = bench.floor
    budget = TARGET_X_FLOOR * floor.median
    print("\n3. Whole turn through the bus, zero-latency scripted model, microseconds")
    print(f"  {bench.turns} timed turns, half streamed; a new session every {bench.session_turns} turns;"
          " consolidation off;")
    print("  after each turn (untimed) its delivery mark is awaited, then one floor commit is timed")
    if bench.traces_polled:
        print("  (the end of a turn is found by polling its trace: 'to done' includes the polling)")
    print(f"  {'mode':>10} {'until':>9} {'median':>9} {'p90':>9}  {'x floor':>7}  target <= {TARGET_X_FLOOR:g} x floor")
    print(f"  {'sqlite3 floor':>20} {us(floor.median)} {us(floor.p90)}  {1:7.2f}"
          f"  (one durable commit, timed between the turns; budget {budget * 1e6:.0f} µs)")
    for f in bench.figures:
        mode = "stream" if f.stream else "no stream"
        for timing in (f.to_final, f.to_done):
            x = timing.median / floor.median
            print(f"  {mode:>10} {timing.label:>9} {us(timing.median)} {us(timing.p90)}  {x:7.2f}"
                  f"  {verdict(x <= TARGET_X_FLOOR)}")
    for f in bench.figures:
        second, last = f.by_position.get(1), f.by_position.get(max(f.by_position))
        if second and last and max(f.by_position) > 1:
            a, b = statistics.median(second), statistics.median(last)
            mode = "stream" if f.stream else "no stream"
            print(f"  {mode:>10}     drift to final: turn 2 of a session {a * 1e6:.0f},"
                  f" turn {max(f.by_position) + 1} {b * 1e6:.0f} (x{b / a:.2f})")
        first = f.by_position.get(0)
        if first:
            print(f"  {'':>10}     first turn of a session (creates it) {statistics.median(first) * 1e6:.0f}")

    cpu = bench.cpu_s / bench.turns
    print(f"\n  Where the time goes, per turn: CPU {cpu * 1e6:.0f} µs = {cpu / floor.median:.1f} x floor"
          " (this process, all threads, the bench's own part included)")
    if bench.stages:
        parts = ", ".join(f"{name} {statistics.median(values) * 1e3:.0f}" for name, values in bench.stages.items())
        print(f"    stages, from the turns' traces (median µs): {parts}")
    for f in bench.figures:
        gap = statistics.median(d - t for d, t in zip(f.to_done.flat, f.to_final.flat))
        print(f"    {'stream' if f.stream else 'no stream'}: final -> trace recorded {gap * 1e6:.0f} µs (median)")

    print(f"\n  Store round trips per turn, over all {bench.turns} timed turns (their delivery marks included):")
    for line in per_turn(bench.counts, bench.turns):
        print(f"    {line}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, help="runs per length and of turns (default 5, quick 3)")
    parser.add_argument("--commits", type=int, help="timed commits per length per run (default 200, quick 100)")
    parser.add_argument("--turns", type=int, help="timed turns per mode (default 300, quick 100)")
    parser.add_argument("--session-turns", type=int, default=20,
                        help="turns per session before the bench starts a new one (default 20: the window "
                             "the default consolidation threshold of 40 messages keeps)")
    parser.add_argument("--quick", action="store_true", help="skip 100,000 messages; fewer samples (< 30 s)")
    parser.add_argument("--dir", type=Path, help="where to create the temporary databases (default: system temp)")
    args = parser.parse_args()
    args.runs = args.runs or (3 if args.quick else 5)
    args.commits = args.commits or (100 if args.quick else 200)
    args.turns = args.turns or (100 if args.quick else 300)
    args.lengths = [10, 1_000, 10_000] + ([] if args.quick else [100_000])
    return args


async def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="ember-bench-", dir=args.dir) as tmp:
        directory = Path(tmp)
        without_user_config(os.environ, directory / "home")
        header(args, directory)
        load_before, started = os.getloadavg()[0], time.perf_counter()
        floor, lengths, sessions = await commit_bench(directory, args.lengths, args.runs, args.commits)
        report_commits(floor, lengths, sessions)
        report_turns(await turn_bench(directory, args.turns, args.runs, args.session_turns))
        print(f"\n  total {time.perf_counter() - started:.1f} s")
        # Other work on the machine moves the floor (its fsyncs) and the turns (the CPU) apart.
        busy_warning(load_before, "the x-floor ratios and PASS/MISS are unreliable; rerun on a quiet machine")


if __name__ == "__main__":
    asyncio.run(main())
