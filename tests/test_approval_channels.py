"""Approval requests as people meet them: at the terminal's prompt (the `ember`
command driven through its stdin) and through the gateway's native API."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.runtime.turn_state import NOT_RESUMED_TEXT
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply, tool_call
from tests.sse import events as sse_events
from tests.test_cli_e2e import EMBER, TIMEOUT_S, ember_env

ALICE, BOB = "alice-secret-0123456789", "bob-secret-0123456789ab"


def write_then_answer(path: str, content: str, answer: str) -> tuple[Reply, Reply]:
    return Reply(tool_calls=(tool_call("write_file", path=path, content=content),)), Reply(text=answer)


def last_tool_result(server: ModelServer) -> str:
    return next(m["content"] for m in reversed(server.requests[-1]["messages"]) if m["role"] == "tool")


def chat_with_stdin(env: dict[str, str], stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EMBER, "chat", *args], env=env, input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.fixture
def env(tmp_path: Path, model_server: ModelServer) -> dict[str, str]:
    return ember_env(tmp_path / "home", model_server)


def workspace(env: dict[str, str]) -> Path:
    return Path(env["EMBER_HOME"]) / "workspace"


@pytest.mark.parametrize(("answer", "written"), [("y", True), ("yes", True), ("n", False), ("", False)])
def test_the_terminal_asks_before_a_write(env: dict[str, str], model_server: ModelServer, answer: str,
                                          written: bool) -> None:
    model_server.push(*write_then_answer("todo.txt", "buy milk", "Done."))
    done = chat_with_stdin(env, answer + "\n", "-m", "note: buy milk", "--session", "s")
    assert done.returncode == 0, done.stderr
    assert "Allow Ember to write the file todo.txt?" in done.stderr  # the question, in plain words
    assert done.stdout.strip() == "Done."
    assert (workspace(env) / "todo.txt").exists() is written
    if not written:
        assert "not permitted" in last_tool_result(model_server)


def test_approve_always_holds_for_the_rest_of_the_session(env: dict[str, str], model_server: ModelServer) -> None:
    model_server.push(*write_then_answer("a.txt", "1", "First done."), *write_then_answer("b.txt", "2", "Second done."))
    # Interactive: message, approval answer, message (no second question), quit.
    done = chat_with_stdin(env, "write a\na\nwrite b\n/quit\n", "--session", "s")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("Allow Ember to") == 1
    assert (workspace(env) / "a.txt").read_text() == "1" and (workspace(env) / "b.txt").read_text() == "2"


def test_an_unanswered_question_is_denied_at_its_timeout(env: dict[str, str], model_server: ModelServer) -> None:
    model_server.push(*write_then_answer("late.txt", "x", "I could not write it."))
    env = env | {"EMBER_TOOL_POLICY__TIMEOUT_S": "1"}
    process = subprocess.Popen([EMBER, "chat", "-m", "write late", "--session", "s"], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(model_server.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the timeout denies, and the turn goes on to the model's answer
        out, err = process.communicate("y\n", timeout=TIMEOUT_S)  # an answer that comes too late
    finally:
        process.kill()
    assert "too late" in err
    assert out.strip() == "I could not write it."
    assert not (workspace(env) / "late.txt").exists()
    assert "nobody answered" in last_tool_result(model_server)


def sse(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    for event in sse_events(response.iter_lines()):
        yield event.name or "", event.json()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def run_turn(gateway: GatewayProcess, key: str, session: str, text: str,
             answer: dict[str, str] | None, answering_key: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """A native turn; each approval request is answered with `answer` (None: left unanswered)."""
    events = []
    with httpx.stream("POST", gateway.url(f"/api/sessions/{session}/messages"), json={"text": text},
                      headers=auth(key), timeout=TIMEOUT_S) as response:
        for kind, data in sse(response):
            events.append((kind, data))
            if kind == "approval_request" and answer is not None:
                reply = httpx.post(gateway.url(f"/api/approvals/{data['id']}"), json=answer,
                                   headers=auth(answering_key or key))
                events.append(("answered", {"status": reply.status_code, **reply.json()}))
    return events


@pytest.fixture
def gateway(launch_gateway: LaunchGateway, model_server: ModelServer) -> GatewayProcess:
    return launch_gateway(model_server, keys={"alice": ALICE, "bob": BOB}, EMBER_TOOL_POLICY__TIMEOUT_S="2")


def gateway_workspace(gateway: GatewayProcess) -> Path:
    return gateway.home / "workspaces" / "alice"  # alice runs the turns


def test_gateway_approve_and_deny(gateway: GatewayProcess, model_server: ModelServer) -> None:
    model_server.push(*write_then_answer("yes.txt", "ok", "Written."))
    events = run_turn(gateway, ALICE, "s", "write yes", {"decision": "approve_once"})
    kinds = [kind for kind, _ in events]
    assert kinds.index("approval_request") < kinds.index("tool_result") < kinds.index("final")
    request = dict(events)["approval_request"]
    assert (request["tool"], request["risk"], request["subject"]) == ("write_file", "write", "yes.txt")
    assert "write the file yes.txt" in request["summary"]
    assert (gateway_workspace(gateway) / "yes.txt").read_text() == "ok"

    model_server.push(*write_then_answer("no.txt", "x", "Not written."))
    events = run_turn(gateway, ALICE, "s", "write no", {"decision": "deny"})
    assert dict(events)["final"]["text"] == "Not written."
    assert "not permitted" in dict(events)["tool_result"]["text"]
    assert not (gateway_workspace(gateway) / "no.txt").exists()


def test_gateway_timeout_and_session_grant(gateway: GatewayProcess, model_server: ModelServer) -> None:
    model_server.push(*write_then_answer("t.txt", "x", "Timed out."))
    events = run_turn(gateway, ALICE, "s", "write t", None)
    assert "nobody answered" in dict(events)["tool_result"]["text"]
    assert not (gateway_workspace(gateway) / "t.txt").exists()
    late = httpx.post(gateway.url(f"/api/approvals/{dict(events)['approval_request']['id']}"),
                      json={"decision": "approve_once"}, headers=auth(ALICE))
    assert late.status_code == 410 and late.json()["error"]["code"] == "approval_expired"  # not "unknown"

    model_server.push(*write_then_answer("g1.txt", "1", "One."), *write_then_answer("g2.txt", "2", "Two."))
    first = run_turn(gateway, ALICE, "s", "write g1", {"decision": "approve_session"})
    second = run_turn(gateway, ALICE, "s", "write g2", None)
    assert [k for k, _ in first].count("approval_request") == 1
    assert "approval_request" not in [k for k, _ in second]  # granted for the session
    assert (gateway_workspace(gateway) / "g2.txt").read_text() == "2"


def test_another_identity_cannot_answer_or_see_a_request(gateway: GatewayProcess, model_server: ModelServer) -> None:
    model_server.push(*write_then_answer("b.txt", "x", "Done."))
    events = run_turn(gateway, ALICE, "s", "write b", {"decision": "approve_once"}, answering_key=BOB)
    assert dict(events)["answered"]["status"] == 404  # Bob is told it does not exist
    assert "nobody answered" in dict(events)["tool_result"]["text"]  # so it timed out, denied
    assert httpx.get(gateway.url("/api/approvals"), headers=auth(BOB)).json() == {"approvals": []}


def test_a_configured_approver_answers_anothers_request(launch_gateway: LaunchGateway,
                                                       model_server: ModelServer) -> None:
    gateway = launch_gateway(model_server, keys={"alice": ALICE, "bob": BOB}, EMBER_TOOL_POLICY__TIMEOUT_S="5",
                             EMBER_GATEWAY_APPROVERS='["bob"]')
    model_server.push(*write_then_answer("ok.txt", "by bob", "Written."))
    events = run_turn(gateway, ALICE, "s", "write ok", {"decision": "approve_once"}, answering_key=BOB)
    assert dict(events)["answered"]["status"] == 200
    assert (gateway.home / "workspaces" / "alice" / "ok.txt").read_text() == "by bob"


def test_openai_clients_cannot_approve_so_risky_calls_are_denied(gateway: GatewayProcess,
                                                                 model_server: ModelServer) -> None:
    model_server.push(*write_then_answer("o.txt", "x", "Denied."))
    response = httpx.post(gateway.url("/v1/chat/completions"), headers=auth(ALICE), timeout=TIMEOUT_S,
                          json={"model": "ember", "messages": [{"role": "user", "content": "write o"}]})
    assert response.json()["choices"][0]["message"]["content"] == "Denied."
    assert "cannot ask" in last_tool_result(model_server)
    assert not (gateway_workspace(gateway) / "o.txt").exists()


def test_pending_requests_are_listed_and_answered_once(gateway: GatewayProcess, model_server: ModelServer) -> None:
    model_server.push(*write_then_answer("p.txt", "x", "Done."))
    seen: dict[str, Any] = {}
    with httpx.stream("POST", gateway.url("/api/sessions/s/messages"), json={"text": "write p"},
                      headers=auth(ALICE), timeout=TIMEOUT_S) as response:
        for kind, data in sse(response):
            if kind == "approval_request":
                pending = httpx.get(gateway.url("/api/approvals"), headers=auth(ALICE)).json()["approvals"]
                assert [(p["id"], p["session"]) for p in pending] == [(data["id"], "s")]
                first = httpx.post(gateway.url(f"/api/approvals/{data['id']}"), json={"decision": "approve_once"},
                                   headers=auth(ALICE))
                again = httpx.post(gateway.url(f"/api/approvals/{data['id']}"), json={"decision": "deny"},
                                   headers=auth(ALICE))
                seen.update(first=first.status_code, again=again.status_code)
    assert seen["first"] == 200 and seen["again"] in (404, 409)  # answered once; never flipped
    assert (gateway_workspace(gateway) / "p.txt").exists()


def killed_while_asking(gateway: GatewayProcess, session: str, text: str) -> dict[str, Any]:
    """Alice's turn in `session` up to its approval request, and the gateway killed (-9) as it waits."""
    with httpx.stream("POST", gateway.url(f"/api/sessions/{session}/messages"), json={"text": text},
                      headers=auth(ALICE), timeout=TIMEOUT_S) as response:
        for kind, data in sse(response):
            if kind == "approval_request":
                gateway.kill()
                return dict(data)
    raise AssertionError(f"the turn in {session} asked for no approval")


