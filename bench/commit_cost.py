"""What a turn's commit costs, and whether it grows with the session (DESIGN.md §4).

    .venv/bin/python bench/commit_cost.py [--runs N] [--commits N] [--turns K] [--quick] [--dir PATH]

1. Commit cost: `SqlSessionStore.append` of one final answer (a real durable
   transaction, WAL, synchronous=FULL) on sessions pre-filled to 10 ... 100,000
   messages. The lengths take turns in blocks of 10 commits (round-robin) so
   drift hits all alike; each run starts from exactly n messages. Target: median(n)/median(10) <= 1.2.
2. The floor: one single-row INSERT in its own transaction with the stdlib
   sqlite3 module, same settings, same directory, in the same round-robin.
3. Whole turns through the bus with a zero-latency scripted model, with and
   without streaming: latency to the FINAL event, latency until the turn has
   finished (trace recorded), and the store statements each turn issues.

Medians are medians of per-run medians; p90 likewise; min is over all samples.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import aiosqlite
import sqlalchemy
from sqlalchemy import delete, event, insert, update

from ember.app import Runtime, build_runtime, running
from ember.config import Settings
from ember.core.events import InboundEvent, OutboundKind
from ember.core.messages import Message, Session
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store import schema
from ember.store.database import Database
from ember.store.sessions import SqlSessionStore

TARGET_RATIO = 1.2
ANSWER = "Here is the final answer to your question, in a couple of plain sentences. " * 3
QUESTION = "Could you look into this for me and tell me what you find? " * 2
PREFILL_BATCH = 20_000
WARMUP = 5
BLOCK = 10  # commits per length before the round-robin moves on
CHANNEL = "bench"


@dataclass
class Timing:
    """Samples in seconds, one list per run."""

    label: str
    runs: list[list[float]] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(statistics.median(run) for run in self.runs)

    @property
    def p90(self) -> float:
        return statistics.median(_p90(run) for run in self.runs)

    @property
    def min(self) -> float:
        return min(min(run) for run in self.runs)


def _p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10)[-1] if len(samples) > 1 else samples[0]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:9.0f}"


# --- 1. commit cost at several session lengths ------------------------------------------


class PrefilledSession:
    """A session of exactly `n` messages in its own fresh database."""

    def __init__(self, directory: Path, n: int) -> None:
        self.n = n
        self.key = f"{CHANNEL}:len{n}"
        self.db = Database(directory / f"session-{n}.db")
        self.store = SqlSessionStore(self.db)
        self.session = Session(key=self.key)
        self.load_s = 0.0

    async def open(self) -> None:
        await self.db.open()
        now = time.time()
        for start in range(0, self.n, PREFILL_BATCH):
            rows = [_prefill_row(self.key, seq, now) for seq in range(start, min(start + PREFILL_BATCH, self.n))]
            async with self.db.write() as conn:
                await conn.execute(insert(schema.messages), rows)
        async with self.db.write() as conn:
            await conn.execute(
                insert(schema.sessions).values(key=self.key, next_seq=self.n, last_consolidated=0,
                                               metadata_json="{}", created_at=now, updated_at=now)
            )
        checkpoint(self.db.path)
        await self.store.list_sessions()  # opens the read connection, so the load below times only itself
        started = time.perf_counter()
        self.session = await self.store.load(self.key)
        self.load_s = time.perf_counter() - started
        assert len(self.session.messages) == self.n == self.session.next_seq

    async def reset(self) -> None:
        """Back to exactly n messages, on disk and in memory, WAL checkpointed."""
        m, s = schema.messages, schema.sessions
        async with self.db.write() as conn:
            await conn.execute(delete(m).where(m.c.session_key == self.key, m.c.seq >= self.n))
            await conn.execute(update(s).where(s.c.key == self.key).values(next_seq=self.n))
        checkpoint(self.db.path)
        del self.session.messages[self.n:]
        self.session.next_seq = self.n

    async def time_commits(self, count: int) -> list[float]:
        samples = []
        for _ in range(count):
            message = Message.assistant(ANSWER, turn_id=f"turn-{self.session.next_seq}")
            started = time.perf_counter()
            await self.store.append(self.session, [message])
            samples.append(time.perf_counter() - started)
        return samples


def _prefill_row(key: str, seq: int, now: float) -> dict[str, object]:
    user = seq % 2 == 0
    return {
        "session_key": key, "seq": seq, "role": "user" if user else "assistant",
        "content": QUESTION if user else ANSWER, "tool_calls": None, "tool_call_id": None,
        "reasoning": None, "turn_id": f"prefill-{seq // 2}", "created_at": now,
    }


def checkpoint(path: Path) -> None:
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


# --- 2. the floor: one durable SQLite commit ---------------------------------------------


class Floor:
    """A single-row INSERT in its own transaction, stdlib sqlite3, WAL, synchronous=FULL."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "floor.db"
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")

    async def reset(self) -> None:
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

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
        await target.open()
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
        floor.conn.close()
        for s in sessions:
            await s.db.close()
    return targets[0][0], [timing for timing, _ in targets[1:]], sessions


