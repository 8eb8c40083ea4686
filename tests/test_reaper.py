"""A test run killed from outside (kill -9 of pytest) leaves no throwaway server running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.gatewayproc import EMBER_SOURCE
from tests.reaper import PARENT_POLL_S, watch

# A stand-in for a test run: it starts a server as the fixtures do, says where, and waits to be killed.
_RUN = {
    "redis": """
import shutil, tempfile, time
from pathlib import Path
from tests.redisserver import RedisServer
server = RedisServer(shutil.which("redis-server") or "/usr/bin/redis-server", Path(tempfile.mkdtemp()))
server.start()
print(server.port, flush=True)
time.sleep(600)
""",
    "postgresql": """
import time
from tests.pgserver import throwaway_postgres
with throwaway_postgres() as server:
    print(server.port, server._folder, flush=True)
    time.sleep(600)
""",
}


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("server", ["redis", "postgresql"])
def test_a_killed_test_run_takes_its_throwaway_server_down_with_it(server: str) -> None:
    run = subprocess.Popen([sys.executable, "-c", _RUN[server]], cwd=EMBER_SOURCE, stdout=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": EMBER_SOURCE})
    try:
        assert run.stdout is not None
        port, *folder = (run.stdout.readline().decode() or "0").split()
        assert _answers(int(port)), f"the {server} server did not start"
        os.kill(run.pid, signal.SIGKILL)
        run.wait(10)
        deadline = time.monotonic() + 30
        while (_answers(int(port)) or (folder and Path(folder[0]).exists())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _answers(int(port)), f"the {server} server outlived the run that started it"
        assert not folder or not Path(folder[0]).exists(), "its data was left behind"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)


def test_a_reaper_started_from_a_thread_that_ends_waits_for_the_process(tmp_path: Path) -> None:
    """A server restarted from `asyncio.to_thread` must outlive that thread: only the run's end reaps it."""
    marker = tmp_path / "reaped"
    reapers = []

    def restart() -> None:
        reapers.append(watch(["touch", str(marker)]))
        time.sleep(1.0)  # a test's restart and its checks: the reaper is up and waiting by now

    started = threading.Thread(target=restart)
    started.start()
    started.join()  # the thread that started the reaper has ended; this process has not
    time.sleep(5 * PARENT_POLL_S)  # a signal tied to the thread would have come at once
    try:
        assert not marker.exists()
    finally:
        reapers[0].dismiss()
