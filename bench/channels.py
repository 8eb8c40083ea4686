"""Webhooks end to end, and the scheduler firing many due tasks at once.

    .venv/bin/python bench/channels.py [--requests N] [--concurrency C] [--tasks T] [--runs R]

1. Webhooks: a real `ember serve` with a signed webhook whose answers go to an
   outbound target (a receiver of this script's own, on 127.0.0.1), the model
   the tests' scripted OpenAI-compatible server (both in a child process of
   their own, off the measuring process's GIL). N signed requests from C
   concurrent clients: accepted per second (signature checked, the message
   stored, 202), and answered per second (until the last signed answer reached
   the receiver). The baseline in the same run: `GET /healthz` at the same
   concurrency, the gateway's HTTP floor. Every answer must arrive exactly once.
2. Scheduler: T one-time tasks all due at one moment, in a fresh store; the
   scheduler claims and publishes them while a consumer takes them off the bus.
   Lateness (publish time - due time) p50 / p99, and the checks: none fired
   twice, none lost, every run recorded. The baseline: the same number of run
   messages written by one bare transaction (the store's floor).

Medians over R runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from common import ROOT, busy_warning, print_header, quantile, rerun_command
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.bus.memory import InProcessBus
from ember.channels.cron import Scheduler
from ember.channels.webhooks.signing import sign_standard, standard_key
from ember.core.events import InboundEvent
from ember.core.schedule import Schedule, ScheduleKind
from ember.core.tasks import Task, new_task_id
from ember.store.deliveries import accept_inbound
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tasks import SqlTaskStore
from ember.store.tx import Statement, Tx
from tests.gatewayproc import GatewayProcess, free_port, gateway_env
from tests.loopback import LoopbackServer, started
from tests.modelserver import MODEL, Reply, serving

SECRET = "whsec_" + base64.b64encode(b"bench-webhook-key-of-32-bytes-ok").decode()
KEY = standard_key(SECRET, "bench")


class Receiver:
    """The outbound target: counts the answers per message; `GET /stats` says what it has."""

    def __init__(self) -> None:
        self.ids: Counter[str] = Counter()
        self.last_at = 0.0
        self._server = LoopbackServer(Starlette(routes=[Route("/hook", self._hook, methods=["POST"]),
                                                        Route("/stats", self._stats, methods=["GET"])]), "receiver")

    @property
    def url(self) -> str:
        return f"{self._server.origin}/hook"

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    async def _hook(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.ids[body["reply_to"]] += 1
        self.last_at = time.time()
        return JSONResponse({"ok": True})

    async def _stats(self, request: Request) -> Response:
        prefix = request.query_params.get("prefix", "")
        return JSONResponse({"ids": {k: v for k, v in self.ids.items() if k.startswith(prefix)},
                             "last_at": self.last_at})


def serve_peers() -> None:
    """The child process: the model server and the receiver, off the measuring process's GIL."""
    with serving() as model, started(Receiver()) as receiver:
        model.responder = lambda body: Reply(text="ack")
        print(json.dumps({"model": model.base_url, "receiver": receiver.url}), flush=True)
        while True:
            time.sleep(3600)


async def _fire(client: httpx.AsyncClient, count: int, concurrency: int, request: object) -> float:
    """Seconds for `count` calls of `request(client, i)`, `concurrency` at a time."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            await request(client, queue.get_nowait())  # type: ignore[operator]

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - began


async def webhook_round(gateway: GatewayProcess, receiver_url: str, requests: int,
                        concurrency: int) -> tuple[float, float, float, Counter[str]]:
    """(accepted/s, answered/s, healthz/s, answers per message id)."""
    tag = uuid.uuid4().hex[:6]
    stats_url = receiver_url.replace("/hook", "/stats")

    async def signed(client: httpx.AsyncClient, i: int) -> None:
        body = json.dumps({"text": f"event {i}", "repo": f"r{i % 50}"}).encode()
        message_id, now = f"{tag}-{i}", int(time.time())
        response = await client.post("/webhooks/bench", content=body, headers={
            "webhook-id": message_id, "webhook-timestamp": str(now), "content-type": "application/json",
            "webhook-signature": sign_standard(KEY, message_id, now, body)})
        if response.status_code != 202:
            raise RuntimeError(f"webhook answered {response.status_code}: {response.text}")

    async def health(client: httpx.AsyncClient, i: int) -> None:
        (await client.get("/healthz")).raise_for_status()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=gateway.base_url, limits=limits, timeout=60) as client:
        await _fire(client, min(requests, 200), concurrency, health)  # warm-up: connections, first requests
        floor = await _fire(client, requests, concurrency, health)
        began = time.time()
        accepted = await _fire(client, requests, concurrency, signed)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            stats = (await client.get(stats_url, params={"prefix": f"{tag}-"})).json()
            if len(stats["ids"]) >= requests:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # anything sent twice would arrive meanwhile
        stats = (await client.get(stats_url, params={"prefix": f"{tag}-"})).json()
    answered = stats["last_at"] - began
    return requests / accepted, requests / answered, requests / floor, Counter(stats["ids"])


def webhook_config(receiver_url: str, embedding: str) -> str:
    return f"""
web_fetch_allowed_hosts = ["127.0.0.1"]
consolidation_threshold = 100000
embedding_model = "{embedding}"

[webhooks.bench]
secret = "{SECRET}"
message = "{{text}}"
session = "{{repo}}"
reply_to = "sink"

