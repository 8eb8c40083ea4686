"""The rest of the `ember` command: interactive chat, run, doctor, demo."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
from pathlib import Path

from ember.config.settings import CONFIGURE_MODEL_HINT
from tests.modelserver import ModelServer, Reply, tool_call
from tests.test_cli_e2e import EMBER, TIMEOUT_S, chat, ember, ember_env, stored


def interactive(env: dict[str, str], *lines: str, command: str = "chat") -> subprocess.CompletedProcess[str]:
    return subprocess.run([EMBER, command, "--session", "live"], env=env, input="".join(f"{x}\n" for x in lines),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_interactive_chat_streams_answers_and_shows_tool_steps(tmp_path: Path, model_server: ModelServer) -> None:
    env = ember_env(tmp_path, model_server)
    (tmp_path / "workspace").mkdir()
    (tmp_path / "workspace" / "todo.txt").write_text("water the plants\n")
    model_server.push(
        Reply(text="<think>greet</think>Hello, human."),
        Reply(text="Checking.", tool_calls=(tool_call("read_file", path="todo.txt"),)),
        Reply(text="You need to water the plants."),
    )

    done = interactive(env, "hi", "what is on my list?", "/quit")

    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Hello, human." in out and "greet" not in out
    assert "→ read_file" in out and "water the plants" in out
    assert out.index("Hello, human.") < out.index("→ read_file") < out.index("You need to water the plants.")
    # Each answer is shown once: the final replaces the streamed draft, it does not repeat it.
    assert out.count("You need to water the plants.") == 1
    assert [m["role"] for m in stored(env, "live")] == ["user", "assistant", "user", "assistant", "tool", "assistant"]


def test_run_without_a_model_uses_the_labelled_demo_model(tmp_path: Path) -> None:
    done = interactive(ember_env(tmp_path, None), "hello", command="run")

    assert done.returncode == 0, done.stderr
    assert "scripted demo model" in done.stdout
    assert CONFIGURE_MODEL_HINT in done.stdout.splitlines()[1]
    assert "[scripted demo model] You said: 'hello'" in done.stdout


def test_the_demo_model_remembers_across_sessions_until_a_real_model_answers(
        tmp_path: Path, model_server: ModelServer) -> None:
    """The page's first prompt does what it says on the scripted model: kept with the remember
    tool, then in the profile of another session's prompt, which the demo's answers quote. Demo
    sessions are evaluation sessions, and what they kept leaves once a real model is configured:
    canned chat never comes back as recalled noise."""
    env = ember_env(tmp_path, None)
    first = subprocess.run([EMBER, "chat", "--demo", "--session", "one", "-m", "Remember that I prefer short answers."],
                           env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert first.returncode == 0, first.stderr
    assert "[scripted demo model] Remembered as" in first.stdout
    second = subprocess.run([EMBER, "chat", "--demo", "--session", "two", "-m", "hello"], env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert second.returncode == 0, second.stderr
    assert "What I remember about you: I prefer short answers." in second.stdout
    facts = json.loads(subprocess.run([EMBER, "memory", "list", "--json"], env=env, capture_output=True, text=True,
                                      timeout=TIMEOUT_S).stdout)
    assert [(f["kind"], f["content"]) for f in facts] == [("fact", "I prefer short answers.")]
    model_server.push(Reply(text="a real answer"))
    real = chat(ember_env(tmp_path, model_server), "hello", "three")
    assert real.returncode == 0 and "a real answer" in real.stdout, real.stderr
    assert "I prefer short answers" not in json.dumps(model_server.requests[-1])  # not in the real prompt
    left = subprocess.run([EMBER, "memory", "list", "--all", "--json"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert [m["session_key"] for m in json.loads(left.stdout)] == ["cli:three"] * len(json.loads(left.stdout))
    sessions = subprocess.run([EMBER, "sessions", "list"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert "cli:one" in sessions.stdout and "cli:two" in sessions.stdout  # their history stays


def test_the_demo_model_shows_an_approval_and_a_skill(tmp_path: Path) -> None:
    """On the scripted model a newcomer sees a tool that waits for their approval (denied, then
    approved), and a skill read from the prompt's index before it is followed."""
    env = ember_env(tmp_path, None)
    done = interactive(env, "Write a note that says buy oat milk", "n", "Save a note: call the plumber", "y",
                       "Which skills do you have?", "Use the write-a-skill skill", "/quit")
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # the answers wrap at the terminal's width
    assert out.count("writing a file asks for your approval first") == 2
    assert "You said no, so nothing was written." in out
    assert "You approved it, and the note is in notes/demo-note.md: created" in out
    [note] = list(tmp_path.rglob("demo-note.md"))
    assert note.read_text() == "call the plumber\n"  # the denied note was never written
    assert "I have 3 skills: reminders, web-research, write-a-skill" in out
    assert "# Skill reminders (version 1)" in out and "# Skill write-a-skill (version 1)" in out