# --- 3. whole turns through the bus ------------------------------------------------------


class StatementCounter:
    """Statements and commits on both ways into the Database: the SQLAlchemy
    engines (write()/read()) and the one-hop threads (run_write()/run_read()).

    BEGIN counts as a statement, COMMIT as a commit, on both.
    """

    NAMES = ("write statements", "read statements", "write commits", "read commits")

    def __init__(self, db: Database) -> None:
        self.counts: Counter[str] = Counter()
        self._db = db
        for side, engine in (("write", db._writer.sync_engine), ("read", db._reader.sync_engine)):
            event.listen(engine, "before_cursor_execute", self._on(f"{side} statements"))
            event.listen(engine, "commit", self._on(f"{side} commits"))

    async def attach(self) -> None:
        """Trace the one-hop threads' connections (set on their own thread, as sqlite3 requires)."""
        for side, direct in (("write", self._db._direct_writer), ("read", self._db._direct_reader)):
            await direct.read(lambda conn, side=side: conn.set_trace_callback(self._traced(side)))

    def _on(self, name: str) -> Callable[..., None]:
        def count(*_args: object) -> None:
            self.counts[name] += 1
        return count

    def _traced(self, side: str) -> Callable[[str], None]:
        def count(sql: str) -> None:
            if sql == "COMMIT":
                self.counts[f"{side} commits"] += 1
            elif sql != "ROLLBACK":
                self.counts[f"{side} statements"] += 1
        return count


@dataclass
class TurnFigures:
    stream: bool
    to_final: Timing
    to_done: Timing
    per_turn: dict[str, float]
    first_last: tuple[float, float]  # median to_final over the first and the last tenth of the turns


