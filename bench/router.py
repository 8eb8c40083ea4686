"""What the model router costs, and how fast it falls over.

    .venv/bin/python bench/router.py [--calls N] [--runs R] [--timeout S]

1. Overhead per call: `complete()` on an in-process model that answers at
   once, bare and behind a ModelRouter (its breaker, its bookkeeping), in
   alternating blocks; the difference of the per-run medians. Target < 0.2 ms.
2. Falling over from a primary that refuses connections: a call through
   [dead, backup] against the backup alone, both real HTTP clients (the
   backup is the tests' scripted OpenAI-compatible server on 127.0.0.1), each
   call with a fresh breaker so that every one tries the dead primary first.
   Target: < 50 ms added.
3. A primary that accepts the connection and never answers: the first call
   pays the configured timeout once (a model with a fallback is not retried),
   the breaker opens, and the next calls skip it: their added time is shown
   beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import busy_warning, print_header, rerun_command, verdict

from ember.core.messages import Message
from ember.models.base import ModelClient, ModelReply, complete
from ember.models.openai_compat import OpenAICompatibleModel
from ember.models.router import CircuitBreaker, ModelRouter, Route
from ember.models.scripted import FunctionModel
from tests.modelserver import MODEL, Reply, serving

HELLO = [Message.user("hello")]
OVERHEAD_TARGET_S = 0.0002
FALLOVER_TARGET_S = 0.050
BLOCK = 200  # calls per block of the overhead rounds


def closed_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/v1"


def http_client(url: str, timeout_s: float = 10.0) -> OpenAICompatibleModel:
    return OpenAICompatibleModel(model=MODEL, base_url=url, api_key="bench", timeout_s=timeout_s, max_attempts=1)


async def per_call(model: ModelClient, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await complete(model, HELLO)
    return (time.perf_counter() - started) / calls


async def overhead(calls: int, runs: int) -> tuple[float, float]:
    """(bare, routed) seconds per call, medians over the runs."""
    answer = ModelReply(text="ok")
    bare = FunctionModel(lambda messages, tools: answer, chunk_size=64)
    routed = ModelRouter("main", [Route("only", bare)])
    bare_runs, routed_runs = [], []
    for _ in range(runs):
        bare_s = routed_s = 0.0
        for _ in range(max(1, calls // BLOCK)):  # alternating blocks: drift hits both alike
            bare_s += await per_call(bare, BLOCK)
            routed_s += await per_call(routed, BLOCK)
        blocks = max(1, calls // BLOCK)
        bare_runs.append(bare_s / blocks)
        routed_runs.append(routed_s / blocks)
    return statistics.median(bare_runs), statistics.median(routed_runs)


async def fallover(calls: int) -> tuple[float, float]:
    """(backup alone, through a dead primary first) seconds per call, medians; every call on
    fresh clients (a new connection each), so both sides pay the same set-up."""
    with serving() as backup:
        backup.responder = lambda body: Reply(text="from the backup")
        dead_url = closed_port()
        alone, through = [], []
        for _ in range(calls):
            alone_model = http_client(backup.base_url)
            started = time.perf_counter()
            await complete(alone_model, HELLO)
            alone.append(time.perf_counter() - started)
            await alone_model.aclose()
            router = ModelRouter("main", [Route("dead", http_client(dead_url), None, CircuitBreaker()),
                                          Route("backup", http_client(backup.base_url))])
            started = time.perf_counter()
            await complete(router, HELLO)
            through.append(time.perf_counter() - started)
            await router.aclose()
    return statistics.median(alone), statistics.median(through)


async def silent_primary(timeout_s: float, calls: int) -> tuple[float, list[float]]:
    """(backup alone, each call's time through a primary that never answers), seconds."""
    with serving() as backup, socket.socket() as silent:
        backup.responder = lambda body: Reply(text="from the backup")
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        backup_model = http_client(backup.base_url)
        await complete(backup_model, HELLO)
        started = time.perf_counter()
        await complete(backup_model, HELLO)
        alone = time.perf_counter() - started
        slow = http_client(f"http://127.0.0.1:{silent.getsockname()[1]}/v1", timeout_s=timeout_s)
        router = ModelRouter("main", [Route("silent", slow), Route("backup", backup_model)])
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            await complete(router, HELLO)
            times.append(time.perf_counter() - started)
        await router.aclose()
    return alone, times


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4_000, help="calls per run of the overhead figure")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=2.0, help="the silent primary's timeout, s")
    args = parser.parse_args()
    print_header("Ember model router", "ember.models.router over OpenAICompatibleModel and FunctionModel", [
        ("settings", f"{args.runs} runs x {args.calls} calls (overhead); 30 fall-overs; timeout {args.timeout:g} s"),
    ], rerun_command(__file__))
    load_before = os.getloadavg()[0]
    logging.getLogger("ember.models.router").setLevel(logging.ERROR)  # each fall-over logs a warning

    bare, routed = await overhead(args.calls, args.runs)
    added = routed - bare
    print(f"\n1. overhead per call: bare {bare * 1e6:.1f} µs, routed {routed * 1e6:.1f} µs, added"
          f" {added * 1e6:.1f} µs  < {OVERHEAD_TARGET_S * 1e6:.0f} µs: {verdict(added < OVERHEAD_TARGET_S)}")

    alone, through = await fallover(30)
    added = through - alone
    print(f"2. primary refuses connections: backup alone {alone * 1e3:.2f} ms, through the dead primary"
          f" {through * 1e3:.2f} ms, added {added * 1e3:.2f} ms (median of 30)  < {FALLOVER_TARGET_S * 1e3:.0f} ms:"
          f" {verdict(added < FALLOVER_TARGET_S)}")

    alone, times = await silent_primary(args.timeout, 4)
    first, rest = times[0] - alone, [t - alone for t in times[1:]]
    once = abs(first - args.timeout) < 0.5 * args.timeout
    skipped = max(rest) < FALLOVER_TARGET_S
    print(f"3. primary never answers (timeout {args.timeout:g} s): the first call adds {first:.2f} s, the next ones"
          f" {', '.join(f'{r * 1e3:.1f} ms' for r in rest)} (its breaker is open): the timeout once, then skipped:"
          f" {verdict(once and skipped)}")
    busy_warning(load_before, "the latencies are inflated; rerun on a quiet machine")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
