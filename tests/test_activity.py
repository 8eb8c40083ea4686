"""The activity page and `/api/activity` as a person sees them: what each of their turns
did (model calls, tools, tokens, how it ended), over real HTTP on `ember serve` with the
scripted model server, and in a real browser at a phone's and a desk's width. Each
identity sees its own turns only.

One gateway serves the module; tests that need a session of their own name one with `fresh()`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser import answer, box, needs_chromium, send, sign_in
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply, serving, tool_call
from tests.sse import events, sse_events
from tests.test_gateway_api import assert_error

SECRETS = {
    "alice": "alice-secret-0123456789",
    "bob": "bob-secret-0123456789ab",
    "Alice": "ALICE-secret-9876543210",  # differs from "alice" only in case: another identity
}
SECRET_VALUE = "sk-" + "a1b2c3d4" * 4  # looks like an OpenAI key: a trace never holds it
STAGES = ["context", "inference", "response"]
FILES_ANSWER = "One file: notes.txt"


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(model: ModelServer, launch_module_gateway: LaunchGateway) -> GatewayProcess:
    # Limits out of the way, as for the other page tests: a wait polling the API, and the page's own
    # requests, would otherwise be refused 429 on a slow machine (the default burst is 60).
    gateway = launch_module_gateway(model, keys=SECRETS, EMBER_MODEL_MAX_ATTEMPTS="1",
                                    EMBER_GATEWAY_RATE_PER_MINUTE="100000", EMBER_GATEWAY_RATE_BURST="10000")
    workspace = gateway.home / "workspaces" / "alice"  # the workspace of the key whose turns run here
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "notes.txt").write_text("buy milk\n")
    return gateway


Clients = dict[str, httpx.Client]


@pytest.fixture(scope="module")
def clients(gateway: GatewayProcess) -> Iterator[Clients]:
    made = {identity: httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {secret}"},
                                   timeout=30) for identity, secret in SECRETS.items()}
    yield made
    for client in made.values():
        client.close()


def fresh(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def ask(client: httpx.Client, key: str, text: str) -> str:
    """One turn on the native API; its turn id, once its trace is recorded (just after the answer)."""
    response = client.post(f"/api/sessions/{key}/messages", json={"text": text})
    assert response.status_code == 200, response.text
    [closing] = [e for e in sse_events(response.text) if e.name in ("final", "error")]
    turn_id: str = closing.json()["turn_id"]
    wait_until(lambda: client.get(f"/api/activity/{turn_id}").status_code == 200, timeout_s=10,
               what=f"the trace of turn {turn_id}")
    return turn_id


def listed(client: httpx.Client, **params: str) -> list[dict[str, Any]]:
    response = client.get("/api/activity", params=params)
    assert response.status_code == 200, response.text
    turns: list[dict[str, Any]] = response.json()["turns"]
    return turns


def prompt_words(body: dict[str, Any]) -> int:
    """The input tokens the scripted model server reports for a request: its messages' words."""
    return sum(len(str(message.get("content") or "").split()) for message in body["messages"])


def test_a_turn_with_a_tool_call_is_listed_with_its_counts_and_opens_to_its_trace(
        clients: Clients, model: ModelServer) -> None:
    alice, key = clients["alice"], fresh("files")
    model.push(Reply(tool_calls=(tool_call("list_dir", path="."),)), Reply(text=FILES_ANSWER))
    turn_id = ask(alice, key, "what files do I have?")
    asked = model.requests[-2:]

    [newest, *_] = listed(alice)
    assert newest["turn_id"] == turn_id  # newest first
    assert newest["session"] == key  # without the identity's namespace, as /api/sessions shows it
    assert newest["status"] == "ok" and newest["error"] is None
    assert newest["finished_at"] >= newest["started_at"] > 0
    assert newest["duration_ms"] == pytest.approx((newest["finished_at"] - newest["started_at"]) * 1000, abs=0.1)
    assert newest["summary"] == {
        "model_calls": 2, "tool_calls": 1, "tool_errors": 0, "approvals": 1,  # allowed by the tool policy
        "delegations": 0, "input_tokens": sum(prompt_words(body) for body in asked),
        "output_tokens": 1 + len(FILES_ANSWER.split()),  # a tool call counts one
    }

    turn = alice.get(f"/api/activity/{turn_id}").json()
    assert {k: v for k, v in turn.items() if k in newest} == newest
    assert [stage["stage"] for stage in turn["stages"]] == STAGES
    assert all(stage["duration_ms"] >= 0 for stage in turn["stages"])
    assert [(call["model"], call["tool_calls"]) for call in turn["model_calls"]] == [
        (model.model, 1), (model.model, 0)]
    assert [call["input_tokens"] for call in turn["model_calls"]] == [prompt_words(body) for body in asked]
    [tool] = turn["tool_calls"]
    history = alice.get(f"/api/sessions/{key}/messages").json()["messages"]
    [result] = [m for m in history if m["role"] == "tool"]
    assert tool["name"] == "list_dir" and tool["arguments"] == {"path": "."} and tool["status"] == "ok"
    assert tool["call_id"] == result["tool_call_id"] and tool["result_chars"] == len(result["content"])
    [allowed] = turn["approvals"]
    assert (allowed["call_id"], allowed["tool"], allowed["decision"], allowed["decided_by"]) == (
        tool["call_id"], "list_dir", "approve_once", "policy")

    assert [t["turn_id"] for t in listed(alice, session=key)] == [turn_id]
    assert listed(alice, session=fresh("never-used")) == []
    assert len(listed(alice, limit="1")) == 1


