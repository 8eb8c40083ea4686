"""The shell's sandbox, with real processes: what a command inside can see, write and reach, that
nothing it starts outlives its call, and the refusal when no sandbox can start."""

from __future__ import annotations

import asyncio
import io
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from ember.app.tools import shell_sandbox
from ember.cli.doctor import run_checks
from ember.config.settings import Settings
from ember.runtime.hardening import dumpable
from ember.tools.base import ToolRegistry
from ember.tools.docker import Docker
from ember.tools.sandbox import Launch, SandboxMode
from ember.tools.sandboxes import SandboxChoice, sandbox_choice
from ember.tools.shell import shell_tool
from ember.tools.workspace import Workspaces
from tests.modelserver import ModelServer, Reply, tool_call
from tests.test_cli_e2e import chat, ember_env, stored
from tests.test_tools_shell import run, survivors

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make test does)")

# Every environment this command can find: its ancestors' (walking up from $$ and $PPID) and every process's.
ANCESTRY = ("for p in $$ $PPID; do while [ -n \"$p\" ] && [ \"$p\" -gt 0 ]; do "
            "tr '\\0' '\\n' < /proc/$p/environ; p=$(cut -d' ' -f4 /proc/$p/stat); done; done; "
            "for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done; echo walked")


def tools(root: Path, choice: SandboxChoice | None = None, *, network: bool = True,
          timeout_s: float = 10.0) -> ToolRegistry:
    return ToolRegistry([shell_tool(Workspaces(root), sandbox=choice or sandbox_choice("bubblewrap"),
                                    network=network, timeout_s=timeout_s)])


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def opt_home() -> Iterator[Path]:
    """An Ember home under /opt, which the sandbox binds read-only: it must be covered, not shown."""
    if not os.access("/opt", os.W_OK):
        pytest.skip("needs a writable /opt")
    base = Path(tempfile.mkdtemp(prefix="ember-sandbox-test-", dir="/opt"))
    try:
        yield base / "home"
    finally:
        shutil.rmtree(base)


def test_a_command_reads_no_ancestors_environment(tmp_path: Path, model_server: ModelServer) -> None:
    canary = f"sk-canary-{secrets.token_hex(8)}"
    env = ember_env(tmp_path, model_server, EMBER_MODEL_API_KEY=canary, SANDBOX_CANARY=canary,
                    EMBER_TOOL_POLICY__EXECUTE="allow", PYTHONPATH=str(Path(__file__).parents[1]))
    model_server.push(Reply(tool_calls=(tool_call("shell", command=ANCESTRY),)), Reply(text="done"))

    done = chat(env, "look around", "s")

    assert done.returncode == 0, done.stderr
    result = next(m["content"] for m in stored(env, "s") if m["role"] == "tool")
    assert "walked" in result and "PATH=" in result
    assert canary not in result
    assert canary not in str(model_server.requests[1])


def test_unsandboxed_as_root_the_same_walk_finds_the_canary(tmp_path: Path, model_server: ModelServer) -> None:
    # The control of the test above: it would see a leak. (Root reads any process's environment, even
    # a non-dumpable one's; another user could not.)
    canary = f"sk-canary-{secrets.token_hex(8)}"
    env = ember_env(tmp_path, model_server, EMBER_MODEL_API_KEY=canary, EMBER_SHELL_SANDBOX="none",
                    EMBER_TOOL_POLICY__EXECUTE="allow", PYTHONPATH=str(Path(__file__).parents[1]))
    model_server.push(Reply(tool_calls=(tool_call("shell", command=ANCESTRY),)), Reply(text="done"))

    assert chat(env, "look around", "s").returncode == 0
    result = next(m["content"] for m in stored(env, "s") if m["role"] == "tool")
    assert (canary in result) is (os.geteuid() == 0)