def test_the_demo_model_shows_a_task_delegated_to_a_helper(tmp_path: Path) -> None:
    """Asked for a helper, the scripted model hands the listing of the workspace to a child turn,
    whose own list_dir call answers it."""
    env = ember_env(tmp_path, None)
    (tmp_path / "workspace").mkdir()
    (tmp_path / "workspace" / "plans.txt").write_text("x")
    done = subprocess.run([EMBER, "chat", "--demo", "-m", "Ask a helper to look at my files."], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())
    assert "[scripted demo model] A helper worked on it in a session of its own" in out
    assert "The tool answered:" in out and "plans.txt" in out  # the child's own list_dir, as its answer


def test_doctor_reports_unreadable_rows_without_touching_the_store(tmp_path: Path, model_server: ModelServer) -> None:
    env = ember_env(tmp_path, model_server)
    model_server.push(Reply(text="first answer"))
    assert chat(env, "question", "s").returncode == 0
    with sqlite3.connect(tmp_path / "ember.db") as raw:
        raw.execute("UPDATE messages SET role = 'garbled' WHERE seq = 1")

    done = ember(env, "doctor")

    assert done.returncode == 0, done.stdout
    assert "1 stored message(s) cannot be read" in done.stdout
    assert "session cli:s seq 1: unreadable row: unknown role 'garbled'" in done.stdout
    with sqlite3.connect(tmp_path / "ember.db") as raw:
        assert raw.execute("SELECT count(*) FROM quarantine").fetchone() == (0,)
    assert f"model endpoint {model_server.base_url} answers" in done.stdout
    # The rest of the session is intact and usable.
    assert [m["content"] for m in stored(env, "s")] == ["question"]


def test_doctor_fails_when_the_model_endpoint_is_down(tmp_path: Path) -> None:
    env = ember_env(tmp_path, None, EMBER_MODEL_BASE_URL="http://127.0.0.1:9/v1", EMBER_MODEL="m",
                    EMBER_MODEL_MAX_ATTEMPTS="1")

    done = ember(env, "doctor")

    assert done.returncode == 1
    assert "FAIL" in done.stdout and "could not connect" in done.stdout


def test_bad_configuration_is_named(tmp_path: Path) -> None:
    (tmp_path / "ember.toml").write_text("consolidation_threshold = 'many'\n")

    done = ember(ember_env(tmp_path, None), "sessions", "list")

    assert done.returncode == 2
    assert "consolidation_threshold" in done.stderr and "ember.toml" in done.stderr


def test_demo_runs_offline_and_says_so() -> None:
    done = subprocess.run([EMBER, "demo"], capture_output=True, text=True, timeout=TIMEOUT_S)

    assert done.returncode == 0, done.stderr
    assert "scripted demo model" in done.stdout and "no AI involved" in done.stdout
    assert "list_dir" in done.stdout and "notes.md" in done.stdout
    assert "reasoning stored: False" in done.stdout
    assert "are now an episodic memory" in done.stdout