DELEGATED = (Reply(tool_calls=(tool_call("delegate", task="List the files in the workspace."),)),
             Reply(tool_calls=(tool_call("list_dir", path="."),)), Reply(text="The child saw notes.txt"),
             Reply(text="You have notes.txt"))


def test_a_delegated_task_is_shown_inside_the_turn_that_asked_with_its_cost_rolled_up(
        clients: Clients, model: ModelServer) -> None:
    alice, key = clients["alice"], fresh("delegating")
    model.push(*DELEGATED)
    turn_id = ask(alice, key, "Have a helper look at my files.")
    parent_asked, child_asked = [model.requests[-4], model.requests[-1]], model.requests[-3:-1]

    [turn] = listed(alice, session=key)  # the child's turn is its asker's: not listed on its own
    assert turn["turn_id"] == turn_id and turn["summary"]["delegations"] == 1
    every = [*parent_asked, *child_asked]
    assert turn["summary"]["input_tokens"] == sum(prompt_words(body) for body in every)
    answers = [reply.text for reply in DELEGATED if reply.text]
    assert turn["summary"]["output_tokens"] == 2 + sum(len(text.split()) for text in answers)  # a call counts one
    [delegated] = alice.get(f"/api/activity/{turn_id}").json()["delegations"]
    assert (delegated["status"], delegated["agent"], delegated["model_calls"]) == ("ok", None, 2)
    assert delegated["input_tokens"] == sum(prompt_words(body) for body in child_asked)
    child = delegated["turn"]
    assert child["session"].startswith("delegate:") and [c["name"] for c in child["tool_calls"]] == ["list_dir"]
    assert alice.get(f"/api/activity/{child['turn_id']}").status_code == 404  # seen only through its asker
    assert all(t["turn_id"] != child["turn_id"] for t in listed(alice))


def test_a_failed_tool_call_is_counted_and_a_secret_argument_never_shows(
        clients: Clients, model: ModelServer) -> None:
    alice, key = clients["alice"], fresh("secret")
    model.push(Reply(tool_calls=(tool_call("read_file", path="no-such-file.txt", api_key=SECRET_VALUE),)),
               Reply(text="That file does not exist."))
    turn_id = ask(alice, key, "read my file")

    [item] = listed(alice, session=key)
    assert item["summary"]["tool_calls"] == 1 and item["summary"]["tool_errors"] == 1
    response = alice.get(f"/api/activity/{turn_id}")
    [tool] = response.json()["tool_calls"]
    assert tool["name"] == "read_file" and tool["status"] == "error"
    assert tool["arguments"] == {"path": "no-such-file.txt", "api_key": "[redacted]"}
    assert SECRET_VALUE not in response.text and SECRET_VALUE not in alice.get("/api/activity").text


def test_a_persons_approval_shows_who_allowed_the_call(clients: Clients, model: ModelServer,
                                                        gateway: GatewayProcess) -> None:
    alice, key = clients["alice"], fresh("approved")
    model.push(Reply(tool_calls=(tool_call("write_file", path="approved.txt", content="hi"),)), Reply(text="Written."))
    with alice.stream("POST", f"/api/sessions/{key}/messages", json={"text": "write it"}) as response:
        for event in events(response.iter_lines()):
            if event.name == "approval_request":
                decided = alice.post(f"/api/approvals/{event.json()['id']}", json={"decision": "approve_once"})
                assert decided.status_code == 200, decided.text
            elif event.name == "final":
                turn_id = event.json()["turn_id"]
    assert (gateway.home / "workspaces" / "alice" / "approved.txt").read_text() == "hi"
    wait_until(lambda: alice.get(f"/api/activity/{turn_id}").status_code == 200, timeout_s=10, what="the trace")

    turn = alice.get(f"/api/activity/{turn_id}").json()
    [approval] = turn["approvals"]
    assert (approval["tool"], approval["decision"], approval["decided_by"]) == ("write_file", "approve_once",
                                                                               "user:alice")
    assert approval["subject"] == "approved.txt" and approval["decided_at"] >= turn["started_at"]
    assert [call["name"] for call in turn["tool_calls"]] == ["write_file"]
    assert turn["summary"]["approvals"] == 1