async def turn_bench(directory: Path, turns: int, runs: int) -> list[TurnFigures]:
    settings = Settings(home=directory / "home", consolidation_threshold=10**9, sqlite_synchronous="FULL")
    model = FunctionModel(lambda _messages, _tools: ModelReply(text=ANSWER), chunk_size=1 << 20)
    runtime = await build_runtime(settings, model)
    counter = StatementCounter(runtime.db)
    await counter.attach()
    modes = (False, True)
    finals = {mode: Timing("to final") for mode in modes}
    dones = {mode: Timing("to done") for mode in modes}
    counts = {mode: Counter[str]() for mode in modes}
    per_run = max(1, turns // runs)
    async with running(runtime):
        for mode in modes:
            for _ in range(WARMUP):
                await one_turn(runtime, mode)
        for _ in range(runs):
            for mode in modes:
                finals[mode].runs.append([])
                dones[mode].runs.append([])
            for _ in range(per_run):
                for mode in modes:  # alternate so drift and session growth hit both alike
                    before = counter.counts.copy()
                    to_final, to_done = await one_turn(runtime, mode)
                    finals[mode].runs[-1].append(to_final)
                    dones[mode].runs[-1].append(to_done)
                    counts[mode] += counter.counts - before
    figures = []
    for mode in modes:
        flat = [s for run in finals[mode].runs for s in run]
        tenth = max(1, len(flat) // 10)
        figures.append(TurnFigures(
            stream=mode, to_final=finals[mode], to_done=dones[mode],
            per_turn={name: counts[mode][name] / len(flat) for name in StatementCounter.NAMES},
            first_last=(statistics.median(flat[:tenth]), statistics.median(flat[-tenth:])),
        ))
    return figures


async def one_turn(runtime: Runtime, stream: bool) -> tuple[float, float]:
    """Seconds from publishing the user message to the FINAL, and to the turn's end."""
    chat_id = "stream" if stream else "plain"
    started = time.perf_counter()
    await runtime.bus.publish_inbound(
        InboundEvent(channel=CHANNEL, chat_id=chat_id, sender_id="bench", text=QUESTION, stream=stream)
    )
    while (out := await runtime.bus.next_outbound(CHANNEL)).kind is not OutboundKind.FINAL:
        if out.kind is OutboundKind.ERROR:
            raise RuntimeError(f"turn failed: {out.text}")
    to_final = time.perf_counter() - started
    await asyncio.gather(*runtime.loop._turns)  # the trace is recorded after the final is published
    return to_final, time.perf_counter() - started


# --- report ------------------------------------------------------------------------------


def header(args: argparse.Namespace, directory: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    command = shlex.join([os.path.relpath(sys.executable, root), "bench/commit_cost.py", *sys.argv[1:]])
    print("Ember commit-cost benchmark")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"  machine : {os.cpu_count()} CPUs, {platform.platform()}, load average {load}")
    print(f"  python  : {platform.python_version()}, sqlite {sqlite3.sqlite_version}, "
          f"sqlalchemy {sqlalchemy.__version__}, aiosqlite {aiosqlite.__version__}")
    print(f"  files   : {directory} (WAL, synchronous=FULL)")
    print(f"  settings: {args.runs} runs x {args.commits} commits per length, {args.turns} turns per mode")
    print(f"  rerun   : cd {root} && {command}")


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
            verdict = "ok" if ratio <= TARGET_RATIO else "OVER TARGET"
            print(f"  median({s.n:,}) / median({base_n:,}) = {ratio:.2f}   target <= {TARGET_RATIO}  {verdict}")


def report_turns(figures: list[TurnFigures], floor: Timing) -> None:
    print("\n3. Whole turn through the bus, zero-latency model, microseconds")
    print(f"  {'mode':>10} {'':>9} {'median':>9} {'p90':>9}  {'x floor':>7}")
    for f in figures:
        mode = "stream" if f.stream else "no stream"
        for timing in (f.to_final, f.to_done):
            print(f"  {mode:>10} {timing.label:>9} {us(timing.median)} {us(timing.p90)}"
                  f"  {timing.median / floor.median:7.2f}")
        first, last = f.first_last
        print(f"  {'':>10} {'drift':>9} to final: first tenth {us(first).strip()}, last tenth {us(last).strip()}"
              f" (x{last / first:.2f}; the session grows by 2 messages a turn)")
        n = f.per_turn
        print(f"  {'':>10} {'per turn':>9} statements: {n['write statements']:.1f} write"
              f" + {n['read statements']:.1f} read;"
              f" commits: {n['write commits']:.1f} write + {n['read commits']:.1f} read")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, help="runs per length (default 5, quick 3)")
    parser.add_argument("--commits", type=int, help="timed commits per length per run (default 200, quick 100)")
    parser.add_argument("--turns", type=int, help="timed turns per mode (default 300, quick 100)")
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
        for name in [n for n in os.environ if n.startswith(("EMBER_", "OPENAI_"))]:
            del os.environ[name]  # no user configuration leaks into the settings
        os.environ["EMBER_HOME"] = str(directory / "home")
        header(args, directory)
        started = time.perf_counter()
        floor, lengths, sessions = await commit_bench(directory, args.lengths, args.runs, args.commits)
        report_commits(floor, lengths, sessions)
        report_turns(await turn_bench(directory, args.turns, args.runs), floor)
        print(f"\n  total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    asyncio.run(main())
