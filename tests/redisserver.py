"""A throwaway Redis for tests: Debian's `redis-server` on a free loopback port, as `redis_server`.

One server per test session, without persistence (`--save '' --appendonly no`),
in a temporary folder. `restart()` stops it by its PID and starts it again on
the same port, empty, as a Redis without persistence comes back; `stop()` and
`start()` leave a gap between the two. Tests share the server: each uses a
namespace of its own. Without `redis-server` the fixture fails and says how to
get it (`make test` installs it).

    def test_x(redis_server):
        bus = RedisBus(redis_server.url, process="p1")
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reaper import die_with_parent

HOST = "127.0.0.1"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, executable: str, folder: Path) -> None:
        self._executable = executable
        self._folder = folder
        self.port = _free_port()
        self.url = f"redis://{HOST}:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self._process is None, "the test Redis is running already"
        log = (self._folder / "redis.log").open("ab")
        self._process = subprocess.Popen(
            [self._executable, "--bind", HOST, "--port", str(self.port), "--dir", str(self._folder),
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes"],
            # Stopped by the kernel if the test run dies first (kill -9 of pytest).
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self._folder / "redis.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"the test redis-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL), and wait for it."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    executable = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(executable).is_file():
        pytest.fail("redis-server is not installed: run `make test`, which installs Debian's redis-server "
                    "(or `apt-get install redis-server`)")
    with tempfile.TemporaryDirectory(prefix="ember-redis-") as folder:
        server = RedisServer(executable, Path(folder))
        server.start()
        try:
            yield server
        finally:
            server.stop()
