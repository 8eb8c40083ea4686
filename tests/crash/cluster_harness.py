"""The crash harness (harness.py) on a scaled-out Ember: 3 workers and 2 gateways, each its own
process in its own home, on one PostgreSQL and one Redis (tests/cluster.py), under many
concurrent conversations; workers are killed with SIGKILL mid-turn, between a tool call and its
result, around the commit of a final, during a consolidation and at random, and a gateway
mid-stream; each killed process is restarted at once, in its home (a gateway on its port).

    report = run_cluster_crash(ClusterCrashConfig(workdir=tmp_path, database_url=url,
                                                  redis_url=redis.url, duration_s=60))
    assert not any(report.violation_counts().values())

What is reused from harness.py: the model server (slow, deterministic per message, with think
blocks, tool steps, consolidation and review answers) with one path per worker, so that a kill
aimed at a moment of a model call kills the worker that made it; the clients (each message sent
with its id until its final arrives, abandoned and resent, sometimes sent again once answered),
here through either gateway, whichever answers; and the checks of the invariants I1-I6, here on
the PostgreSQL store (read_pg_store) and on what the clients received.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ember.runtime.loop import NOT_RESUMED_TEXT
from tests.cluster import Cluster, Member, wait_all_ready
from tests.crash.harness import (
    HTTP_TIMEOUT,
    INVARIANTS,
    MODEL,
    NOTES,
    REVIEW_THRESHOLD,
    Checker,
    CrashConfig,
    CrashModelServer,
    CrashReport,
    SessionClient,
    StoreView,
    count_attempts,
    read_histories,
    read_pg_store,
)
from tests.modelserver import CALLER


@dataclass(slots=True, kw_only=True)
class ClusterCrashConfig:
    workdir: Path
    database_url: str
    redis_url: str
    duration_s: float = 60.0  # how long the kills go on
    sessions: int = 50
    workers: int = 3
    gateways: int = 2
    seed: int = 20240607
    kill_every_s: tuple[float, float] = (2.0, 4.0)
    worker_timeout_s: int = 3
    consolidation_threshold: int = 6
    consolidation_keep_recent: int = 2
    liveness_bound_s: float = 60.0
    trigger_timeout_s: float = 6.0
    settle_timeout_s: float = 45.0
    verbose: bool = False
    log: Callable[[str], None] = print


# Moments aimed at, with their weights, dealt from a shuffled deck.
MODES = {"worker mid-stream": 3, "worker mid-tool-call": 3, "worker around a commit": 2,
         "worker mid-consolidation": 3, "gateway mid-stream": 3, "worker at a random time": 1}


@dataclass(slots=True)
class Aim:
    """Kill, `delay_s` after the model server reaches (kind, point[, index]) in a call, the worker
    that made the call, or (`gateway`) one of the gateways."""

    mode: str
    kind: str
    point: str
    index: int = 0
    delay_s: float = 0.0
    gateway: bool = False
    victim: Member | None = None
    fired: asyncio.Event = field(default_factory=asyncio.Event)


class CallerSwitch:
    """The harness's kill switch (what its model server reports to), aimed at whichever member
    made the model call, or at a gateway."""

    def __init__(self, run: ClusterCrashRun) -> None:
        self._run = run
        self._aim: Aim | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def aim(self, aim: Aim, loop: asyncio.AbstractEventLoop) -> None:
        self._aim, self._loop = aim, loop

    def disarm(self) -> Aim | None:
        """The aim, if it had not fired yet."""
        aim, self._aim = self._aim, None
        return aim

    def reached(self, kind: str, point: str, index: int = 0) -> None:
        aim = self._aim
        if aim is None or aim.kind != kind or aim.point != point or (point == "chunk" and aim.index != index):
            return
        victim = self._run.gateway_victim() if aim.gateway else self._run.member(CALLER.get())
        if victim is None or not victim.alive or victim in self._run.restarting:
            return
        self._aim = None
        aim.victim = victim

        def fire() -> None:
            victim.signal(9)
            assert self._loop is not None
            self._loop.call_soon_threadsafe(aim.fired.set)

        if aim.delay_s <= 0:
            fire()
        else:
            asyncio.get_running_loop().call_later(aim.delay_s, fire)


class GatewayPool:
    """What the harness's clients use as their HTTP client: each request to a gateway picked at
    random (a dead one refuses the connection, and the client sends again, maybe to the other)."""

    def __init__(self, client: httpx.AsyncClient, gateways: list[Member], rng: random.Random) -> None:
        self._client = client
        self._gateways = gateways
        self._rng = rng

    def _url(self, path: str) -> str:
        return self._rng.choice(self._gateways).url(path)

    def stream(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._client.stream(method, self._url(path), **kwargs)

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self._client.post(self._url(path), **kwargs)

    async def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self._client.get(self._url(path), **kwargs)


class ClusterCrashRun:
    """Also what the harness's SessionClient reads: `config`, `stop_sending`, `http`,
    `past_liveness_bound`."""

    def __init__(self, config: ClusterCrashConfig) -> None:
        self.cluster_config = config
        # The clients' settings: the harness's defaults, this run's seed and bound.
        self.config = CrashConfig(workdir=config.workdir, seed=config.seed, sessions=config.sessions,
                                  liveness_bound_s=config.liveness_bound_s)
        self.rng = random.Random(config.seed)
        self.switch = CallerSwitch(self)
        self.model = CrashModelServer(config.seed, self.switch)  # type: ignore[arg-type]
        self.checker = Checker()
        self.counts: Counter[str] = Counter()
        self.stop_sending = asyncio.Event()
        self.clients = [SessionClient(self, i) for i in range(config.sessions)]  # type: ignore[arg-type]
        self.http: GatewayPool
        self.final_ready_at: float | None = None
        self.restarting: set[Member] = set()
        self._restarts: set[asyncio.Task[None]] = set()
        self._ready_s: list[float] = []
        self.cluster = Cluster(
            config.workdir / "cluster", database_url=config.database_url, redis_url=config.redis_url, model=None,
            keys=None, member_env=lambda name: {"EMBER_MODEL_BASE_URL": f"{self.model.origin}/{name}/v1"},
            EMBER_MODEL=MODEL, EMBER_MODEL_API_KEY="crash-key",
            EMBER_WORKER_TIMEOUT_S=str(config.worker_timeout_s),
            EMBER_CONSOLIDATION_THRESHOLD=str(config.consolidation_threshold),
            EMBER_CONSOLIDATION_KEEP_RECENT=str(config.consolidation_keep_recent),
            EMBER_REVIEW_TOOL_CALL_THRESHOLD=str(REVIEW_THRESHOLD),
            EMBER_MODEL_TIMEOUT_S="30", EMBER_GATEWAY_SHUTDOWN_GRACE_S="3")

    # -- what the clients and the switch ask

    def past_liveness_bound(self, since: float) -> bool:
        if self.final_ready_at is None:
            return False
        return time.monotonic() > max(since, self.final_ready_at) + self.config.liveness_bound_s

    def member(self, name: str | None) -> Member | None:
        return next((m for m in self.cluster.members if m.name == name), None)

    def gateway_victim(self) -> Member | None:
        """A gateway to kill, only while every gateway is up: one always takes the resends."""
        gateways = self.cluster.gateways
        if any(not g.alive or g in self.restarting for g in gateways):
            return None
        return self.rng.choice(gateways)

    # -- the run

    async def run(self) -> CrashReport:
        started = time.monotonic()
        config = self.cluster_config
        self.model.start()
        try:
            await asyncio.to_thread(self._start_cluster)
            limits = httpx.Limits(max_connections=config.sessions * 2 + 8)
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=limits) as client:
                self.http = GatewayPool(client, self.cluster.gateways, random.Random(config.seed + 1))
                tasks = [asyncio.create_task(c.run(), name=c.key) for c in self.clients]
                try:
                    await self._kill_loop(started)
                    self.stop_sending.set()
                    self._log(started, f"{self.counts['kills']} kills done; the clients finish their last messages")
                    await asyncio.wait_for(asyncio.gather(*tasks), timeout=config.liveness_bound_s + 60)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                view = await self._settle()
                histories = await read_histories(self.http, self.clients, self.checker)
            codes = await asyncio.to_thread(lambda: [m.terminate(timeout_s=30) for m in self.cluster.members])
            self.counts["members that did not stop cleanly on SIGTERM"] = sum(1 for code in codes if code != 0)
            view = await asyncio.to_thread(read_pg_store, config.database_url)
            assert view is not None, "the store is missing"
            sent = [message for client in self.clients for message in client.sent]
            self.checker.final(view, sent, histories)
            self._outcomes(view, sent)
        finally:
            self.cleanup()
        wall = time.monotonic() - started
        self.counts["wall time (s)"] = round(wall, 1)
        self.config.kills = self.counts["kills"]
        return CrashReport(self.config, dict(self.counts), self.checker.violations, wall)

    def cleanup(self) -> None:
        """Every process of the cluster stopped by its PID, and the model server. Idempotent."""
        self.cluster.stop()
        with contextlib.suppress(Exception):
            self.model.stop()

    def _start_cluster(self) -> None:
        config = self.cluster_config
        members = [self.cluster.add("worker", start=False) for _ in range(config.workers)]
        members += [self.cluster.add("gateway", start=False) for _ in range(config.gateways)]
        for member in members:  # what the model's tool steps read, in each worker's workspace
            workspace = member.home / "workspace"
            workspace.mkdir(parents=True, exist_ok=True)
            (workspace / "notes.txt").write_text(NOTES)
            member.spawn()
        wait_all_ready(members, timeout_s=90)

    def _log(self, started: float, line: str) -> None:
        self.cluster_config.log(f"[{time.monotonic() - started:6.1f}s] {line}")

    async def _kill_loop(self, started: float) -> None:
        config = self.cluster_config
        deck: list[str] = []
        until = time.monotonic() + config.duration_s
        loop = asyncio.get_running_loop()
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(*config.kill_every_s))
            if not deck:  # the first round has every moment once, so even a short run covers them all
                deck = list(MODES) if not self.counts["rounds dealt"] else [
                    mode for mode, weight in MODES.items() for _ in range(weight)]
                self.counts["rounds dealt"] += 1
                self.rng.shuffle(deck)
            mode = deck.pop()
            up = [w for w in self.cluster.workers if w.alive and w not in self.restarting]
            if not mode.startswith("gateway") and len(up) < 2:
                self.counts["kills put off: fewer than two workers up"] += 1
                deck.insert(0, mode)
                continue
            if mode.startswith("gateway") and self.gateway_victim() is None:
                self.counts["kills put off: a gateway is restarting"] += 1
                deck.insert(0, mode)
                continue
            if mode == "worker at a random time":
                victim = self.rng.choice(up)
                victim.signal(9)
                await self._killed(victim, mode, started)
                continue
            aim = self._aim(mode)
            self.switch.aim(aim, loop)
            try:
                await asyncio.wait_for(aim.fired.wait(), timeout=config.trigger_timeout_s)
            except TimeoutError:
                if self.switch.disarm() is None:  # taken just now: its kill is on its way
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(aim.fired.wait(), timeout=2.0)
            if aim.fired.is_set() and aim.victim is not None:
                await self._killed(aim.victim, mode, started)
            elif aim.gateway and (victim := self.gateway_victim()) is not None:
                self.counts["gateway kills that found no stream, at a random time instead"] += 1
                victim.signal(9)
                await self._killed(victim, mode, started)
            else:
                self.counts[f"aimed kills that found no moment: {mode}"] += 1
        if self._restarts:
            await asyncio.gather(*self._restarts)
        self.final_ready_at = time.monotonic()

    def _aim(self, mode: str) -> Aim:
        rng = self.rng
        if mode == "worker mid-stream":
            return Aim(mode, "final", "chunk", index=rng.randint(1, 4))
        if mode == "worker mid-tool-call":
            return Aim(mode, "tool", "done", delay_s=rng.uniform(0.0, 0.012))
        if mode == "worker around a commit":
            return Aim(mode, "final", "done", delay_s=rng.uniform(0.0, 0.015))
        if mode == "gateway mid-stream":
            return Aim(mode, "final", "chunk", index=rng.randint(1, 4), gateway=True)
        point = rng.choice(("request", "chunk", "done"))
        return Aim(mode, "consolidate", point, index=rng.randint(1, 4), delay_s=rng.uniform(0.0, 0.015))

    async def _killed(self, victim: Member, how: str, started: float) -> None:
        """After a kill: count it, look at the store (what must hold at any instant), restart it."""
        await asyncio.to_thread(victim.wait, 30)
        self.counts["kills"] += 1
        self.counts[f"kills: {how}"] += 1
        if self.cluster_config.verbose:
            self._log(started, f"kill {self.counts['kills']}: {victim.name} ({how})")
        self.restarting.add(victim)
        task = asyncio.create_task(self._restart(victim))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)
        view = await asyncio.to_thread(read_pg_store, self.cluster_config.database_url)
        if view is not None:
            self.checker.observe(view, f"after kill {self.counts['kills']} ({victim.name}, {how})")
            self.counts["jobs left running by a kill (taken over when their claim expires)"] += sum(
                1 for job in view.jobs if job["status"] == "running")

    async def _restart(self, member: Member) -> None:
        spawned = time.monotonic()
        try:
            await asyncio.to_thread(member.restart)
            self._ready_s.append(time.monotonic() - spawned)
            self.counts["restarts"] += 1
        finally:
            self.restarting.discard(member)

    async def _settle(self) -> StoreView:
        deadline = time.monotonic() + self.cluster_config.settle_timeout_s
        while True:
            view = await asyncio.to_thread(read_pg_store, self.cluster_config.database_url)
            assert view is not None
            jobs = view.job_counts()
            if (not jobs["pending"] and not jobs["running"]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        self.checker.observe(view, "after the final settle")
        for job in view.jobs:
            if job["status"] in ("running", "pending"):
                self.checker.add("I6", f"{job['kind']} job for {job['dedupe_key']} still {job['status']} "
                                       f"{self.cluster_config.settle_timeout_s:.0f}s after the last restart "
                                       f"(attempts {job['attempts']}, claimed by {job.get('claimed_by')}, "
                                       f"last error {job['last_error']})")
        return view

    def _outcomes(self, view: StoreView, sent: list[Any]) -> None:
        counts = self.counts
        count_attempts(counts, sent)
        if self._ready_s:
            counts["restart to ready, median (s)"] = round(statistics.median(self._ready_s), 2)
        rows = [r for rows in view.rows.values() for r in rows]
        counts["stored messages"] = len(rows)
        counts["notices committed (turns not resumed)"] = sum(1 for r in rows if r.content == NOT_RESUMED_TEXT)
        counts["consolidations (episodic summaries)"] = sum(1 for m in view.memories if m["kind"] == "episodic")
        for status, number in sorted(view.job_counts().items()):
            counts[f"jobs {status}"] = number
        for kind, number in sorted(self.model.stats.items()):
            counts[kind] = number
        logs = [line for m in self.cluster.members for line in m.ember_log().splitlines()]
        counts["logs: turns taken over from a paused or starved worker (LeaseLost)"] = sum(
            1 for line in logs if "was taken over by another process" in line)
        counts["logs: inbound entries taken over from a dead worker"] = sum(
            1 for line in logs if "took over" in line and "inbound entries" in line)
        counts["logs: answers found in the store by a gateway"] = sum(
            1 for line in logs if "came from the store" in line)
        counts["logs: ERROR lines"] = sum(1 for line in logs if " ERROR " in line)


def run_cluster_crash(config: ClusterCrashConfig) -> CrashReport:
    config.workdir.mkdir(parents=True, exist_ok=True)
    run = ClusterCrashRun(config)
    try:
        return asyncio.run(run.run())
    finally:
        run.cleanup()


__all__ = ["INVARIANTS", "ClusterCrashConfig", "run_cluster_crash"]