def test_a_failed_turn_is_listed_as_failed_with_its_error_redacted(clients: Clients, model: ModelServer) -> None:
    alice, key = clients["alice"], fresh("broken")
    model.push(Reply(status=400, error_message=f"scripted: the request was refused for key {SECRET_VALUE}"))
    turn_id = ask(alice, key, "this will fail")

    [item] = listed(alice, session=key)
    assert item["turn_id"] == turn_id and item["status"] == "failed"
    assert "refused for key [redacted]" in item["error"]
    response = alice.get(f"/api/activity/{turn_id}")
    assert response.json()["error"] == item["error"] and SECRET_VALUE not in response.text


def test_nobody_sees_another_identitys_turns(clients: Clients, model: ModelServer) -> None:
    alice, key = clients["alice"], fresh("private")
    model.push(Reply(text="Noted, your diary is safe."))
    turn_id = ask(alice, key, "my diary entry")
    assert turn_id in [t["turn_id"] for t in listed(alice)]

    for other in ("bob", "Alice"):
        client = clients[other]
        assert turn_id not in [t["turn_id"] for t in listed(client, limit="200")], other
        assert listed(client, session=key) == [], other
        # Another identity's turn does not exist for the caller: 404, the same as an unknown id.
        assert_error(client.get(f"/api/activity/{turn_id}"), 404, "turn_not_found")

    model.push(Reply(text="Hello Bob."))
    bobs = ask(clients["bob"], key, "hello")  # the same session name is bob's own session
    assert [t["turn_id"] for t in listed(clients["bob"], session=key)] == [bobs]
    assert [t["turn_id"] for t in listed(alice, session=key)] == [turn_id]


@pytest.mark.parametrize("limit", ["0", "201", "-1", "1.5", "ten", ""])
def test_a_bad_limit_is_a_400(clients: Clients, limit: str) -> None:
    error = assert_error(clients["alice"].get("/api/activity", params={"limit": limit}), 400, "invalid_parameter")
    assert error["param"] == "limit" and "1 to 200" in error["message"]


def test_bad_parameters_are_400s_and_an_unknown_turn_is_a_404(clients: Clients, gateway: GatewayProcess) -> None:
    alice = clients["alice"]
    assert_error(alice.get("/api/activity", params={"session": "not a key!"}), 400, "invalid_session_key")
    assert_error(alice.get("/api/activity", params={"limt": "5"}), 400, "invalid_parameter")
    assert_error(alice.get("/api/activity/no-such-turn"), 404, "turn_not_found")
    assert_error(httpx.get(gateway.url("/api/activity")), 401, "invalid_api_key")
    assert alice.get("/api/activity", params={"limit": "200"}).status_code == 200


# --- the page ------------------------------------------------------------------------------------

