"""The bubblewrap sandbox: a command in namespaces of its own, seeing the system read-only and one workspace.

    processes  a PID namespace with its own /proc, so no ancestor's /proc/<pid>/environ exists
               for it; a new session (no terminal to push input into); no capabilities, even as root
    files      the system folders that exist (SYSTEM_DIRS) read-only, symlinked ones as the same
               symlinks, and the folders of shell_read_only_paths; Ember's home and the workspaces
               folder covered by an empty tmpfs where they lie under one of those; then the
               workspace, bound read-write at its real path (the working directory and HOME); /tmp
               an empty tmpfs; /dev minimal. Nothing else exists.
    network    the host's, or with shell_network = false a namespace of its own with only loopback
    end        bwrap's pid 1 (the namespace's init) exits when the command does, and the kernel then
               kills everything left in the namespace, whatever session or environment it moved to;
               SIGKILL to that init does the same at a timeout. SIGTERM goes to the processes inside.

The environment bwrap is given is the command's (its pid 1 is bwrap, whose /proc/1/environ the
command can read), so it is already cleaned.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ember.tools.sandbox import Command, Launch, descendants, kill_marked, kill_pid, probe, signal_exit, signal_group

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt")
RESOLV_CONF = Path("/etc/resolv.conf")


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


class Bubblewrap:
    name = "bubblewrap"

    def __init__(self, executable: str | None, hidden: Sequence[Path] = (), read_only: Sequence[Path] = ()) -> None:
        self._executable = executable
        self._hidden = tuple(Path(os.path.realpath(path)) for path in hidden)
        self._read_only = tuple(Path(os.path.realpath(path)) for path in read_only)

    def problem(self) -> str | None:
        if self._executable is None:
            return "bwrap is not on PATH"
        with tempfile.TemporaryDirectory(prefix="ember-bwrap-probe-") as root:
            launch = Launch("true", Path(root), network=False, env={"PATH": os.defpath}, run_id="probe")
            command = self.command(launch)
            return probe(command.argv, command.env)

    def command(self, launch: Launch) -> Command:
        assert self._executable is not None, "problem() said it cannot start"
        root = str(launch.root)
        argv = [self._executable, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
                "--cap-drop", "ALL", *([] if launch.network else ["--unshare-net"]),
                "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", *self._system(), *self._extra(),
                *self._covers(), "--bind", root, root, "--chdir", root, "--setenv", "HOME", root,
                "/bin/sh", "-c", launch.command]
        return Command(argv, {**launch.env, "HOME": root})

    def _system(self) -> list[str]:
        args = []
        for folder in SYSTEM_DIRS:
            if os.path.islink(folder):
                args += ["--symlink", os.readlink(folder), folder]
            elif os.path.isdir(folder):
                args += ["--ro-bind", folder, folder]
        # A resolv.conf linked out of /etc (systemd-resolved's) would dangle without its target.
        target = Path(os.path.realpath(RESOLV_CONF))
        if RESOLV_CONF.is_symlink() and target.exists() and not any(_under(target, Path(f)) for f in SYSTEM_DIRS):
            args += ["--ro-bind", str(target), str(target)]
        return args

    def _extra(self) -> list[str]:
        return [arg for path in self._read_only if path.exists() for arg in ("--ro-bind", str(path), str(path))]

    def _covers(self) -> list[str]:
        """A tmpfs over each hidden folder that a read-only bind would otherwise show."""
        bound = [Path(os.path.realpath(f)) for f in SYSTEM_DIRS if os.path.isdir(f) and not os.path.islink(f)]
        bound += self._read_only
        args = []
        for path in self._hidden:
            if path.is_dir() and any(_under(path, folder) for folder in bound):
                args += ["--tmpfs", str(path)]
        return args

    def signal(self, launch: Launch, pid: int, sig: signal.Signals) -> None:
        # pid is bwrap outside; its one child is the namespace's init, above everything the command started.
        inside = descendants(pid)
        if sig is signal.SIGKILL:
            for init in inside[:1]:
                kill_pid(init, sig)
            signal_group(pid, sig)
            # Killed while bwrap forks, its init may not yet be bound to die with it: found by the run's mark.
            kill_marked(launch.run_id)
            return
        for process in inside[1:]:
            kill_pid(process, sig)

    def exit_code(self, returncode: int) -> int:
        return signal_exit(returncode)
