"""kill -9 in a scaled-out Ember: 3 workers and 2 gateways on one PostgreSQL and one Redis,
about 50 conversations at once, workers killed mid-turn, between a tool call and its result,
around a commit, during consolidation and at random, and a gateway mid-stream, each restarted at
once; every invariant of the crash harness (I1-I6, tests/crash/harness.py) is checked on the
PostgreSQL store and on what the clients received, and must hold without a single violation.

The seed is printed; rerun one with EMBER_CRASH_SEED=<seed>; EMBER_CLUSTER_CRASH_S sets how
long the kills go on (default 60 s).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.crash.cluster_harness import INVARIANTS, ClusterCrashConfig, run_cluster_crash
from tests.pgserver import PgServer
from tests.redisserver import RedisServer

SEED = int(os.environ.get("EMBER_CRASH_SEED", "20240607"))
DURATION_S = float(os.environ.get("EMBER_CLUSTER_CRASH_S", "60"))


@pytest.fixture
def database(pg_server: PgServer) -> Iterator[str]:
    url = pg_server.fresh_database()
    yield url
    pg_server.drop_database(url)


def test_kill_9_across_a_cluster_loses_and_duplicates_nothing(tmp_path: Path, database: str,
                                                              redis_server: RedisServer) -> None:
    print(f"\ncluster crash test seed {SEED} (rerun with EMBER_CRASH_SEED={SEED})")
    report = run_cluster_crash(ClusterCrashConfig(workdir=tmp_path, database_url=database,
                                                  redis_url=redis_server.url, duration_s=DURATION_S, seed=SEED,
                                                  verbose=True))
    print(report.render())
    counts = report.counts
    # The run did what it claims: it killed workers and gateways, clients resent, turns were taken over.
    assert counts["kills"] >= 5
    assert any(counts.get(f"kills: {mode}", 0) for mode in ("worker mid-stream", "worker mid-tool-call",
                                                            "worker around a commit"))
    assert counts.get("kills: gateway mid-stream", 0) >= 1
    assert counts["resends (attempts after the first)"] > 0
    assert counts["logs: inbound entries taken over from a dead worker"] > 0
    # Every message got its final, and no invariant was violated even once.
    assert counts["turns answered (a final reached the client)"] == counts["turns sent (distinct message ids)"]
    assert report.violation_counts() == dict.fromkeys(INVARIANTS, 0), report.render(examples=20)