def test_models_lists_each_model_with_its_roles_and_state_and_never_a_key(tmp_path: Path,
                                                                          model_server: ModelServer) -> None:
    (tmp_path / "ember.toml").write_text(f"""
[models.primary]
base_url = "{model_server.base_url}"
api_key = "sk-live-primary-secret"
model = "test-model"
context_window = 128000
price_input_per_mtok = 0.15
price_output_per_mtok = 0.6
[models.backup]
base_url = "http://127.0.0.1:9/v1"
api_key_env = "BACKUP_KEY"
model = "backup-model"
[model_roles]
main = ["primary", "backup"]
background = ["backup"]
""")
    env = ember_env(tmp_path, None, BACKUP_KEY="sk-live-backup-secret", EMBER_MODEL_MAX_ATTEMPTS="1")

    listed = ember(env, "models", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["primary"]["roles"] == {"main": 1, "approval": 1}
    assert rows["backup"]["roles"] == {"main": 2, "background": 1, "approval": 2}
    assert rows["primary"]["key"] == "in the config" and rows["backup"]["key"] == "$BACKUP_KEY (set)"
    assert rows["primary"]["price_input_per_mtok"] == 0.15 and rows["backup"]["context_window"] is None
    assert {row["state"] for row in rows.values()} == {"not checked"}

    checked = ember(env, "models", "--check")
    assert checked.returncode == 1  # one model is down
    assert "primary" in checked.stdout and "backup" in checked.stdout
    shown = json.loads(ember(env, "models", "--check", "--json").stdout)
    states = {row["name"]: row["state"] for row in shown}
    assert states["primary"] == "up" and states["backup"].startswith("down: ")
    for done in (listed, checked):
        assert "secret" not in done.stdout + done.stderr


def test_models_in_demo_mode_lists_the_demo_model_and_how_to_configure_one(tmp_path: Path) -> None:
    done = ember(ember_env(tmp_path, None), "models")

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("scripted-demo  scripted:scripted-demo") and "canned answers" in done.stdout
    assert CONFIGURE_MODEL_HINT in done.stderr and "demo" in done.stderr


def test_models_json_in_demo_mode_is_the_demo_model(tmp_path: Path) -> None:
    done = ember(ember_env(tmp_path, None), "models", "--json", "--check")

    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)
    assert (row["name"], row["provider"], row["roles"]) == ("scripted-demo", "scripted",
                                                            {"main": 1, "background": 1, "approval": 1})
    assert CONFIGURE_MODEL_HINT in done.stderr


def test_models_with_a_half_made_configuration_says_what_it_lacks(tmp_path: Path) -> None:
    done = ember(ember_env(tmp_path, None, EMBER_MODEL="gpt-4o-mini"), "models")

    assert done.returncode == 1
    assert "no base URL" in done.stderr and "EMBER_MODEL_BASE_URL" in done.stderr


def test_mcp_list_json_names_each_server_its_state_and_error(tmp_path: Path) -> None:
    env = ember_env(tmp_path, None)
    assert json.loads(ember(env, "mcp", "list", "--json").stdout) == []  # none configured
    (tmp_path / "ember.toml").write_text("""
[mcp_servers.broken]
command = "/nonexistent/mcp-server"
[mcp_servers.later]
command = "/nonexistent/other-server"
enabled = false
""")
    done = ember(env, "mcp", "list", "--json")
    assert done.returncode == 0, done.stderr
    servers = {server["name"]: server for server in json.loads(done.stdout)}
    assert set(servers["broken"]) == {"name", "transport", "target", "state", "risk", "tools", "error"}
    assert servers["broken"]["state"] == "failed" and "no such file or command" in servers["broken"]["error"]
    assert servers["broken"]["transport"] == "stdio" and servers["broken"]["tools"] == []
    assert servers["later"]["state"] == "disabled" and servers["later"]["error"] is None


