"""`ember serve` as a child process on a free loopback port, for tests that talk
to the gateway over real HTTP.

    def test_x(launch_gateway, model_server):
        gw = launch_gateway(model_server, keys={"alice": ALICE_KEY})
        httpx.get(gw.url("/healthz"))

`launch_module_gateway` is the same for a module-scoped fixture:

    @pytest.fixture(scope="module")
    def gateway(model, launch_module_gateway):
        return launch_module_gateway(model, keys={"alice": ALICE_KEY})
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

import ember
from tests.modelserver import ModelServer

EMBER = str(Path(sys.executable).parent / "ember")
EMBER_SOURCE = str(Path(ember.__file__).resolve().parents[1])
READY_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def gateway_env(home: Path, model_server: ModelServer | None, keys: dict[str, str] | None,
                **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "OPENAI_"))}
    env["EMBER_HOME"] = str(home)
    # The child runs the same Ember as this process, whichever checkout the venv's install points to.
    env["PYTHONPATH"] = os.pathsep.join([EMBER_SOURCE, *filter(None, [env.get("PYTHONPATH")])])
    if model_server is not None:
        env |= {"EMBER_MODEL_BASE_URL": model_server.base_url, "EMBER_MODEL": model_server.model,
                "EMBER_MODEL_API_KEY": "test-key"}
    if keys:
        env["EMBER_API_KEYS"] = ",".join(f"{name}={secret}" for name, secret in keys.items())
    return env | extra


class GatewayProcess:
    def __init__(self, env: dict[str, str], port: int) -> None:
        self.env = env
        self.port = port
        self.home = Path(env["EMBER_HOME"])
        self.log = self.home.parent / f"serve-{port}-{time.monotonic_ns()}.log"
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as sink:
            self.process = subprocess.Popen([EMBER, "serve", "--port", str(port)], env=env,
                                            stdout=sink, stderr=subprocess.STDOUT)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> GatewayProcess:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ember serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url("/healthz"), timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"ember serve did not answer /healthz in {READY_TIMEOUT_S}s:\n{self.output()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


LaunchGateway = Callable[..., GatewayProcess]


@contextmanager
def gateway_launcher(new_home: Callable[[], Path]) -> Iterator[LaunchGateway]:
    """A `launch` that starts `ember serve` processes (in `new_home()` unless given a home);
    each is killed at the end of the block if still running."""
    started: list[GatewayProcess] = []

    def launch(model_server: ModelServer | None, *, keys: dict[str, str] | None = None, port: int | None = None,
               home: Path | None = None, ready: bool = True, **extra_env: str) -> GatewayProcess:
        env = gateway_env(home or new_home(), model_server, keys, **extra_env)
        gateway = GatewayProcess(env, port or free_port())
        started.append(gateway)
        return gateway.wait_ready() if ready else gateway

    try:
        yield launch
    finally:
        for gateway in started:
            gateway.kill()


@pytest.fixture
def launch_gateway(tmp_path: Path) -> Iterator[LaunchGateway]:
    """Start `ember serve` processes; each is killed at the end of the test if still running.
    Without `home`, all share the test's home, so a restarted gateway finds what the first one left."""
    with gateway_launcher(lambda: tmp_path / "home") as launch:
        yield launch


@pytest.fixture(scope="module")
def launch_module_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchGateway]:
    """`launch_gateway` for a module's gateways: a gateway takes seconds to start, so a module's
    tests share one. Without `home`, each starts in a fresh home; all are killed at the end of the module."""
    with gateway_launcher(lambda: tmp_path_factory.mktemp("gateway") / "home") as launch:
        yield launch