async def test_ember_home_the_store_and_other_workspaces_do_not_exist_inside(opt_home: Path) -> None:
    settings = Settings(home=opt_home, workspace=opt_home / "workspace" / "alice")
    mine, other = settings.workspace_dir, opt_home / "workspace" / "bob"
    for folder in (mine, other):
        folder.mkdir(parents=True)
    (opt_home / "ember.toml").write_text('model_api_key = "sk-in-the-toml"\n')
    (opt_home / "ember.db").write_text("the store")
    (opt_home / "ember.log").write_text("the log")
    (other / "diary.txt").write_text("bob's")
    (mine / "notes.txt").write_text("alice's")

    command = (f"ls -a {opt_home}; cat {opt_home}/ember.toml {opt_home}/ember.db {opt_home}/ember.log "
               f"{other}/diary.txt; ls {other}; cat notes.txt; echo HOME=$HOME")
    result = await run(tools(mine, shell_sandbox(settings)), command)

    assert "sk-in-the-toml" not in result and "the store" not in result and "the log" not in result
    assert "bob's" not in result and "No such file" in result
    assert "alice's" in result and f"HOME={mine}" in result
    assert (await run(tools(mine, shell_sandbox(settings)), f"ls -a {opt_home}")).split()[3:] == [".", "..",
                                                                                                  "workspace"]


async def test_a_command_writes_in_its_workspace_and_nowhere_else(ws: Path) -> None:
    marker = f"ember-sandbox-{secrets.token_hex(4)}"
    attempts = "; ".join(f"touch {folder}/{marker} 2>/dev/null && echo wrote {folder}"
                         for folder in ("/usr", "/etc", "/opt", "/usr/local/bin"))
    result = await run(tools(ws), f"{attempts}; touch {marker} && echo wrote ws; touch /tmp/{marker} && echo wrote tmp")

    assert result.splitlines()[1:] == ["wrote ws", "wrote tmp"]
    assert (ws / marker).exists()
    assert not any(Path(folder, marker).exists() for folder in ("/usr", "/etc", "/opt", "/tmp"))


async def test_shell_read_only_paths_are_shown_read_only(ws: Path, tmp_path: Path) -> None:
    toolchain = tmp_path / "toolchain"
    toolchain.mkdir()
    (toolchain / "VERSION").write_text("1.2.3")
    command = f"cat {toolchain}/VERSION; echo; touch {toolchain}/x 2>/dev/null || echo read-only"
    assert "No such file" in await run(tools(ws), command)
    shown = await run(tools(ws, sandbox_choice("bubblewrap", read_only=[toolchain])), command)
    assert shown == "exit code: 0\n1.2.3\nread-only\n"


@pytest.mark.parametrize("network", [True, False])
async def test_shell_network_decides_whether_loopback_is_reachable(ws: Path, network: bool) -> None:
    accepted = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), 3); print('connected')"
        result = await run(tools(ws, network=network), f"python3 -c \"{probe}\"")
    finally:
        server.close()
        await server.wait_closed()

    assert ("connected" in result) is network and accepted.is_set() is network
    if not network:
        assert "ConnectionRefusedError" in result


@pytest.mark.parametrize("ends", ["at the timeout", "with the command"])
async def test_nothing_escapes_by_setsid_and_a_cleared_environment(ws: Path, ends: str) -> None:
    nap = f"sleep 1000.{secrets.randbelow(10**9):09d}"
    last = nap if ends == "at the timeout" else "echo started"
    result = await run(tools(ws, timeout_s=1), f"env -i setsid sh -c '{nap}' & sleep 0.3; {last}")

    assert ("timed out after 1 s" in result) is (ends == "at the timeout")
    assert await survivors(nap) == []


async def test_an_explicit_bubblewrap_that_cannot_start_is_refused_in_one_line(
        ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = await run(tools(ws, sandbox_choice("bubblewrap")), "echo hi")
    assert result == ('Error: shell_sandbox = "bubblewrap" cannot start here (bubblewrap: bwrap is not on PATH): '
                      "install bubblewrap (apt-get install bubblewrap) where user namespaces are allowed, or run "
                      'Docker, or set shell_sandbox = "none" to run commands unsandboxed')


async def test_auto_passes_over_a_docker_that_cannot_start(ws: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "version", "--format", "{{.Server.Version}}"],
                                        capture_output=True, timeout=10).returncode == 0:
        pytest.skip("needs a docker client without a daemon")
    only_docker = tmp_path / "bin"
    only_docker.mkdir()
    (only_docker / "docker").symlink_to(docker)
    monkeypatch.setenv("PATH", str(only_docker))

    result = await run(tools(ws, sandbox_choice("auto")), "echo hi")

    assert result.startswith("Error: no shell sandbox can start here (bubblewrap: bwrap is not on PATH; docker: ")
    assert "daemon" in result and result.endswith('set shell_sandbox = "none" to run commands unsandboxed')
    assert "\n" not in result