def test_a_fall_over_is_in_the_turns_trace(tmp_path: Path, model_server: ModelServer) -> None:
    (tmp_path / "ember.toml").write_text(f"""
[models.dead]
base_url = "http://127.0.0.1:9/v1"
model = "gone"
[models.live]
base_url = "{model_server.base_url}"
model = "test-model"
""")
    env = ember_env(tmp_path, None)
    model_server.push(Reply(text="answered by the live one"))

    done = chat(env, "hello", "fall")
    assert done.returncode == 0, done.stderr
    assert "answered by the live one" in done.stdout

    with sqlite3.connect(tmp_path / "ember.db") as raw:
        turn_id = raw.execute("SELECT turn_id FROM traces").fetchone()[0]
    shown = ember(env | {"COLUMNS": "250"}, "trace", "show", turn_id)
    assert shown.returncode == 0, shown.stderr
    assert "│ live" in shown.stdout
    assert "model call 1 passed over dead: " in shown.stdout and "could not connect" in shown.stdout


def test_chat_names_what_a_half_made_model_configuration_lacks(tmp_path: Path) -> None:
    only_url = ember(ember_env(tmp_path, None, OPENAI_BASE_URL="http://127.0.0.1:9/v1"), "chat", "-m", "hi")
    assert only_url.returncode == 2 and "no model name: set EMBER_MODEL" in only_url.stderr
    only_name = ember(ember_env(tmp_path, None, EMBER_MODEL="gpt-4o-mini"), "chat", "-m", "hi")
    assert only_name.returncode == 2 and "no base URL: set EMBER_MODEL_BASE_URL" in only_name.stderr
    nothing = ember(ember_env(tmp_path, None), "chat", "-m", "hi")
    assert nothing.returncode == 2 and "--demo" in nothing.stderr


def test_a_base_url_that_is_not_a_url_is_refused_when_read(tmp_path: Path) -> None:
    env = ember_env(tmp_path, None, EMBER_MODEL="m", EMBER_MODEL_BASE_URL="not-a-url")
    done = ember(env, "sessions", "list")
    assert done.returncode == 2
    assert "model_base_url" in done.stderr and "'not-a-url' is not a base URL" in done.stderr
    assert "environment variable EMBER_MODEL_BASE_URL" in done.stderr
    # doctor reports it as one failed check among the others
    checked = ember(env, "doctor")
    assert checked.returncode == 1 and "FAIL  config" in checked.stdout and "ok    store" in checked.stdout


def test_an_empty_message_is_refused_like_the_api_refuses_it(tmp_path: Path, model_server: ModelServer) -> None:
    done = chat(ember_env(tmp_path, model_server), "   ", "s")
    assert done.returncode == 2 and "the message is empty" in done.stderr
    assert model_server.requests == []


def test_a_base_url_without_v1_is_told_what_it_probably_meant(tmp_path: Path, model_server: ModelServer) -> None:
    root = model_server.base_url.removesuffix("/v1")
    done = ember(ember_env(tmp_path, None, EMBER_MODEL="test-model", EMBER_MODEL_BASE_URL=root,
                           EMBER_MODEL_MAX_ATTEMPTS="1"), "chat", "-m", "hello")
    assert done.returncode == 1
    assert f"did you mean {root}/v1 ?" in done.stderr and "Error code" not in done.stderr
    assert done.stderr.count(root) == 2  # the URL that failed, and the one it probably meant


