"""The deployment layouts name only what exists: compose.yaml, the Dockerfile, and the systemd units
and environment file of docs/operations.md ("Running several processes"). Every `ember` command in
them parses as the CLI parses it, every EMBER_* variable is a setting and its value validates, and
nothing published listens without API keys."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer
import yaml
from packaging.specifiers import SpecifierSet
from typer.testing import CliRunner

from ember.cli.main import app
from ember.config.settings import Settings

ROOT = Path(__file__).parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
OPERATIONS = ROOT / "docs" / "operations.md"
SECTION = "## Running several processes"

PREFIX = Settings.model_config["env_prefix"]
NESTED = Settings.model_config["env_nested_delimiter"]
# What a required variable (${NAME:?message}) stands for here: long enough for an API key.
REQUIRED = "placeholder-0123456789abcdef"
SECRET_NAME = re.compile(r"KEY|PASSWORD|SECRET|TOKEN", re.IGNORECASE)
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: str) -> str:
    """`value` as Compose makes it with no variable set: a default where one is given, REQUIRED
    where compose would refuse to start without the variable (`:?`), else empty."""

    def one(match: re.Match[str]) -> str:
        if match[5] is not None or match[3] is None:
            return ""
        return match[4] if match[3] == "-" else REQUIRED

    return _INTERPOLATION.sub(one, value.replace("$$", "\0")).replace("\0", "$")


def only_interpolated(value: str) -> bool:
    """True when `value` is all ${...} expressions with no default of their own: nothing of it is
    written into the file itself."""
    expressions = list(_INTERPOLATION.finditer(value))
    return (bool(value) and not _INTERPOLATION.sub("", value)
            and not any(match[3] == "-" and match[4] for match in expressions))


def setting(env_name: str) -> str:
    """The Settings field an environment variable sets (pydantic-settings: env_prefix, case-insensitive,
    `__` into nested tables)."""
    assert env_name.upper().startswith(PREFIX), env_name
    field = env_name[len(PREFIX):].lower().split(NESTED)[0]
    assert field in Settings.model_fields, f"{env_name} is no setting of ember/config/settings.py's Settings"
    return field


def check_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Settings:
    """Settings read from exactly `env`, as a process given that environment reads them."""
    for name in env:
        if name.upper().startswith(PREFIX):
            setting(name)
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))  # no ember.toml of this machine's
    for name, value in env.items():
        if name != "EMBER_HOME":
            monkeypatch.setenv(name, value)
    return Settings()


def parse_ember(argv: list[str]) -> Any:
    """Parse `argv` (an `ember` command line) as the CLI does, without running it: an unknown
    subcommand or option, a missing argument or a value out of range fails here. Returns the
    subcommand's context, whose `params` are the parsed values."""
    assert argv and Path(argv[0]).name == "ember", f"not an ember command: {argv}"
    command = typer.main.get_command(app)  # a click command of typer's own click
    context = command.context_class(command, info_name="ember")
    words = list(argv[1:])
    while hasattr(command, "get_command"):  # a group: the next word names its subcommand
        assert words, f"{argv}: no subcommand"
        name = words.pop(0)
        found = command.get_command(context, name)
        assert found is not None, f"{argv}: `ember {name}` is no command"
        command, context = found, found.context_class(found, info_name=name, parent=context)
    path = argv[1:len(argv) - len(words)]
    try:
        parsed = command.make_context(context.info_name, list(words), parent=context.parent)
    except Exception as exc:  # typer's click raises its UsageError, BadParameter, NoSuchOption
        raise AssertionError(f"`{shlex.join(argv)}`: {exc}") from exc
    # And what a person reads: each option used is in the subcommand's --help.
    shown = CliRunner().invoke(app, [*path, "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    for word in words:
        if word.startswith("-"):
            assert word.split("=")[0] in shown.output, f"{word} is not in `ember {' '.join(path)} --help`"
    return parsed


def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def argv_of(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(word) for word in command]


def image_command() -> list[str]:
    """The Dockerfile's CMD (a JSON array)."""
    cmd = re.search(r"^CMD\s+(\[.*\])\s*$", DOCKERFILE.read_text(), re.MULTILINE)
    assert cmd, "the image's default command, as a JSON array"
    return json.loads(cmd[1])


def ember_services(services: dict) -> dict[str, list[str]]:
    """The services that run Ember, with their command lines (the image's when they name none)."""
    found = {}
    for name, spec in services.items():
        argv = argv_of(spec["command"]) if "command" in spec else image_command() if "build" in spec else None
        if argv and Path(argv[0]).name == "ember":
            found[name] = argv
    return found


def environment(spec: dict) -> dict[str, str]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(entry.split("=", 1) if "=" in entry else (entry, "") for entry in env)
    return {name: "" if value is None else str(value) for name, value in env.items()}


def listening_port(parsed: Any, env: dict[str, str]) -> int:
    """The port `ember serve` listens on: --port, else EMBER_GATEWAY_PORT, else the default."""
    if parsed.params.get("port") is not None:
        return parsed.params["port"]
    return int(env.get("EMBER_GATEWAY_PORT") or Settings.model_fields["gateway_port"].default)


def listening_host(parsed: Any, env: dict[str, str]) -> str:
    return parsed.params.get("host") or env.get("EMBER_GATEWAY_HOST") or Settings.model_fields["gateway_host"].default


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def test_compose_has_the_stores_two_gateways_and_three_workers() -> None:
    services = compose()["services"]
    ember = ember_services(services)
    gateways = {name for name, argv in ember.items() if argv[1] == "serve"}
    workers = {name for name, argv in ember.items() if argv[1] == "worker"}
    assert len(gateways) == 2, gateways
    assert len(workers) == 3, workers
    assert {"postgres", "redis"} <= set(services)
    assert "pgvector" in services["postgres"]["image"], "the first migration creates the vector extension"
    redis_command = argv_of(services["redis"]["command"])
    assert redis_command[0] == "redis-server" and "--appendonly" in redis_command
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"
    for name, argv in ember.items():
        parsed = parse_ember(argv)
        if name in gateways:
            assert parsed.params["workers"] == 0, f"{name} should leave the turns to the workers"
    volumes = set(compose().get("volumes") or {})
    for store, path in (("postgres", "/var/lib/postgresql/data"), ("redis", "/data")):
        mounted = {volume.split(":")[0] for volume in services[store]["volumes"] if volume.split(":")[1] == path}
        assert mounted & volumes, f"{store} keeps {path} in a named volume"


def test_every_process_is_checked_restarted_and_waits_for_what_it_needs() -> None:
    services = compose()["services"]
    ember = ember_services(services)
    for name, spec in services.items():
        assert spec.get("restart") in {"always", "unless-stopped", "on-failure"}, name
    health = {name: " ".join(argv_of(services[name]["healthcheck"]["test"])) for name in ("postgres", "redis")}
    assert "pg_isready" in health["postgres"]
    assert "redis-cli ping" in health["redis"]
    for name, argv in ember.items():
        spec = services[name]
        assert spec["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                      "redis": {"condition": "service_healthy"}}, name
        if argv[1] == "serve":
            check = " ".join(argv_of(spec["healthcheck"]["test"]))
            port = listening_port(parse_ember(argv), environment(spec))
            assert f":{port}/healthz" in check, name


def test_every_ember_process_shares_the_store_and_the_bus(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    services = compose()["services"]
    for name in ember_services(services):
        env = {key: interpolate(value) for key, value in environment(services[name]).items()}
        settings = check_settings(env, monkeypatch, tmp_path)
        assert settings.database_url is not None and settings.redis_url is not None, name
        assert urlsplit(settings.database_url.get_secret_value()).hostname == "postgres", name
        assert urlsplit(settings.redis_url.get_secret_value()).hostname == "redis", name


def test_every_ember_variable_in_compose_is_a_setting() -> None:
    names = set(re.findall(r"\bEMBER_[A-Z0-9_]+", COMPOSE_FILE.read_text()))
    assert names, "compose.yaml configures Ember through EMBER_* variables"
    for name in names:
        setting(name)


def test_no_secret_is_written_into_compose() -> None:
    for name, spec in compose()["services"].items():
        for key, value in environment(spec).items():
            if SECRET_NAME.search(key):
                assert only_interpolated(value), f"{name}: {key} must come from the environment, not the file"
            if "://" in value:
                password = urlsplit(value).password
                assert password is None or only_interpolated(password), f"{name}: a password in {key}"


def test_only_gateways_with_api_keys_are_published() -> None:
    services = compose()["services"]
    ember = ember_services(services)
    published = {name for name, spec in services.items() if spec.get("ports")}
    assert published == {name for name, argv in ember.items() if argv[1] == "serve"}
    for name in published:
        parsed, env = parse_ember(ember[name]), environment(services[name])
        assert listening_host(parsed, env) not in LOOPBACK, f"{name} is published but listens on loopback"
        keys = env.get("EMBER_API_KEYS", "")
        # Set in the file, or required: compose refuses to start without it.
        assert interpolate(keys), f"{name} is published without EMBER_API_KEYS"
        for port in services[name]["ports"]:
            target = str(port).rsplit(":", 1)[-1].split("/")[0]
            assert int(target) == listening_port(parsed, env), f"{name} publishes {port}, but listens elsewhere"


def test_the_dockerfile_installs_this_repository_on_a_supported_python() -> None:
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM\s+python:(\d+)\.(\d+)\S*", text, re.MULTILINE)
    assert base, "the image starts from an official python:X.Y image"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    version = f"{base[1]}.{base[2]}"
    assert SpecifierSet(requires).contains(version), f"python:{version} does not satisfy {requires}"
    assert re.search(r"^RUN\s+pip install \.(\s|$)", text, re.MULTILINE), "it installs Ember from this repository"
    parse_ember(image_command())
    services = compose()["services"]
    for name in ember_services(services):  # every Ember service runs the image built from it
        build = services[name].get("build")
        assert (build.get("context") if isinstance(build, dict) else build) == ".", name


def running_several() -> str:
    text = OPERATIONS.read_text()
    assert SECTION in text, f"docs/operations.md has a section {SECTION!r}"
    section = text.split(SECTION, 1)[1]
    return section.split("\n## ", 1)[0]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def systemd_units() -> dict[str, dict[str, list[str]]]:
    """Each unit template of the section, by file name: its `Key=value` lines, by key."""
    units = {}
    for block in code_blocks(running_several()):
        named = re.match(r"#\s*/etc/systemd/system/(\S+\.service)", block)
        if named:
            lines: dict[str, list[str]] = {}
            for line in block.splitlines():
                if "=" in line and not line.startswith(("#", "[")):
                    key, value = line.split("=", 1)
                    lines.setdefault(key.strip(), []).append(value.strip())
            units[named[1].rstrip(":")] = lines
    return units


def environment_file(path: str) -> dict[str, str]:
    for block in code_blocks(running_several()):
        if block.startswith(f"# {path}\n"):
            return dict(line.split("=", 1) for line in block.splitlines()[1:] if line and not line.startswith("#"))
    raise AssertionError(f"the section shows no {path}")


def unit_environment(unit: dict[str, list[str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for path in unit.get("EnvironmentFile", []):
        env.update(environment_file(path.lstrip("-")))
    for assignments in unit.get("Environment", []):
        env.update(word.split("=", 1) for word in shlex.split(assignments))
    return env


def test_the_systemd_units_run_real_commands_on_real_settings(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    units = systemd_units()
    assert {"ember-gateway@.service", "ember-worker@.service"} <= set(units), units
    instances = {"ember-gateway@.service": "8765", "ember-worker@.service": "1"}  # a port, a number
    for name, instance in instances.items():
        unit = units[name]
        (exec_start,) = unit["ExecStart"]
        argv = shlex.split(exec_start.replace("%i", instance))
        parsed = parse_ember(argv)
        assert unit.get("Restart") == ["always"], name
        env = unit_environment(unit)
        settings = check_settings(env, monkeypatch, tmp_path)
        assert settings.database_url is not None and settings.redis_url is not None, name
        if name == "ember-gateway@.service":
            assert argv[1] == "serve" and parsed.params["workers"] == 0
            assert listening_port(parsed, env) == int(instance)
            assert listening_host(parsed, env) not in LOOPBACK
            assert env.get("EMBER_API_KEYS"), "a gateway beyond loopback needs EMBER_API_KEYS"
        else:
            assert argv[1] == "worker"


def test_every_ember_variable_the_section_names_is_a_setting() -> None:
    names = set(re.findall(r"\bEMBER_[A-Z0-9_]+", running_several()))
    assert {"EMBER_DATABASE_URL", "EMBER_REDIS_URL", "EMBER_API_KEYS"} <= names
    for name in names:
        setting(name)


def test_the_docs_and_the_readme_point_at_the_compose_file() -> None:
    assert "`compose.yaml`, at the repository root" in running_several()  # named, not linked out of docs/
    assert "](compose.yaml)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("argv", [
    ["ember", "serve", "--workers", "2"],  # out of range
    ["ember", "serve", "--worker", "0"],  # no such option
    ["ember", "worker", "--host", "0.0.0.0"],  # a gateway's option
    ["ember", "workers"],  # no such command
    ["python", "-m", "ember", "worker"],  # not the ember command
])
def test_a_command_line_the_cli_would_refuse_fails_the_check(argv: list[str]) -> None:
    with pytest.raises(AssertionError):
        parse_ember(argv)


@pytest.mark.parametrize("name", ["EMBER_WORKERS", "EMBER_REDIS", "DATABASE_URL"])
def test_a_variable_that_sets_nothing_fails_the_check(name: str) -> None:
    with pytest.raises(AssertionError):
        setting(name)


def test_interpolation_is_read_as_compose_reads_it() -> None:
    assert interpolate("${A:-x}/${B:?why}/${C}/$D/$$E") == f"x/{REQUIRED}///$E"
    assert not interpolate("${EMBER_API_KEYS:-}")
    assert only_interpolated("${A:?}${B}") and only_interpolated("${A:-}")
    assert not only_interpolated("sk-${A}") and not only_interpolated("${A:-sk-default}")