[outbound.sink]
url = "{receiver_url}"
"""


async def scheduler_round(tasks: int) -> tuple[list[float], int, int, int, float]:
    """(lateness of each run, runs published, distinct runs, runs recorded, floor seconds)."""
    with tempfile.TemporaryDirectory(prefix="ember-bench-cron-") as home:
        db = SqliteDatabase(Path(home) / "ember.db")
        await db.open()
        try:
            due = time.time() + 3.0
            store = SqlTaskStore(db, clock=lambda: due - 1)
            for start in range(0, tasks, 1000):
                await asyncio.gather(*(store.add(Task(id=new_task_id(), identity="bench", prompt=f"run {i}",
                                                      schedule=Schedule(ScheduleKind.AT, f"{due:.3f}"), reply=None))
                                       for i in range(start, min(tasks, start + 1000))))
            bus = InProcessBus()
            scheduler = Scheduler(bus, SqlTaskStore(db), poll_s=0.2)
            lateness: list[float] = []
            seen: Counter[str] = Counter()

            async def consume() -> None:
                while True:
                    event = await bus.next_inbound()
                    lateness.append(time.time() - due)
                    seen[event.message_id or ""] += 1

            consumer = asyncio.create_task(consume())
            await scheduler.start()
            while len(lateness) < tasks and time.time() < due + 120:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a second firing of anything would show up meanwhile
            await scheduler.stop()
            consumer.cancel()
            recorded = await db.run_read(lambda tx: tx.execute(Statement(
                "SELECT COUNT(*) FROM task_runs WHERE outcome = 'run'")).fetchone()[0])
            # The floor: as many run messages kept by one bare transaction.
            events = [InboundEvent(channel="floor", chat_id=str(i), sender_id="b", text="x", message_id=str(i))
                      for i in range(tasks)]

            def keep_all(tx: Tx) -> None:
                for event in events:
                    accept_inbound(tx, event, 0.0)

            floor_started = time.perf_counter()
            await db.run_write(keep_all)
            floor = time.perf_counter() - floor_started
        finally:
            await db.close()
    return lateness, sum(seen.values()), len(seen), recorded, floor


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--embedding", default="e5-small", choices=["e5-small", "hashing", "none"],
                        help="the gateway's embedding_model: e5-small (the default) embeds every message it "
                             "archives, on the same cores")
    parser.add_argument("--serve-peers", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_peers:
        serve_peers()
    print_header("Ember channels: webhooks end to end, the scheduler under 10,000 due tasks",
                 f"httpx {httpx.__version__}",
                 [("webhooks", f"{args.requests} signed requests, {args.concurrency} concurrent, {args.runs} runs, "
                               f"embedding_model {args.embedding}"),
                  ("tasks", f"{args.tasks} due at one moment, {args.runs} runs")],
                 rerun_command(__file__))
    load_before = os.getloadavg()[0]
    ok = True
    peers = subprocess.Popen([sys.executable, __file__, "--serve-peers"], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert peers.stdout is not None
        urls = json.loads(peers.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp) / "home"
            home.mkdir()
            (home / "ember.toml").write_text(webhook_config(urls["receiver"], args.embedding))
            env = gateway_env(home, None, None, EMBER_MODEL_BASE_URL=urls["model"], EMBER_MODEL=MODEL,
                              EMBER_MODEL_API_KEY="bench", EMBER_GATEWAY_RATE_PER_MINUTE="1000000",
                              EMBER_GATEWAY_RATE_BURST="100000")
            gateway = GatewayProcess(env, free_port()).wait_ready()
            try:
                rounds = [await webhook_round(gateway, urls["receiver"], args.requests, args.concurrency)
                          for _ in range(args.runs)]
            finally:
                gateway.stop()
    finally:
        peers.terminate()
        peers.wait(timeout=10)
    accepted = statistics.median(r[0] for r in rounds)
    answered = statistics.median(r[1] for r in rounds)
    floor = statistics.median(r[2] for r in rounds)
    print("\nWebhooks (median of runs)")
    print(f"  accepted : {accepted:8.0f} requests/s  (signature, store, 202)")
    print(f"  answered : {answered:8.0f} requests/s  (the signed answer at the receiver)")
    print(f"  /healthz : {floor:8.0f} requests/s  baseline; accepted / baseline = {accepted / floor:.2f}")
    for number, (_, _, _, ids) in enumerate(rounds, 1):
        twice, lost = sum(1 for n in ids.values() if n > 1), args.requests - len(ids)
        print(f"  run {number}: answered twice {twice}, never answered {lost}")
        ok &= twice == 0 and lost == 0

    print("\nScheduler (median of runs)")
    results = [await scheduler_round(args.tasks) for _ in range(args.runs)]
    p50 = statistics.median(quantile(r[0], 0.5) for r in results)
    p99 = statistics.median(quantile(r[0], 0.99) for r in results)
    floor_s = statistics.median(r[4] for r in results)
    last = statistics.median(max(r[0]) for r in results)
    print(f"  lateness : p50 {p50 * 1000:7.0f} ms, p99 {p99 * 1000:7.0f} ms, last {last * 1000:7.0f} ms")
    print(f"  floor    : {floor_s * 1000:7.0f} ms to keep {args.tasks} run messages in one bare transaction; "
          f"last / floor = {last / floor_s:.1f}")
    for number, (_, published, distinct, recorded, _) in enumerate(results, 1):
        print(f"  run {number}: published {published}, distinct {distinct}, recorded {recorded}, "
              f"twice {published - distinct}, lost {args.tasks - distinct}")
        ok &= published == distinct == recorded == args.tasks
    print(f"\n{'PASS' if ok else 'FAIL'}: every answer and every run exactly once")
    busy_warning(load_before, "the figures are slower than this machine can do", own_cores=2.0)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("EMBER_HOME", tempfile.mkdtemp(prefix="ember-bench-"))
    sys.exit(asyncio.run(main()))