def test_a_request_left_by_a_killed_gateway_is_expired_not_unknown(launch_gateway: LaunchGateway,
                                                                    model_server: ModelServer) -> None:
    first = launch_gateway(model_server, keys={"alice": ALICE, "bob": BOB}, EMBER_TOOL_POLICY__TIMEOUT_S="60",
                           EMBER_INTERRUPTED_TURNS="notice")
    model_server.push(*write_then_answer("k.txt", "x", "never"))
    asked = killed_while_asking(first, "k", "write k")
    again = launch_gateway(model_server, keys={"alice": ALICE, "bob": BOB}, port=first.port,
                           EMBER_INTERRUPTED_TURNS="notice")
    # Its turn is not resumed (the notice setting): once the notice answers it, the request has expired.
    wait_until(lambda: NOT_RESUMED_TEXT in [m["content"] for m in messages(again, ALICE, "k")],
               what="the notice for the cut-off turn")
    answered = httpx.post(again.url(f"/api/approvals/{asked['id']}"), json={"decision": "approve_once"},
                          headers=auth(ALICE))
    assert answered.status_code == 410 and "restarted" in answered.json()["error"]["message"]
    assert httpx.post(again.url(f"/api/approvals/{asked['id']}"), json={"decision": "deny"},
                      headers=auth(BOB)).status_code == 404  # still not Bob's to see
    assert not (again.home / "workspaces" / "alice" / "k.txt").exists()