def test_sessions_and_traces_are_found_by_the_name_a_person_used(tmp_path: Path, model_server: ModelServer) -> None:
    env = ember_env(tmp_path, model_server)
    model_server.push(Reply(text="one"), Reply(text="two"))
    assert chat(env, "first", "work").returncode == 0
    assert chat(env, "second", "work").returncode == 0
    with sqlite3.connect(tmp_path / "ember.db") as raw:  # a gateway session of the same name
        raw.execute("INSERT INTO sessions (key, metadata_json, last_consolidated, next_seq, created_at, updated_at) "
                    "VALUES ('http:alice:work', '{}', 0, 0, 0, 0)")
        raw.execute("INSERT INTO sessions (key, metadata_json, last_consolidated, next_seq, created_at, updated_at) "
                    "VALUES ('http:local:web-3f2a', '{}', 0, 0, 0, 0)")

    listed = json.loads(ember(env, "trace", "list", "--session", "work", "--json").stdout)
    assert [t["session"] for t in listed] == ["cli:work", "cli:work"]  # the terminal's own name wins
    assert ember(env, "sessions", "show", "web-3f2a").returncode == 0  # the last part of a gateway key
    assert ember(env, "sessions", "show", "nothing").stderr.startswith("no session named 'nothing'")

    turn = listed[0]["turn_id"]
    shown = ember(env | {"COLUMNS": "80"}, "trace", "list")
    assert turn[:12] in shown.stdout and turn not in shown.stdout  # a prefix, whole on an 80-column line
    assert ember(env, "trace", "show", turn[:12]).returncode == 0  # which trace show takes
    assert ember(env, "trace", "show", turn[:12]).stdout == ember(env, "trace", "show", turn).stdout
    assert ember(env, "trace", "show", "").returncode == 1
    detail = json.loads(ember(env, "trace", "show", turn[:12], "--json").stdout)
    assert detail["turn_id"] == turn and detail["status"] == "ok" and detail["model_calls"][0]["model"]


def test_a_name_several_sessions_end_with_is_not_guessed(tmp_path: Path) -> None:
    env = ember_env(tmp_path, None)
    assert ember(env, "sessions", "list").returncode == 0  # creates the store
    with sqlite3.connect(tmp_path / "ember.db") as raw:
        for key in ("http:alice:notes", "http:bob:notes"):
            raw.execute("INSERT INTO sessions (key, metadata_json, last_consolidated, next_seq, created_at, "
                        "updated_at) VALUES (?, '{}', 0, 0, 0, 0)", (key,))
    done = ember(env, "sessions", "show", "notes")
    assert done.returncode == 1 and "http:alice:notes, http:bob:notes" in done.stderr


def test_the_configuration_reference_in_docs_is_what_the_settings_say() -> None:
    from ember.config.reference import render
    from ember.config.settings import Settings

    document = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert document == render(), "docs/configuration.md is stale: python -m ember.config.reference > it"
    for name in Settings.model_fields:  # a key of its own, or a table of its own
        assert f"`{name}`" in document or f"`[{name}." in document or f"`[{name}]" in document, name


def test_a_worker_needs_the_redis_bus_and_says_so(tmp_path: Path) -> None:
    run = ember(ember_env(tmp_path / "home", None), "worker")
    assert run.returncode == 2
    assert "EMBER_REDIS_URL" in run.stderr and "Traceback" not in run.stderr


def test_a_worker_whose_metrics_port_is_taken_stops_at_once_and_names_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Unreachable on purpose: the port is checked before anything connects.
        env = ember_env(tmp_path / "home", None, EMBER_REDIS_URL="redis://127.0.0.1:1/0")
        run = ember(env, "worker", "--metrics-port", str(port))
    assert run.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr and "Traceback" not in run.stderr


def test_doctor_says_how_memory_is_embedded_and_what_an_unwritable_cache_costs(tmp_path: Path) -> None:
    done = ember(ember_env(tmp_path, None), "doctor")
    assert "ok    embeddings: e5-small runs in int8" in done.stdout, done.stdout

    (tmp_path / "not-a-folder").write_text("")
    done = ember(ember_env(tmp_path, None, XDG_CACHE_HOME=str(tmp_path / "not-a-folder")), "doctor")
    assert "warn  embeddings: e5-small runs in int8, but" in done.stdout and "XDG_CACHE_HOME" in done.stdout
    assert (tmp_path / "not-a-folder").is_file()

    done = ember(ember_env(tmp_path, None, EMBER_EMBEDDING_MODEL="none"), "doctor")
    assert "ok    embeddings: none; memory is searched by its words alone" in done.stdout
