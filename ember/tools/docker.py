"""The docker sandbox, for hosts where namespaces are not allowed to Ember but a Docker daemon runs.

The same contract as bubblewrap's in a throwaway container of `shell_docker_image`: the workspace
bound at its real path (the working directory and HOME), shell_read_only_paths read-only and nothing
else of the host, Ember's user
and group (so what it writes is Ember's), no capabilities, no new privileges, a cap on processes,
network `none` unless shell_network is on. Each run's container has a name of its own, so a timeout
ends it with `docker kill`, and everything in it with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ember.tools.sandbox import Command, Launch, probe, signal_exit, signal_group

DEFAULT_IMAGE = "debian:stable-slim"
PIDS_LIMIT = 512
KILL_TIMEOUT_S = 10.0
# What the docker client itself needs of Ember's environment to reach its daemon.
CLIENT_ENV = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "DOCKER_CERT_PATH",
              "DOCKER_TLS_VERIFY")
# The image's own PATH applies inside; HOME is the workspace.
NOT_PASSED = ("PATH", "HOME")


def container_name(launch: Launch) -> str:
    return f"ember-shell-{launch.run_id}"


class Docker:
    name = "docker"

    def __init__(self, executable: str | None, image: str = DEFAULT_IMAGE, read_only: Sequence[Path] = ()) -> None:
        self._executable = executable
        self.image = image
        self._read_only = tuple(Path(os.path.realpath(path)) for path in read_only)

    def problem(self) -> str | None:
        if self._executable is None:
            return "docker is not on PATH"
        return probe([self._executable, "version", "--format", "{{.Server.Version}}"], self._client_env())

    def command(self, launch: Launch) -> Command:
        assert self._executable is not None, "problem() said it cannot start"
        root = str(launch.root)
        passed = [arg for name, value in launch.env.items() if name not in NOT_PASSED
                  for arg in ("-e", f"{name}={value}")]
        argv = [self._executable, "run", "--rm", "-i", "--name", container_name(launch),
                "--network", "bridge" if launch.network else "none", "--pids-limit", str(PIDS_LIMIT),
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--user", f"{os.getuid()}:{os.getgid()}", *self._mounts(), "-v", f"{root}:{root}", "-w", root,
                "-e", f"HOME={root}", *passed, self.image, "/bin/sh", "-c", launch.command]
        return Command(argv, self._client_env())

    def _mounts(self) -> list[str]:
        return [arg for path in self._read_only for arg in ("-v", f"{path}:{path}:ro")]

    def signal(self, launch: Launch, pid: int, sig: signal.Signals) -> None:
        assert self._executable is not None, "problem() said it cannot start"
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # gone already, or a daemon not answering
            subprocess.run([self._executable, "kill", "--signal", sig.name, container_name(launch)],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=KILL_TIMEOUT_S, check=False,
                           env=self._client_env())
        if sig is signal.SIGKILL:
            signal_group(pid, sig)

    def exit_code(self, returncode: int) -> int:
        return signal_exit(returncode)

    @staticmethod
    def _client_env() -> dict[str, str]:
        return {name: os.environ[name] for name in CLIENT_ENV if name in os.environ}
