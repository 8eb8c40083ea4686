"""A scaled-out Ember as real child processes on loopback, for the multi-process tests.

M gateways (`ember serve --workers 0`, each on its own port) and N workers
(`ember worker`) share one PostgreSQL database and one Redis namespace. Each
process has its own EMBER_HOME, as if on a machine of its own, and the same
API keys, model server and a short EMBER_WORKER_TIMEOUT_S (a process silent
that long is presumed dead, and the others take over its leases, job claims
and messages).

    with running_cluster(tmp_path, database_url=url, redis_url=redis.url, model=model,
                         keys={"alice": KEY}, gateways=2, workers=2) as cluster:
        g1, g2 = cluster.gateways
        w1, w2 = cluster.workers
        w1.kill()                 # kill -9 by its PID
        w2.pause(); w2.resume()   # SIGSTOP, SIGCONT
        w1.restart()              # a new process in the same home, waited for until ready

    def test_x(launch_cluster, ...):   # the fixture: `from tests.cluster import launch_cluster`
        cluster = launch_cluster(database_url=url, redis_url=..., model=..., keys=None, gateways=0, workers=2)

Readiness: a gateway answers /healthz; a worker has printed "Ember worker ... is taking
turns off the Redis bus". Every child is stopped by its PID when the block (or the test)
ends: SIGCONT, SIGTERM, then SIGKILL after a grace, whatever happened; every wait is bounded.
`query` reads the shared PostgreSQL; `Cluster.member_of` names the member behind a lease
holder (host-PID-suffix).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gatewayproc import EMBER, free_port, gateway_env
from tests.modelserver import ModelServer

READY_TIMEOUT_S = 45.0
STOP_TIMEOUT_S = 15.0
WORKER_READY = re.compile(r"Ember worker .* is taking turns off the Redis bus")
WORKER_TIMEOUT_S = 2

# Settings every member shares unless a test gives others: no e5 to load, no titles to ask the
# model for, no consolidation to interleave with the turns, quick retries of background jobs.
DEFAULTS = {
    "EMBER_WORKER_TIMEOUT_S": str(WORKER_TIMEOUT_S),
    "EMBER_EMBEDDING_MODEL": "hashing",
    "EMBER_SESSION_TITLES": "false",
    "EMBER_CONSOLIDATION_THRESHOLD": "1000",
    "EMBER_JOB_BACKOFF_BASE_S": "0.2",
    "EMBER_GATEWAY_RATE_PER_MINUTE": "100000",
    "EMBER_GATEWAY_RATE_BURST": "10000",
    "EMBER_GATEWAY_SHUTDOWN_GRACE_S": "2",
    "EMBER_MODEL_TIMEOUT_S": "60",
}


class Member:
    """One process of the cluster: a gateway or a worker, restartable in its home."""

    def __init__(self, role: str, name: str, home: Path, env: dict[str, str], port: int | None) -> None:
        self.role = role
        self.name = name
        self.home = home
        self.env = env
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None
        self.history: list[subprocess.Popen[bytes]] = []  # every process started, the current one last
        self._starts = 0
        home.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"<{self.role} {self.name} pid {self.pid}>"

    # -- starting

    @property
    def command(self) -> list[str]:
        if self.role == "gateway":
            return [EMBER, "serve", "--workers", "0", "--port", str(self.port)]
        return [EMBER, "worker"]

    @property
    def output_path(self) -> Path:
        """The current process's stdout and stderr."""
        return self.home.parent / f"{self.name}-{self._starts}.out"

    def spawn(self) -> Member:
        assert self.process is None or self.process.poll() is not None, f"{self.name} runs already"
        self._starts += 1
        with self.output_path.open("wb") as sink:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=sink, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        self.history.append(self.process)
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> Member:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"{self.name} exited with {code} before it was ready:\n{self.output()[-3000:]}")
            if self.ready():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} was not ready within {timeout_s:g} s:\n{self.output()[-3000:]}")

    def ready(self) -> bool:
        if self.role == "worker":
            return WORKER_READY.search(self.output()) is not None
        try:
            return httpx.get(self.url("/healthz"), timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    # -- signals, by the current process's PID

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def kill(self) -> int | None:
        """kill -9, and wait for it to be gone."""
        self.signal(signal.SIGKILL)
        return self.wait(STOP_TIMEOUT_S)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (a graceful stop), then SIGKILL if it is not gone within `timeout_s`."""
        self.resume()  # a paused process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def wait(self, timeout_s: float) -> int | None:
        return None if self.process is None else self.process.wait(timeout=timeout_s)

    def restart(self, *, ready: bool = True) -> Member:
        """Kill the process if it still runs, and start a new one in the same home (and port)."""
        if self.alive:
            self.kill()
        self.spawn()
        return self.wait_ready() if ready else self

    # -- what it says

    def output(self) -> str:
        path = self.output_path
        return path.read_text(errors="replace") if path.exists() else ""

    def ember_log(self) -> str:
        """EMBER_HOME/ember.log, across the restarts of this member."""
        log = self.home / "ember.log"
        return log.read_text(errors="replace") if log.exists() else ""

    # -- a gateway's address

    @property
    def base_url(self) -> str:
        assert self.port is not None, f"{self.name} is a worker: it has no address"
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path


class Cluster:
    """The members of one topology, on one database and one Redis namespace."""

    def __init__(self, root: Path, *, database_url: str, redis_url: str, model: ModelServer | None,
                 keys: dict[str, str] | None, namespace: str | None = None,
                 member_env: Callable[[str], dict[str, str]] | None = None, **extra_env: str) -> None:
        """`member_env`: settings of one member's own, by its name (g1, w2, ...)."""
        self.root = root
        self.database_url = database_url
        self.redis_url = redis_url
        self.namespace = namespace or f"c{uuid.uuid4().hex[:8]}"
        self.model = model
        self.keys = keys
        self.extra_env = {**DEFAULTS, **extra_env}
        self.member_env = member_env
        self.members: list[Member] = []

    @property
    def gateways(self) -> list[Member]:
        return [m for m in self.members if m.role == "gateway"]

    @property
    def workers(self) -> list[Member]:
        return [m for m in self.members if m.role == "worker"]

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        return gateway_env(home, self.model, self.keys, EMBER_DATABASE_URL=self.database_url,
                           EMBER_REDIS_URL=self.redis_url, EMBER_REDIS_NAMESPACE=self.namespace,
                           **{**self.extra_env, **extra})

    def add(self, role: str, *, start: bool = True, **extra_env: str) -> Member:
        assert role in ("gateway", "worker")
        name = f"{role[0]}{sum(1 for m in self.members if m.role == role) + 1}"
        home = self.root / name / "home"
        own = self.member_env(name) if self.member_env is not None else {}
        member = Member(role, name, home, self.env(home, **{**own, **extra_env}),
                        free_port() if role == "gateway" else None)
        self.members.append(member)
        return member.spawn() if start else member

    def start(self, *, gateways: int, workers: int, **extra_env: str) -> Cluster:
        """Start the members side by side, then wait until each is ready."""
        added = [self.add("worker", **extra_env) for _ in range(workers)]
        added += [self.add("gateway", **extra_env) for _ in range(gateways)]
        wait_all_ready(added)
        return self

    def member_of(self, holder: str) -> Member | None:
        """The member a lease holder, job claimer or bus consumer names (host-PID-suffix)."""
        found = re.search(r"-(\d+)-[0-9a-f]+$", holder)
        pid = int(found.group(1)) if found else None
        return next((m for m in self.members if m.pid == pid), None)

    def stop(self) -> None:
        """Every member's process, stopped by its PID: SIGCONT, SIGTERM, SIGKILL after a grace."""
        running = [p for m in self.members for p in m.history if p.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=STOP_TIMEOUT_S)

    def logs(self) -> str:
        """Every member's ember.log, for a failure's message."""
        return "\n".join(f"===== {m.name} ember.log\n{m.ember_log()[-4000:]}" for m in self.members)


def wait_all_ready(members: Sequence[Member], timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    for member in members:
        member.wait_ready(max(0.1, deadline - time.monotonic()))


@contextlib.contextmanager
def running_cluster(root: Path, *, database_url: str, redis_url: str, model: ModelServer | None,
                    keys: dict[str, str] | None, gateways: int, workers: int,
                    namespace: str | None = None, member_env: Callable[[str], dict[str, str]] | None = None,
                    **extra_env: str) -> Iterator[Cluster]:
    """A started cluster, every member of it stopped by PID at the end whatever happened."""
    cluster = Cluster(root, database_url=database_url, redis_url=redis_url, model=model, keys=keys,
                      namespace=namespace, member_env=member_env, **extra_env)
    try:
        cluster.start(gateways=gateways, workers=workers)
        yield cluster
    finally:
        cluster.stop()


LaunchCluster = Callable[..., Cluster]


@pytest.fixture
def launch_cluster(tmp_path: Path) -> Iterator[LaunchCluster]:
    """Start clusters in the test's folder (running_cluster's arguments); every member of each is
    stopped by its PID at the end of the test, whatever happened. Import it into a test module."""
    clusters: list[Cluster] = []

    def launch(*, gateways: int, workers: int, **arguments: Any) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster{len(clusters) + 1}", **arguments)
        clusters.append(cluster)  # before it starts: a start that fails half-way is stopped too
        return cluster.start(gateways=gateways, workers=workers)

    try:
        yield launch
    finally:
        for cluster in clusters:
            cluster.stop()


# --------------------------------------------------------------------------- the shared store


def query(database_url: str, sql: str, *args: Any) -> list[dict[str, Any]]:
    """Rows of one read of the cluster's PostgreSQL, as dicts (asyncpg, on a thread of its own,
    so that it works inside and outside an event loop)."""
    import asyncpg

    async def read() -> list[dict[str, Any]]:
        conn = await asyncpg.connect(database_url, timeout=10)
        try:
            return [dict(r) for r in await conn.fetch(sql, *args, timeout=30)]
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, read()).result(timeout=60)
