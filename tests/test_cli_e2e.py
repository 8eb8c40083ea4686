"""The `ember` command end to end: a real subprocess against the tests' model server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ember.config.settings import CONFIGURE_MODEL_HINT
from tests.gatewayproc import EMBER_SOURCE
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply, tool_call

EMBER = str(Path(sys.executable).parent / "ember")
TIMEOUT_S = 60


def ember_env(home: Path, server: ModelServer | None, **extra: str) -> dict[str, str]:
    """The user's environment without any Ember or OpenAI configuration, plus ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "OPENAI_"))}
    env["EMBER_HOME"] = str(home)
    # The child runs the same Ember as this process, whichever checkout the venv's install points to.
    env["PYTHONPATH"] = os.pathsep.join([EMBER_SOURCE, *filter(None, [env.get("PYTHONPATH")])])
    if server is not None:
        env |= {"EMBER_MODEL_BASE_URL": server.base_url, "EMBER_MODEL": "test-model",
                "EMBER_MODEL_API_KEY": "test-key"}
    return env | extra


def ember(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EMBER, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def chat(env: dict[str, str], message: str, session: str) -> subprocess.CompletedProcess[str]:
    return ember(env, "chat", "-m", message, "--session", session)


def stored(env: dict[str, str], session: str) -> list[dict[str, Any]]:
    shown = ember(env, "sessions", "show", session, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def roles(messages: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in messages]


def conversation(request: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, content) of what the model was sent, without the system prompt."""
    return [(m["role"], m["content"]) for m in request["messages"] if m["role"] != "system"]


def one_line(text: str) -> str:
    # Rich wraps long lines at the terminal width; compare words, not layout.
    return " ".join(text.split())


@pytest.fixture
def env(tmp_path: Path, model_server: ModelServer) -> dict[str, str]:
    return ember_env(tmp_path, model_server)


def test_one_shot_chat_prints_the_answer(env: dict[str, str], model_server: ModelServer) -> None:
    model_server.push(Reply(text="Hello from the model."))

    done = chat(env, "hello", "s1")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Hello from the model."
    assert conversation(model_server.requests[0]) == [("user", "hello")]


def test_thinking_is_neither_printed_nor_stored(env: dict[str, str], model_server: ModelServer) -> None:
    model_server.push(Reply(text="<think>secret</think>Visible"))

    done = chat(env, "hello", "s1")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Visible"
    shown = ember(env, "sessions", "show", "s1", "--json")
    assert "secret" not in shown.stdout
    assert [m["content"] for m in json.loads(shown.stdout)] == ["hello", "Visible"]


def test_tool_turn_reads_the_workspace_and_records_the_chain(
    tmp_path: Path, env: dict[str, str], model_server: ModelServer
) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("buy milk\ncall mum\n")
    model_server.push(Reply(tool_calls=(tool_call("read_file", path="notes.txt"),)),
                      Reply(text="Your notes say: buy milk, call mum."))

    done = chat(env, "what do my notes say?", "s2")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Your notes say: buy milk, call mum."
    second = model_server.requests[1]["messages"]
    assert {"role": "tool", "tool_call_id": "call_1_0", "content": "buy milk\ncall mum\n"} in second
    history = stored(env, "s2")
    assert roles(history) == ["user", "assistant", "tool", "assistant"]
    assert [m["seq"] for m in history] == [0, 1, 2, 3]
    _, call, result, final = history
    assert [c["name"] for c in call["tool_calls"]] == ["read_file"]
    assert result["tool_call_id"] == call["tool_calls"][0]["id"]
    assert result["content"] == "buy milk\ncall mum\n"
    assert final["content"] == "Your notes say: buy milk, call mum."


def test_second_turn_sends_the_first_to_the_model(env: dict[str, str], model_server: ModelServer) -> None:
    model_server.push(Reply(text="Nice to meet you, Ada."), Reply(text="You are Ada."))

    assert chat(env, "my name is Ada", "s3").returncode == 0
    done = chat(env, "what is my name?", "s3")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "You are Ada."
    assert conversation(model_server.requests[1]) == [
        ("user", "my name is Ada"),
        ("assistant", "Nice to meet you, Ada."),
        ("user", "what is my name?"),
    ]


def test_tool_call_escaping_the_workspace_is_refused(env: dict[str, str], model_server: ModelServer) -> None:
    model_server.push(Reply(tool_calls=(tool_call("read_file", path="../../etc/passwd"),)),
                      Reply(text="I cannot read files outside the workspace."))

    done = chat(env, "show me /etc/passwd", "jail")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "I cannot read files outside the workspace."
    [refusal] = [m for m in model_server.requests[1]["messages"] if m["role"] == "tool"]
    assert refusal["content"].startswith("Error:")
    assert "root:" not in refusal["content"]
    assert roles(stored(env, "jail")) == ["user", "assistant", "tool", "assistant"]


def test_model_failure_is_reported_and_the_question_kept(
    tmp_path: Path, model_server: ModelServer
) -> None:
    env = ember_env(tmp_path, model_server, EMBER_MODEL_MAX_ATTEMPTS="2")
    model_server.push(Reply(status=500), Reply(status=500))

    done = chat(env, "are you there?", "down")

    assert done.returncode != 0
    assert done.stdout == ""
    assert "HTTP 500" in one_line(done.stderr)
    assert "after 2 attempts" in one_line(done.stderr)
    assert len(model_server.requests) == 2
    # The question is kept with the record of how its turn ended, which the model never reads.
    kept = stored(env, "down")
    assert [(m["role"], m["kind"]) for m in kept] == [("user", "message"), ("assistant", "error")]
    assert kept[0]["content"] == "are you there?" and kept[1]["seq"] is None
    assert "HTTP 500" in kept[1]["content"]
    assert "error" in ember(env, "sessions", "show", "down").stdout.splitlines()[-1]


def test_chat_without_a_model_says_how_to_configure_one(tmp_path: Path) -> None:
    done = chat(ember_env(tmp_path, None), "hi", "default")

    assert done.returncode != 0
    # The whole command on one line, so it can be pasted as it is.
    assert CONFIGURE_MODEL_HINT in done.stderr.splitlines()[1]


def test_showing_an_unknown_session_fails_clearly(env: dict[str, str]) -> None:
    done = ember(env, "sessions", "show", "nope")

    assert done.returncode != 0
    assert "no session named 'nope'" in one_line(done.stderr)


def test_kill_mid_stream_keeps_the_question_and_no_partial_answer(
    env: dict[str, str], model_server: ModelServer
) -> None:
    slow = Reply(text="This answer streams slowly and is cut short by a kill.", chunk_delay_s=0.2)
    model_server.push(slow)
    victim = subprocess.Popen([EMBER, "chat", "-m", "first question", "--session", "k"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Mid-stream: the model has sent a few chunks of the answer, far from all of them.
        wait_until(lambda: model_server.chunks_sent >= 3, what="the answer to start streaming")
    finally:
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=TIMEOUT_S)

    assert victim.returncode == -signal.SIGKILL  # killed, not finished
    assert [(m["role"], m["content"]) for m in stored(env, "k")] == [("user", "first question")]

    model_server.push(Reply(text="Back again."))
    done = chat(env, "again", "k")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Back again."
    assert conversation(model_server.requests[1]) == [("user", "first question"), ("user", "again")]
    assert [(m["role"], m["content"]) for m in stored(env, "k")] == [
        ("user", "first question"), ("user", "again"), ("assistant", "Back again."),
    ]