def messages(gateway: GatewayProcess, key: str, session: str) -> list[dict[str, Any]]:
    response = httpx.get(gateway.url(f"/api/sessions/{session}/messages"), headers=auth(key), timeout=TIMEOUT_S)
    return list(response.json()["messages"]) if response.status_code == 200 else []


def listed(gateway: GatewayProcess, key: str) -> list[str]:
    response = httpx.get(gateway.url("/api/approvals"), headers=auth(key), timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return [p["id"] for p in response.json()["approvals"]]


@pytest.mark.parametrize("answer_first", [True, False], ids=["answered-before-the-turn-resumes", "resumed-first"])
def test_a_request_outlives_a_kill_9_and_its_answer_resumes_the_turn_once(
        launch_gateway: LaunchGateway, model_server: ModelServer, answer_first: bool) -> None:
    """kill -9 while a turn waits for an approval; at the restart the request is still listed, same
    id, and answering it (before or after the resumed turn makes the same call again) runs the tool
    once and completes the turn once."""
    keys = {"alice": ALICE, "bob": BOB}
    first = launch_gateway(model_server, keys=keys, EMBER_TOOL_POLICY__TIMEOUT_S="60")
    model_server.push(Reply(tool_calls=(tool_call("write_file", path="r.txt", content="x"),)))
    asked = killed_while_asking(first, "r", "write r")
    calls_before = len(model_server.requests)
    # The resumed turn asks the model again, which makes the same call (held back until the answer
    # is given, when that is to come first), then answers.
    gate = threading.Event()
    call, answer = write_then_answer("r.txt", "x", "Written.")
    model_server.push(dataclasses.replace(call, hold=gate if answer_first else None), answer)
    try:
        again = launch_gateway(model_server, keys=keys, port=first.port, EMBER_TOOL_POLICY__TIMEOUT_S="60")
        wait_until(lambda: listed(again, ALICE) == [asked["id"]], what="the request listed after the restart")
        assert listed(again, BOB) == []
        if not answer_first:  # the resumed turn has made the call again: it takes the request up
            wait_until(lambda: len(model_server.requests) > calls_before, what="the resumed turn's model call")
            assert listed(again, ALICE) == [asked["id"]]
        answered = httpx.post(again.url(f"/api/approvals/{asked['id']}"), json={"decision": "approve_once"},
                              headers=auth(ALICE), timeout=TIMEOUT_S)
        assert answered.status_code == 200, answered.text
    finally:
        gate.set()
    wait_until(lambda: "Written." in [m["content"] for m in messages(again, ALICE, "r")], what="the resumed answer")
    history = messages(again, ALICE, "r")
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"], history
    assert "denied" not in history[2]["content"].lower(), history
    assert (gateway_workspace(again) / "r.txt").read_text() == "x"
    assert listed(again, ALICE) == []