async def test_none_runs_unsandboxed(ws: Path, tmp_path: Path) -> None:
    (tmp_path / "outside.txt").write_text("seen from outside")
    command = f"cat {tmp_path}/outside.txt; echo; cat /proc/1/comm"
    assert "seen from outside" in await run(tools(ws, sandbox_choice("none")), command)
    inside = await run(tools(ws), command)
    assert "seen from outside" not in inside and "bwrap" in inside


def test_the_docker_argv_holds_the_same_contract() -> None:
    launch = Launch("ls", Path("/srv/ws"), network=False, env={"PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8"},
                    run_id="r1")
    command = Docker("/usr/bin/docker", "debian:stable-slim").command(launch)
    uid = f"{os.getuid()}:{os.getgid()}"
    assert command.argv == ["/usr/bin/docker", "run", "--rm", "-i", "--name", "ember-shell-r1", "--network", "none",
                            "--pids-limit", "512", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                            "--user", uid, "-v", "/srv/ws:/srv/ws", "-w", "/srv/ws", "-e", "HOME=/srv/ws",
                            "-e", "LANG=C.UTF-8", "debian:stable-slim", "/bin/sh", "-c", "ls"]
    networked = Docker("/usr/bin/docker").command(Launch("ls", Path("/w"), True, {}, "r2")).argv
    assert networked[networked.index("--network") + 1] == "bridge"
    assert "LANG" not in command.env


@pytest.mark.parametrize(("mode", "said"), [
    ("auto", "ok    shell: commands run in the bubblewrap sandbox, with network"),
    ("none", 'warn  shell: commands run unsandboxed, as Ember\'s user (shell_sandbox = "none")'),
])
async def test_doctor_says_which_sandbox_runs(tmp_path: Path, mode: SandboxMode, said: str) -> None:
    console = Console(file=io.StringIO(), width=300)
    await run_checks(Settings(home=tmp_path / "home", shell_sandbox=mode), console)
    assert said in console.file.getvalue().splitlines()  # type: ignore[attr-defined]


async def test_doctor_says_why_no_sandbox_can_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    console = Console(file=io.StringIO(), width=400)
    code = await run_checks(Settings(home=tmp_path / "home", shell_sandbox="bubblewrap"), console)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert code == 1
    assert 'FAIL  shell tool refused: shell_sandbox = "bubblewrap" cannot start here' in shown


def test_the_ember_command_makes_its_process_non_dumpable() -> None:
    source = str(Path(__file__).parents[1])
    check = ("import sys; from ember.cli.main import main; from ember.runtime.hardening import dumpable\n"
             "sys.argv = ['ember', '--help']\ntry:\n    main()\nexcept SystemExit:\n    pass\nprint(dumpable())")
    env = {**os.environ, "PYTHONPATH": source}
    shown = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60)
    assert shown.stdout.splitlines()[-1] == "False", shown.stderr
    assert dumpable()  # this test process is not the ember command


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A folder another user can read (pytest's tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="ember-sandbox-test-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def test_a_non_dumpable_process_hides_its_environment_from_its_own_user(public_dir: Path) -> None:
    """As an unprivileged user (root reads everything), the Debian python running Ember's helper."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root, setpriv and /usr/bin/python3 to act as another user")
    source = public_dir / "src"
    shutil.copytree(Path(__file__).parents[1] / "ember" / "runtime", source / "ember" / "runtime")
    (source / "ember" / "__init__.py").touch()
    for path in (public_dir, source, *source.rglob("*")):
        path.chmod(0o755)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    canary = f"canary-{secrets.token_hex(8)}"
    for hardened, readable in ((False, True), (True, False)):
        script = ("import sys, time; from ember.runtime.hardening import make_undumpable\n"
                  f"{'make_undumpable()' if hardened else 'pass'}\nprint('ready', flush=True); time.sleep(30)")
        child = subprocess.Popen([*nobody, "/usr/bin/python3", "-c", script], stdout=subprocess.PIPE, text=True,
                                 env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(source), "CANARY": canary})
        try:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            seen = subprocess.run([*nobody, "cat", f"/proc/{child.pid}/environ"], capture_output=True, timeout=10)
            assert (canary.encode() in seen.stdout) is readable, (hardened, seen.stderr)
        finally:
            child.kill()
            child.wait()
