"""The sandbox a `shell_sandbox` mode runs commands in: the first of its candidates (auto: bubblewrap,
then docker) that can start here, asked once; when none can, every call is refused with one line
saying how to enable one."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

from ember.core.errors import EmberError
from ember.tools.bubblewrap import Bubblewrap
from ember.tools.docker import DEFAULT_IMAGE, Docker
from ember.tools.sandbox import Sandbox, SandboxMode, Unsandboxed

ENABLE_HINT = ("install bubblewrap (apt-get install bubblewrap) where user namespaces are allowed, or run Docker, "
               'or set shell_sandbox = "none" to run commands unsandboxed')


class SandboxUnavailable(EmberError):
    """No sandbox of the configured mode can start here; the message says how to enable one."""


class SandboxChoice:
    """The first candidate that can start here, found on first use and kept; the refusal when none can."""

    def __init__(self, mode: SandboxMode, candidates: Sequence[Sandbox]) -> None:
        self.mode = mode
        self._candidates = tuple(candidates)
        self._lock = threading.Lock()
        self._found: Sandbox | str | None = None

    def sandbox(self) -> Sandbox:
        """The sandbox to run in, else SandboxUnavailable with one line to act on. The first call
        blocks while it probes."""
        with self._lock:
            if self._found is None:
                self._found = self._probe()
        if isinstance(self._found, str):
            raise SandboxUnavailable(self._found)
        return self._found

    def _probe(self) -> Sandbox | str:
        problems = []
        for candidate in self._candidates:
            problem = candidate.problem()
            if problem is None:
                return candidate
            problems.append(f"{candidate.name}: {problem}")
        what = ("no shell sandbox can start here" if self.mode == "auto"
                else f'shell_sandbox = "{self.mode}" cannot start here')
        return f"{what} ({'; '.join(problems)}): {ENABLE_HINT}"


def sandbox_choice(mode: SandboxMode = "auto", *, hidden: Sequence[Path] = (), read_only: Sequence[Path] = (),
                   docker_image: str = DEFAULT_IMAGE) -> SandboxChoice:
    """The candidates of `mode`, bwrap and docker looked for on PATH; `hidden` are Ember's folders (its
    home, the workspaces) that must not exist inside a sandbox, `read_only` folders it shows besides the
    system's."""
    bubblewrap = Bubblewrap(shutil.which("bwrap"), hidden, read_only)
    docker = Docker(shutil.which("docker"), docker_image, read_only)
    candidates: dict[SandboxMode, list[Sandbox]] = {"auto": [bubblewrap, docker], "bubblewrap": [bubblewrap],
                                                    "docker": [docker], "none": [Unsandboxed()]}
    return SandboxChoice(mode, candidates[mode])