@needs_chromium
@pytest.mark.parametrize("width", [390, 1280])
def test_the_activity_panel_lists_the_turn_and_opens_its_tools(
        page: Page, model: ModelServer, gateway: GatewayProcess, clients: Clients, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 800})
    page.emulate_media(reduced_motion="reduce")
    page.goto(gateway.url("/"))
    expect(page.locator("#key-input")).to_be_visible()
    expect(page.locator("#open-activity")).to_be_hidden()  # nothing to show before signing in
    sign_in(page, gateway, SECRETS["alice"])
    model.push(Reply(tool_calls=(tool_call("list_dir", path="."),)), Reply(text=FILES_ANSWER))
    send(page, "what files do I have?")
    expect(answer(page)).to_have_text(FILES_ANSWER)
    session = page.url.split("#", 1)[1]
    wait_until(lambda: bool(listed(clients["alice"], session=session)), timeout_s=10, what="the turn's trace")

    activity = box(page, "#open-activity")
    for button in ("#open-activity", "#open-usage", "#open-memory", "#open-sessions", "#sign-out"):
        if not page.locator(button).is_visible():
            continue  # a drawer's button, at a width where its panel is beside the chat
        found = box(page, button)  # the header keeps its buttons on the screen, each on one line
        assert found["x"] >= 0 and found["x"] + found["width"] <= width, (button, found)
        assert found["height"] == activity["height"], (button, found)
        face, text = page.locator(button).evaluate(
            "b => [getComputedStyle(b).backgroundColor, getComputedStyle(b).color]")
        assert face != text, button  # its label can be read
    page.get_by_role("button", name="Activity", exact=True).click()
    panel = page.get_by_role("dialog", name="Activity")
    expect(panel).to_be_visible()
    drawer = box(page, "#activity-panel")
    assert drawer["x"] >= 0 and drawer["x"] + drawer["width"] <= width + 0.5, drawer
    assert drawer["width"] >= (width - 1 if width < 500 else 400), drawer  # a phone's whole width

    [listed_turn] = listed(clients["alice"], session=session)
    entry = panel.locator(f'.activity-item[data-turn="{listed_turn["turn_id"]}"]')
    expect(entry.locator(".activity-session")).to_have_text("what files do I have?")  # the session by its title
    expect(entry).to_have_count(1)
    expect(entry).to_contain_text("Done")
    expect(entry).to_contain_text("1 tool")
    expect(entry).to_contain_text("just now")
    entry_box = box(page, f'.activity-item[data-turn="{listed_turn["turn_id"]}"]')
    assert entry_box["x"] >= drawer["x"] and entry_box["x"] + entry_box["width"] <= drawer["x"] + drawer["width"]
    page.screenshot(path=str(gateway.home.parent / f"activity-list-{width}.png"))  # for a person to look at

    entry.get_by_role("button").focus()  # by keyboard: the entry is a button
    page.keyboard.press("Enter")
    turn = panel.locator("#activity-turn")
    expect(turn.get_by_role("heading", name="Turn in what files do I have?")).to_be_visible()
    expect(turn.get_by_role("heading", name="Model calls")).to_be_visible()
    expect(turn.locator(".activity-model-call")).to_have_count(2)
    tool = turn.locator(".activity-tool summary")
    expect(tool).to_contain_text("list_dir")
    expect(tool).to_be_visible()
    arguments = turn.locator(".activity-args")
    expect(arguments).to_be_hidden()  # collapsed until asked for
    tool.click()
    expect(arguments).to_be_visible()
    expect(arguments).to_contain_text('"path": "."')
    assert box(page, ".activity-args")["x"] + box(page, ".activity-args")["width"] <= width
    page.screenshot(path=str(gateway.home.parent / f"activity-turn-{width}.png"))

    panel.get_by_role("button", name="Back to the list").click()
    expect(entry.get_by_role("button")).to_be_focused()  # the keyboard is back where it was
    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    page.locator("#sign-out").click()
    expect(page.locator("#open-activity")).to_be_hidden()
    expect(page.locator("#activity-list li")).to_have_count(0)  # nothing of alice's stays on the page


@needs_chromium
@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_each_outcome_has_a_colour_of_its_own_in_either_theme(page: Page, gateway: GatewayProcess,
                                                             scheme: str) -> None:
    page.emulate_media(color_scheme=scheme)
    sign_in(page, gateway, SECRETS["alice"])
    expect(page.locator("#app-view")).to_be_visible()
    faces = page.evaluate("""statuses => statuses.map(status => {
        const badge = document.createElement("span");
        badge.className = `activity-status activity-status-${status}`;
        document.body.append(badge);
        const style = getComputedStyle(badge);
        const face = [style.backgroundColor, style.color];
        badge.remove();
        return face;
    })""", ["ok", "failed", "cancelled", "stopped"])
    backgrounds = [background for background, _ in faces]
    assert len(set(backgrounds)) == 4, dict(zip(["ok", "failed", "cancelled", "stopped"], faces))
    assert all(background != text for background, text in faces)


@needs_chromium
def test_the_activity_panel_shows_a_delegated_task_under_its_turn(page: Page, model: ModelServer,
                                                                  gateway: GatewayProcess, clients: Clients) -> None:
    page.goto(gateway.url("/"))
    sign_in(page, gateway, SECRETS["alice"])
    model.push(*DELEGATED)
    send(page, "Have a helper look at my files.")
    expect(answer(page)).to_have_text("You have notes.txt", timeout=30_000)  # four model calls, two turns
    session = page.url.split("#", 1)[1]
    wait_until(lambda: bool(listed(clients["alice"], session=session)), timeout_s=10, what="the turn's trace")
    [listed_turn] = listed(clients["alice"], session=session)
    page.get_by_role("button", name="Activity", exact=True).click()
    panel = page.get_by_role("dialog", name="Activity")
    # Loaded ("Loading…" gone), and not "Could not load the activity: …".
    expect(panel.locator("#activity-status")).to_have_text("", timeout=30_000)
    panel.locator(f'.activity-item[data-turn="{listed_turn["turn_id"]}"]').get_by_role("button").click()
    turn = panel.locator("#activity-turn")
    expect(turn.get_by_role("heading", name="Delegated tasks")).to_be_visible()
    task = turn.locator(".activity-delegation > details > summary")
    expect(task).to_contain_text("An agent · Done")
    child_tool = turn.locator(".activity-delegation .activity-tool summary")
    expect(child_tool).to_be_hidden()  # inside the collapsed task
    task.click()
    expect(child_tool).to_contain_text("list_dir")
    expect(child_tool).to_be_visible()
