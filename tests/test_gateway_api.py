"""`ember serve` over real HTTP, as its clients see it: keys, isolation between
identities, bad input, rate limits, clients that leave mid-stream, a failing
model, metrics and the OpenAPI document.

One gateway (and one scripted model server) serves the module; a second one,
with a tiny rate limit, serves the rate-limit test. Tests that need a fresh
session name one with `fresh()`, so they do not depend on each other's order.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember.channels.gateway.metrics import ProcessMetrics
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply, serving
from tests.sse import Event, sse_events

SECRETS = {
    "alice": "alice-secret-0123456789",
    "bob": "bob-secret-0123456789ab",
    # Differs from "alice" only in case: another identity.
    "Alice": "ALICE-secret-9876543210",
    # Sends the bad requests, so its session list stays small and its own.
    "carol": "carol-secret-0123456789",
}
MAX_BODY_BYTES = 2048
ERROR_FIELDS = {"message", "type", "code", "param"}
CHAT = "/v1/chat/completions"


def answer_to(body: dict[str, Any]) -> Reply:
    """The default model: echoes the newest user message."""
    users = [m for m in body["messages"] if m["role"] == "user"]
    return Reply(text=f"echo: {users[-1]['content']}" if users else "ok")


def failing(body: dict[str, Any]) -> Reply:
    return Reply(status=500)


@pytest.fixture(scope="module")
def model_module() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(autouse=True)
def model(model_module: ModelServer) -> ModelServer:
    """The module's model server, answering every call with an echo. A test that needs
    another answer sets `responder` (not `push`: a reply left over would go to the next test)."""
    model_module.responder = answer_to
    return model_module


@pytest.fixture(scope="module")
def gateways(model_module: ModelServer, launch_module_gateway: LaunchGateway) -> dict[str, GatewayProcess]:
    """The module's gateways, started side by side (each takes seconds to start): "main",
    with no practical rate limit, and "limited": three requests at once per identity, then one a minute."""

    def launch(per_minute: str, burst: str) -> GatewayProcess:
        return launch_module_gateway(model_module, keys=SECRETS, ready=False,
                                     EMBER_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY_BYTES), EMBER_MODEL_MAX_ATTEMPTS="1",
                                     EMBER_GATEWAY_RATE_PER_MINUTE=per_minute, EMBER_GATEWAY_RATE_BURST=burst)

    started = {"main": launch("1000000", "1000000"), "limited": launch("1", "3")}
    for each in started.values():
        each.wait_ready()
    return started


@pytest.fixture(scope="module")
def gateway(gateways: dict[str, GatewayProcess]) -> GatewayProcess:
    return gateways["main"]


@pytest.fixture(scope="module")
def limited_gateway(gateways: dict[str, GatewayProcess]) -> GatewayProcess:
    return gateways["limited"]


def auth(identity: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[identity]}"}


Clients = dict[str | None, httpx.Client]


@pytest.fixture(scope="module")
def clients(gateway: GatewayProcess) -> Iterator[Clients]:
    """`clients["alice"]`: an HTTP client of the main gateway holding that identity's key (None: no key).
    Kept for the module: making one costs a TLS context."""
    made = {identity: httpx.Client(base_url=gateway.base_url, headers=auth(identity), timeout=30)
            for identity in SECRETS}
    made[None] = httpx.Client(base_url=gateway.base_url, timeout=30)
    yield made
    for each in made.values():
        each.close()


@pytest.fixture
def anonymous(clients: Clients) -> httpx.Client:
    return clients[None]


def fresh(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# --- what a client reads -------------------------------------------------------------------------


def send(client: httpx.Client, key: str, text: str) -> list[Event]:
    """One turn on the native API; its Server-Sent Events."""
    response = client.post(f"/api/sessions/{key}/messages", json={"text": text})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return sse_events(response.text)


def final_text(events: list[Event]) -> str:
    finals = [e for e in events if e.name == "final"]
    assert len(finals) == 1, events
    text: str = finals[0].json()["text"]
    return text


def chat(client: httpx.Client, text: str, *, session: str | None = None, stream: bool = False,
         **extra: Any) -> httpx.Response:
    headers = {"X-Ember-Session": session} if session else {}
    body = {"model": "ember", "messages": [{"role": "user", "content": text}], "stream": stream, **extra}
    return client.post(CHAT, json=body, headers=headers)


def history(client: httpx.Client, key: str) -> list[dict[str, Any]]:
    response = client.get(f"/api/sessions/{key}/messages")
    assert response.status_code == 200, response.text
    messages: list[dict[str, Any]] = response.json()["messages"]
    return messages


def sessions_snapshot(client: httpx.Client) -> list[dict[str, Any]]:
    """The caller's sessions, as GET /api/sessions lists them."""
    response = client.get("/api/sessions")
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()["sessions"]
    return rows


def session_keys(client: httpx.Client) -> list[str]:
    return [row["key"] for row in sessions_snapshot(client)]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """A JSON error in the OpenAI shape, with that status (and code, if given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str) and error["message"].strip()
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


def seen_by_model(model: ModelServer, text: str) -> str:
    """Every message of the latest model request answering the user message `text`, as one string."""
    for body in reversed(model.requests):
        last = body["messages"][-1]
        if last["role"] == "user" and last["content"] == text:
            return json.dumps(body["messages"])
    raise AssertionError(f"the model was never asked {text!r}")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text as {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# --- keys ----------------------------------------------------------------------------------------

PROTECTED = [("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/v1/models"), ("GET", "/api/sessions"),
             ("POST", CHAT), ("GET", "/api/sessions/main/messages"), ("POST", "/api/sessions/main/messages")]
BAD_AUTHORIZATION = {
    "missing": None,
    "wrong key": "Bearer not-the-right-secret-at-all",
    "basic scheme": f"Basic {SECRETS['alice']}",
    "no scheme": SECRETS["alice"],
    "bearer without a key": "Bearer",
    "key with a suffix": f"Bearer {SECRETS['alice']}x",
    "key in upper case": f"Bearer {SECRETS['alice'].upper()}",
}


@pytest.mark.parametrize(("method", "path"), PROTECTED, ids=[f"{m} {p}" for m, p in PROTECTED])
@pytest.mark.parametrize("authorization", list(BAD_AUTHORIZATION.values()), ids=list(BAD_AUTHORIZATION))
def test_protected_routes_refuse_a_missing_or_bad_key(anonymous: httpx.Client, model: ModelServer, method: str,
                                                      path: str, authorization: str | None) -> None:
    calls = len(model.requests)
    headers = {"Authorization": authorization} if authorization is not None else {}
    body = {"model": "ember", "messages": [{"role": "user", "content": "hi"}], "text": "hi"}
    response = anonymous.request(method, path, headers=headers, json=body if method == "POST" else None)
    assert_error(response, 401, "invalid_api_key")
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert len(model.requests) == calls  # no turn ran


def test_liveness_and_the_page_need_no_key(anonymous: httpx.Client) -> None:
    health = anonymous.get("/healthz")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    page = anonymous.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")


def test_a_valid_key_opens_metrics_the_document_and_the_models(clients: Clients) -> None:
    alice = clients["alice"]
    metrics = alice.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    document = alice.get("/openapi.json")
    assert document.status_code == 200
    assert document.json()["openapi"].startswith("3.")
    models = alice.get("/v1/models")
    assert models.status_code == 200
    assert models.json()["object"] == "list"
    assert [card["id"] for card in models.json()["data"]] == ["ember"]


def test_metrics_tell_the_event_loops_lag(clients: Clients) -> None:
    """Sampled every tenth of a second from the start: a gateway up for a moment has samples."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = clients["alice"].get("/metrics").text
        found = re.search(r"^ember_event_loop_lag_seconds_count (\S+)$", text, re.MULTILINE)
        if found and float(found.group(1)) >= 3:
            break
        time.sleep(0.1)
    assert found and float(found.group(1)) >= 3, text
    assert "ember_event_loop_lag_seconds_bucket{le=\"0.05\"}" in text


# --- isolation between identities (I8) -----------------------------------------------------------


@dataclass
class AliceSession:
    key: str
    secret: str
    messages: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
def alice_only(clients: Clients, model: ModelServer) -> AliceSession:
    """A session of alice's, holding a text no one else may see."""
    session = AliceSession(fresh("alice-only"), f"alice's secret {uuid.uuid4().hex}")
    assert final_text(send(clients["alice"], session.key, session.secret)) == f"echo: {session.secret}"
    session.messages = history(clients["alice"], session.key)
    return session


def test_another_identity_gets_404_for_a_session_it_does_not_own(clients: Clients,
                                                                 alice_only: AliceSession) -> None:
    bob = clients["bob"]
    theirs = assert_error(bob.get(f"/api/sessions/{alice_only.key}/messages"), 404, "session_not_found")
    # Exactly what a key that exists nowhere gets: nothing tells bob the session exists.
    nowhere = assert_error(bob.get(f"/api/sessions/{fresh('nowhere')}/messages"), 404, "session_not_found")
    assert theirs["type"] == nowhere["type"]
    assert alice_only.secret not in json.dumps(theirs)


def test_another_identity_does_not_list_a_session_it_does_not_own(clients: Clients,
                                                                  alice_only: AliceSession) -> None:
    assert alice_only.key in session_keys(clients["alice"])
    assert alice_only.key not in session_keys(clients["bob"])


def test_posting_to_another_identitys_key_makes_a_session_of_ones_own(clients: Clients,
                                                                      model: ModelServer,
                                                                      alice_only: AliceSession) -> None:
    bob = clients["bob"]
    events = send(bob, alice_only.key, "bob was here")
    assert final_text(events) == "echo: bob was here"
    assert alice_only.secret not in json.dumps([e.data for e in events])
    assert alice_only.secret not in seen_by_model(model, "bob was here")
    assert [m["content"] for m in history(bob, alice_only.key)] == ["bob was here", "echo: bob was here"]
    assert history(clients["alice"], alice_only.key) == alice_only.messages


@pytest.mark.parametrize("via", ["X-Ember-Session header", "user field"])
def test_openai_route_with_another_identitys_session_sees_none_of_it(clients: Clients,
                                                                     model: ModelServer, alice_only: AliceSession,
                                                                     via: str) -> None:
    bob = clients["bob"]
    if via == "user field":
        response = chat(bob, "what did alice say?", user=alice_only.key)
    else:
        response = chat(bob, "what did alice say?", session=alice_only.key)
    assert response.status_code == 200, response.text
    assert response.headers["X-Ember-Session"] == alice_only.key
    assert response.json()["choices"][0]["message"]["content"] == "echo: what did alice say?"
    assert alice_only.secret not in seen_by_model(model, "what did alice say?")
    assert history(clients["alice"], alice_only.key) == alice_only.messages


def test_one_session_name_used_by_two_identities_is_two_sessions(clients: Clients,
                                                                 model: ModelServer) -> None:
    alice, bob = clients["alice"], clients["bob"]
    shared = fresh("shared-name")
    send(alice, shared, "alice speaking")
    send(bob, shared, "bob speaking")
    assert "alice speaking" not in seen_by_model(model, "bob speaking")
    send(alice, shared, "alice again")
    assert "alice speaking" in seen_by_model(model, "alice again")
    assert "bob speaking" not in seen_by_model(model, "alice again")
    assert [m["content"] for m in history(alice, shared) if m["role"] == "user"] == ["alice speaking", "alice again"]
    assert [m["content"] for m in history(bob, shared) if m["role"] == "user"] == ["bob speaking"]


def test_a_named_message_is_kept_and_remembered_under_its_authors_name(clients: Clients) -> None:
    """A client relaying a group chat names each message's author (the OpenAI `name`)."""
    alice, key, tag = clients["alice"], fresh("group"), uuid.uuid4().hex[:10]
    response = chat(alice, f"my locker code is zq{tag}", session=key,
                    messages=[{"role": "user", "name": "Gina Ruiz", "content": f"my locker code is zq{tag}"}])
    assert response.status_code == 200, response.text
    assert [m["name"] for m in history(alice, key)] == ["Gina Ruiz", None]

    def archived() -> list[dict[str, Any]]:
        # Only archival rows, and room for them: Alice's other memories (and this session's summary,
        # written in the background meanwhile) may rank close enough to push one out of a top 10.
        found = alice.get("/api/memory/search", params={"q": f"zq{tag}", "kind": "archival", "limit": 50})
        assert found.status_code == 200, found.text
        return [hit for hit in found.json() if hit["kind"] == "archival" and f"zq{tag}" in hit["content"]]

    wait_until(lambda: len(archived()) == 2)  # the message and the echo answering it
    said = {hit["subject"]: hit["content"] for hit in archived()}
    assert said == {"gina_ruiz": f"Gina Ruiz: my locker code is zq{tag}",
                    "assistant": f"echo: my locker code is zq{tag}"}


def test_an_evaluation_session_is_answered_and_kept_but_leaves_no_memory(clients: Clients) -> None:
    alice, tag = clients["alice"], uuid.uuid4().hex[:10]
    evaluated, control = fresh("eval"), fresh("control")
    response = alice.post(CHAT, json={"model": "ember", "messages": [
        {"role": "user", "content": f"my evaluation word is zq{tag}"}]},
        headers={"X-Ember-Session": evaluated, "X-Ember-Evaluation": "true"})
    assert response.status_code == 200, response.text
    events = alice.post(f"/api/sessions/{evaluated}/messages", json={"text": f"and again zq{tag}"},
                        headers={"X-Ember-Evaluation": "true"})
    assert events.status_code == 200
    final_text(sse_events(events.text))
    assert final_text(send(alice, control, f"my control word is zq{tag}x"))

    def found(word: str) -> list[str]:
        hits = alice.get("/api/memory/search", params={"q": word})
        assert hits.status_code == 200, hits.text
        return [hit["content"] for hit in hits.json() if word in hit["content"].split()]

    # The control turn's memory is written by the same kind of job, queued after the evaluation's.
    wait_until(lambda: len(found(f"zq{tag}x")) == 2)
    assert found(f"zq{tag}") == []
    assert [m["content"] for m in history(alice, evaluated) if m["role"] == "user"] == [
        f"my evaluation word is zq{tag}", f"and again zq{tag}"]


def test_identities_differing_only_in_case_stay_separate(clients: Clients, model: ModelServer,
                                                         alice_only: AliceSession) -> None:
    other = clients["Alice"]
    assert_error(other.get(f"/api/sessions/{alice_only.key}/messages"), 404, "session_not_found")
    assert alice_only.key not in session_keys(other)
    send(other, alice_only.key, "capital A here")
    assert alice_only.secret not in seen_by_model(model, "capital A here")
    assert [m["content"] for m in history(other, alice_only.key)] == ["capital A here", "echo: capital A here"]
    assert history(clients["alice"], alice_only.key) == alice_only.messages


# --- bad input -----------------------------------------------------------------------------------

JSON_TYPE = {"Content-Type": "application/json"}
GOOD_CHAT = {"model": "ember", "messages": [{"role": "user", "content": "hi"}]}
TOO_LONG = "x" * (MAX_BODY_BYTES + 100)


def chunked(data: bytes, size: int = 256) -> Iterator[bytes]:
    """A body without Content-Length: the limit must hold while it is read."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


@dataclass(frozen=True)
class Bad:
    method: str
    path: str
    status: int
    code: str | None
    body: Any = None  # sent as JSON
    content: bytes | None = None  # sent as it is
    headers: dict[str, str] = field(default_factory=dict)
    chunks: bool = False


BAD_REQUESTS = {
    # the OpenAI route
    "chat: malformed JSON": Bad("POST", CHAT, 400, "invalid_json", content=b'{"model": "ember", "messages": [',
                                headers=JSON_TYPE),
    "chat: empty body": Bad("POST", CHAT, 400, "invalid_json", content=b"", headers=JSON_TYPE),
    "chat: body not UTF-8": Bad("POST", CHAT, 400, "invalid_json", content=b'{"model": "\xff\xfe"}',
                                headers=JSON_TYPE),
    "chat: wrong types": Bad("POST", CHAT, 422, "invalid_request", body={"model": 7, "messages": "hello"}),
    "chat: a list, not an object": Bad("POST", CHAT, 422, "invalid_request", body=[GOOD_CHAT]),
    "chat: missing messages": Bad("POST", CHAT, 422, "invalid_request", body={"model": "ember"}),
    "chat: no messages": Bad("POST", CHAT, 422, "invalid_request", body={"model": "ember", "messages": []}),
    "chat: unknown role": Bad("POST", CHAT, 422, "invalid_request",
                              body={"model": "ember", "messages": [{"role": "robot", "content": "hi"}]}),
    "chat: an evaluation header neither true nor false": Bad("POST", CHAT, 400, "invalid_evaluation_header",
                                                             body=GOOD_CHAT, headers={"X-Ember-Evaluation": "maybe"}),
    "send: an evaluation header neither true nor false": Bad("POST", "/api/sessions/bad-input/messages", 400,
                                                             "invalid_evaluation_header", body={"text": "hi"},
                                                             headers={"X-Ember-Evaluation": "yes"}),
    "chat: a name with a line break": Bad("POST", CHAT, 422, "invalid_request", body={"model": "ember", "messages": [
        {"role": "user", "name": "Gina\nsystem", "content": "hi"}]}),
    "chat: no user message": Bad("POST", CHAT, 400, "no_user_message", body={"model": "ember", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "assistant", "content": "hello"}]}),
    "chat: blank user message": Bad("POST", CHAT, 400, "no_user_message",
                                    body={"model": "ember", "messages": [{"role": "user", "content": "  \n "}]}),
    "chat: text/plain": Bad("POST", CHAT, 415, "unsupported_media_type", content=json.dumps(GOOD_CHAT).encode(),
                            headers={"Content-Type": "text/plain"}),
    "chat: no content type": Bad("POST", CHAT, 415, "unsupported_media_type", content=json.dumps(GOOD_CHAT).encode()),
    "chat: form": Bad("POST", CHAT, 415, "unsupported_media_type", content=b"model=ember",
                      headers={"Content-Type": "application/x-www-form-urlencoded"}),
    "chat: oversize": Bad("POST", CHAT, 413, "body_too_large",
                          body={"model": "ember", "messages": [{"role": "user", "content": TOO_LONG}]}),
    "chat: oversize, chunked": Bad("POST", CHAT, 413, "body_too_large", headers=JSON_TYPE, chunks=True,
                                   content=json.dumps({"model": "ember", "messages": [
                                       {"role": "user", "content": TOO_LONG}]}).encode()),
    "chat: invalid session header": Bad("POST", CHAT, 400, "invalid_session_key", body=GOOD_CHAT,
                                        headers={"X-Ember-Session": "no spaces allowed"}),
    "chat: invalid user field": Bad("POST", CHAT, 400, "invalid_session_key", body={**GOOD_CHAT, "user": "a/b"}),
    "chat: invalid user field beside a session header": Bad("POST", CHAT, 400, "invalid_session_key",
                                                            body={**GOOD_CHAT, "user": "bs*"},
                                                            headers={"X-Ember-Session": "bad-input"}),
    # the native API
    "send: malformed JSON": Bad("POST", "/api/sessions/bad-input/messages", 400, "invalid_json",
                                content=b'{"text": ', headers=JSON_TYPE),
    "send: wrong type": Bad("POST", "/api/sessions/bad-input/messages", 422, "invalid_request", body={"text": 3}),
    "send: missing text": Bad("POST", "/api/sessions/bad-input/messages", 422, "empty_message", body={}),
    "send: unknown field": Bad("POST", "/api/sessions/bad-input/messages", 422, "invalid_request",
                               body={"text": "hi", "role": "system"}),
    "send: empty text": Bad("POST", "/api/sessions/bad-input/messages", 422, "empty_message", body={"text": ""}),
    "send: blank text": Bad("POST", "/api/sessions/bad-input/messages", 422, "empty_message", body={"text": " \t"}),
    "send: text/plain": Bad("POST", "/api/sessions/bad-input/messages", 415, "unsupported_media_type",
                            content=b'{"text": "hi"}', headers={"Content-Type": "text/plain"}),
    "send: oversize": Bad("POST", "/api/sessions/bad-input/messages", 413, "body_too_large", body={"text": TOO_LONG}),
    "send: oversize, chunked": Bad("POST", "/api/sessions/bad-input/messages", 413, "body_too_large",
                                   content=json.dumps({"text": TOO_LONG}).encode(), headers=JSON_TYPE, chunks=True),
    "send: invalid key": Bad("POST", "/api/sessions/no spaces/messages", 400, "invalid_session_key",
                             body={"text": "hi"}),
    "send: key too long": Bad("POST", f"/api/sessions/{'k' * 129}/messages", 400, "invalid_session_key",
                              body={"text": "hi"}),
    "history: unknown session": Bad("GET", "/api/sessions/never-used/messages", 404, "session_not_found"),
    "history: invalid key": Bad("GET", "/api/sessions/-leading-dash/messages", 400, "invalid_session_key"),
    # routing
    "unknown route": Bad("GET", "/v1/nothing-here", 404, None),
    "unknown route below a session": Bad("GET", "/api/sessions/main/other", 404, None),
    "wrong method on chat": Bad("GET", CHAT, 405, None),
    "wrong method on sessions": Bad("DELETE", "/api/sessions", 405, None),
    "wrong method on models": Bad("POST", "/v1/models", 405, None, body={}),
}


@pytest.mark.parametrize("bad", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_bad_requests_get_a_clear_json_error_and_change_nothing(clients: Clients,
                                                                model: ModelServer, bad: Bad) -> None:
    carol = clients["carol"]
    before, calls = sessions_snapshot(carol), len(model.requests)
    content = chunked(bad.content) if bad.chunks and bad.content is not None else bad.content
    response = carol.request(bad.method, bad.path, json=bad.body, content=content, headers=bad.headers)
    assert_error(response, bad.status, bad.code)
    if bad.status == 405:
        assert response.headers["Allow"]
    assert sessions_snapshot(carol) == before
    assert len(model.requests) == calls
    # The gateway still serves a normal turn.
    assert final_text(send(carol, fresh("after-bad-input"), "and now a good one")) == "echo: and now a good one"


@pytest.mark.parametrize("path", [CHAT, "/api/sessions/nested/messages"])
def test_deeply_nested_json_is_a_client_error(clients: Clients, path: str) -> None:
    carol = clients["carol"]
    depth = MAX_BODY_BYTES // 2 - 10  # within the size limit, deeper than Python's recursion limit
    response = carol.post(path, content=b"[" * depth + b"]" * depth, headers=JSON_TYPE)
    assert_error(response, 400, "invalid_json")


@pytest.mark.parametrize("path", [
    CHAT,
    "/api/sessions/surrogate/messages",
])
def test_a_lone_surrogate_is_rejected_before_any_turn(clients: Clients, model: ModelServer,
                                                      path: str) -> None:
    carol = clients["carol"]
    before, calls = sessions_snapshot(carol), len(model.requests)
    text = r'"a lone \ud800 surrogate"'  # valid JSON; no valid UTF-8 string
    if path == CHAT:
        body = f'{{"model": "ember", "messages": [{{"role": "user", "content": {text}}}]}}'
    else:
        body = f'{{"text": {text}}}'
    response = carol.post(path, content=body.encode(), headers=JSON_TYPE)
    assert response.status_code in (400, 422), response.text
    assert_error(response, response.status_code)
    assert sessions_snapshot(carol) == before
    assert len(model.requests) == calls


@pytest.mark.parametrize("via", ["chat user field", "chat stream user field", "send", "history"])
def test_a_session_key_ending_in_a_newline_is_invalid(clients: Clients, model: ModelServer,
                                                      via: str) -> None:
    carol = clients["carol"]
    before, calls = sessions_snapshot(carol), len(model.requests)
    key = fresh("newline")
    try:
        if via == "send":
            response = carol.post(f"/api/sessions/{key}%0A/messages", json={"text": "hi"})
        elif via == "history":
            response = carol.get(f"/api/sessions/{key}%0A/messages")
        else:
            response = chat(carol, "hi", user=f"{key}\n", stream=via == "chat stream user field")
    except httpx.RemoteProtocolError as exc:
        pytest.fail(f"the gateway dropped the connection: {exc}")
    assert_error(response, 400, "invalid_session_key")
    assert sessions_snapshot(carol) == before
    assert len(model.requests) == calls


def test_405_names_every_method_of_the_route(clients: Clients) -> None:
    response = clients["carol"].delete("/api/sessions/main/messages")
    assert_error(response, 405)
    allowed = {method.strip() for method in response.headers["Allow"].split(",")}
    assert {"GET", "POST"} <= allowed


# --- rate limit ----------------------------------------------------------------------------------


def test_a_burst_over_the_limit_gets_429_with_retry_after_for_that_identity_only(
        limited_gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=limited_gateway.base_url, timeout=30) as http:
        assert [http.get("/v1/models", headers=auth("alice")).status_code for _ in range(3)] == [200] * 3
        limited = http.get("/v1/models", headers=auth("alice"))
        assert_error(limited, 429, "rate_limited")
        assert 1 <= int(limited.headers["Retry-After"]) <= 60
        # The message says what the header says.
        assert f"retry in {limited.headers['Retry-After']} s" in limited.json()["error"]["message"]
        assert http.get("/v1/models", headers=auth("bob")).status_code == 200
        assert http.get("/healthz").status_code == 200


# --- a client that leaves mid-stream ---------------------------------------------------------------

SLOW_ANSWER = "This answer arrives slowly, long after the client has left; the turn commits it whole, once."
SLOW_CHUNKS = len(SLOW_ANSWER) // 4 + 2  # the stream's events: a role chunk, the text, a finish chunk


def is_delta(route: str, line: str) -> bool:
    if route == "native":
        return line == "event: delta"
    return line.startswith("data: {") and '"content": "' in line and '"role"' not in line


def open_and_leave(client: httpx.Client, route: str, key: str) -> None:
    """Start a streamed turn, read two deltas, close the connection."""
    if route == "native":
        request = client.build_request("POST", f"/api/sessions/{key}/messages", json={"text": "take your time"})
    else:
        request = client.build_request("POST", CHAT, headers={"X-Ember-Session": key}, json={
            "model": "ember", "stream": True, "messages": [{"role": "user", "content": "take your time"}]})
    response = client.send(request, stream=True)
    try:
        assert response.status_code == 200
        deltas = 0
        for line in response.iter_lines():
            deltas += is_delta(route, line)
            if deltas == 2:
                break
        assert deltas == 2
    finally:
        response.close()


@pytest.mark.parametrize("route", ["native", "openai"])
def test_a_client_leaving_mid_stream_still_gets_the_whole_answer_committed_once(
        clients: Clients, model: ModelServer, route: str) -> None:
    alice = clients["alice"]
    key = fresh(f"leaving-{route}")
    slow = Reply(text=SLOW_ANSWER, chunk_delay_s=0.05)
    # Only this turn's call gets the slow answer: the titles of earlier tests' sessions may call meanwhile.
    model.responder = lambda body: slow if answer_to(body).text == "echo: take your time" else answer_to(body)
    open_and_leave(alice, route, key)
    # The model was still streaming when the client left.
    assert model.chunks_by_reply.get(id(slow), 0) < SLOW_CHUNKS
    model.responder = answer_to

    def answered() -> bool:
        response = alice.get(f"/api/sessions/{key}/messages")
        return response.status_code == 200 and any(m["role"] == "assistant" for m in response.json()["messages"])

    wait_until(answered, timeout_s=20, what="the committed answer")
    assert [(m["role"], m["content"]) for m in history(alice, key)] == [
        ("user", "take your time"), ("assistant", SLOW_ANSWER)]
    # The next turn works, on a history holding the whole answer once (the same answer in alice's
    # session of the other route may also be recalled from memory, in a system message of its own).
    assert final_text(send(alice, key, "still there?")) == "echo: still there?"
    conversation = [m for m in json.loads(seen_by_model(model, "still there?")) if m["role"] != "system"]
    assert json.dumps(conversation).count(SLOW_ANSWER) == 1
    assert [m["role"] for m in history(alice, key)] == ["user", "assistant", "user", "assistant"]


# --- a failing model -----------------------------------------------------------------------------


def test_a_failing_model_is_a_502_on_the_openai_route(clients: Clients,
                                                      model: ModelServer) -> None:
    alice = clients["alice"]
    key = fresh("failing-openai")
    model.responder = failing
    response = chat(alice, "please fail", session=key)
    error = assert_error(response, 502, "turn_failed")
    assert response.headers["X-Ember-Session"] == key
    assert unanswered_with(history(alice, key), "please fail") == error["message"]


def test_a_failing_model_ends_the_openai_stream_with_one_error(clients: Clients,
                                                               model: ModelServer) -> None:
    alice = clients["alice"]
    key = fresh("failing-openai-stream")
    model.responder = failing
    response = chat(alice, "please fail", session=key, stream=True)
    assert response.status_code == 200
    events = sse_events(response.text)
    errors = [e for e in events if e.data != "[DONE]" and "error" in e.json()]
    assert len(errors) == 1
    assert set(errors[0].json()["error"]) == ERROR_FIELDS
    assert events[-1].data == "[DONE]"
    assert unanswered_with(history(alice, key), "please fail") == errors[0].json()["error"]["message"]


def test_a_failing_model_is_one_error_event_on_the_native_stream(clients: Clients,
                                                                 model: ModelServer) -> None:
    alice = clients["alice"]
    key = fresh("failing-native")
    model.responder = failing
    events = send(alice, key, "please fail")
    assert [e.name for e in events] == ["error"]
    assert unanswered_with(history(alice, key), "please fail") == events[0].json()["text"]
    # The session goes on: the next turn answers, and the model sees the unanswered message
    # but not the error record, which is the history's, not the conversation's.
    model.responder = answer_to
    assert final_text(send(alice, key, "try again")) == "echo: try again"
    seen = seen_by_model(model, "try again")
    assert "please fail" in seen and events[0].json()["text"] not in seen
    assert [(m["role"], m["kind"]) for m in history(alice, key)] == [
        ("user", "message"), ("assistant", "error"), ("user", "message"), ("assistant", "message")]


def unanswered_with(messages: list[dict[str, Any]], question: str) -> str:
    """The history of a session whose one turn failed: its question, then the error record in the
    place of the answer (not a message the model reads: no seq). The record's text."""
    assert [(m["role"], m["content"], m["kind"]) for m in messages][:1] == [("user", question, "message")]
    assert [(m["role"], m["kind"], m["seq"]) for m in messages[1:]] == [("assistant", "error", None)]
    assert messages[1]["turn_id"] == messages[0]["turn_id"]
    text: str = messages[1]["content"]
    assert text.startswith("Sorry")
    return text


def test_a_retry_of_a_failed_message_answers_it_in_place_of_the_error(clients: Clients,
                                                                      model: ModelServer) -> None:
    alice = clients["alice"]
    key = fresh("retried")
    model.responder = failing
    body = {"text": "flaky question", "message_id": "m-flaky-1"}
    events = sse_events(alice.post(f"/api/sessions/{key}/messages", json=body).text)
    assert [e.name for e in events] == ["error"]
    failed = history(alice, key)
    assert failed[1]["kind"] == "error" and failed[1]["message_id"] == "m-flaky-1"  # what a Retry resends
    model.responder = answer_to
    events = sse_events(alice.post(f"/api/sessions/{key}/messages", json=body).text)
    assert final_text(events) == "echo: flaky question"
    assert [(m["role"], m["content"], m["kind"]) for m in history(alice, key)] == [
        ("user", "flaky question", "message"), ("assistant", "echo: flaky question", "message")]


# --- stopping a turn -----------------------------------------------------------------------------


def test_stop_ends_the_running_turn_and_its_history_says_so(clients: Clients, model: ModelServer) -> None:
    alice, bob = clients["alice"], clients["bob"]
    key = fresh("stopped")
    model.responder = lambda body: Reply(text=SLOW_ANSWER * 3, chunk_delay_s=0.05)
    request = alice.build_request("POST", f"/api/sessions/{key}/messages",
                                  json={"text": "write at length", "message_id": "m-stop-1"})
    response = alice.send(request, stream=True)
    try:
        lines = response.iter_lines()
        assert next(line for line in lines if line == "event: delta")
        # Another identity cannot see the session, let alone stop its turn.
        assert_error(bob.post(f"/api/sessions/{key}/stop"), 404, "session_not_found")
        stopping = alice.post(f"/api/sessions/{key}/stop")
        assert stopping.status_code == 202, stopping.text
        assert stopping.json()["status"] == "stopping"
        rest = sse_events("\n".join(lines))
    finally:
        response.close()
    ends = [e for e in rest if e.name in ("final", "error")]
    assert [e.name for e in ends] == ["error"]
    assert ends[0].json()["turn_id"] == stopping.json()["turn_id"]
    assert ends[0].json()["text"].startswith("Stopped")
    model.responder = answer_to
    messages = history(alice, key)
    assert [(m["role"], m["kind"]) for m in messages] == [("user", "message"), ("assistant", "error")]
    assert messages[1]["content"] == ends[0].json()["text"] and messages[1]["message_id"] == "m-stop-1"
    assert_error(alice.post(f"/api/sessions/{key}/stop"), 409, "no_running_turn")
    assert_error(alice.post(f"/api/sessions/{fresh('never')}/stop"), 404, "session_not_found")
    # The session goes on.
    assert final_text(send(alice, key, "short please")) == "echo: short please"


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_count_the_turns_done(clients: Clients, model: ModelServer) -> None:
    alice = clients["alice"]
    before = samples(alice.get("/metrics").text)
    key = fresh("metered")
    for text in ("one", "two"):
        assert chat(alice, text, session=key).status_code == 200
    assert chat(alice, "three", session=key, stream=True).status_code == 200
    send(alice, key, "four")
    model.responder = failing
    send(alice, key, "five fails")
    response = alice.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = samples(response.text)

    def grew(name: str, **labels: str) -> float:
        sample = (name, tuple(sorted(labels.items())))
        return after[sample] - before.get(sample, 0.0)

    assert grew("ember_turns_total", api="openai", outcome="final") == 3
    assert grew("ember_turns_total", api="native", outcome="final") == 1
    assert grew("ember_turns_total", api="native", outcome="error") == 1
    assert grew("ember_turn_duration_seconds_count", api="openai") == 3
    assert grew("ember_turn_duration_seconds_count", api="native") == 2
    assert grew("ember_turn_duration_seconds_bucket", api="openai", le="+Inf") == 3
    assert grew("ember_deliveries_total", outcome="delivered") == 5
    statuses = {dict(labels)["status"] for name, labels in after if name == "ember_background_jobs"}
    assert {"pending", "running", "done", "failed"} <= statuses


# --- the OpenAPI document ------------------------------------------------------------------------

API_OPERATIONS = {("/v1/chat/completions", "post"), ("/v1/models", "get"), ("/api/sessions", "get"),
                  ("/api/sessions/{key}/messages", "get"), ("/api/sessions/{key}/messages", "post"),
                  ("/api/approvals", "get"), ("/api/approvals/{id}", "post"), ("/api/memory", "get"),
                  ("/api/memory", "post"), ("/api/memory/search", "get"), ("/api/memory/{id}", "delete"),
                  ("/healthz", "get"), ("/metrics", "get")}
PROBED_METHODS = ("get", "post", "put", "patch", "delete")


def test_the_openapi_document_and_the_server_have_the_same_operations(clients: Clients,
                                                                      alice_only: AliceSession) -> None:
    alice = clients["alice"]
    document = alice.get("/openapi.json").json()
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert documented >= API_OPERATIONS
    served = set()
    for path in document["paths"]:
        url = path.replace("{key}", alice_only.key)
        for method in PROBED_METHODS:
            # An empty object is not a valid body anywhere: no turn runs, whatever the route.
            response = alice.request(method, url, json={} if method != "get" else None)
            assert response.status_code != 404 or response.json()["error"]["code"] is not None, (method, url)
            if response.status_code != 405:
                served.add((path, method))
    assert served == documented


def test_sessions_are_renamed_and_put_away_by_their_owner_only(clients: Clients, alice_only: AliceSession) -> None:
    alice, bob = clients["alice"], clients["bob"]
    path = f"/api/sessions/{alice_only.key}"
    assert bob.patch(path, json={"title": "mine now"}).status_code == 404
    assert bob.delete(path).status_code == 404
    renamed = alice.patch(path, json={"title": "  Secret   plans "})
    assert renamed.status_code == 200 and renamed.json()["title"] == "Secret plans"
    listed = {s["key"]: s for s in alice.get("/api/sessions").json()["sessions"]}
    assert listed[alice_only.key]["title"] == "Secret plans"
    assert alice.patch(path, json={"title": "x" * 121}).status_code == 422
    assert alice.patch(path, json={"colour": "red"}).status_code == 422
    assert alice.get("/api/sessions", params={"archived": "maybe"}).status_code == 400
    assert alice.delete(path).status_code == 200
    assert alice_only.key not in {s["key"] for s in alice.get("/api/sessions").json()["sessions"]}
    assert alice.patch(path, json={"archived": False}).status_code == 200
    assert alice_only.key in {s["key"] for s in alice.get("/api/sessions").json()["sessions"]}
    assert alice.patch(path, json={"title": ""}).json()["title"] == ""
    assert history(alice, alice_only.key) == alice_only.messages


# --- titles --------------------------------------------------------------------------------------


def test_the_background_model_titles_a_session_after_its_first_exchange(clients: Clients,
                                                                        model: ModelServer) -> None:
    alice = clients["alice"]
    key = fresh("titled")
    before = len(model.titled)
    model.titler = lambda body: Reply(text='Title: "Planning the spring garden."')
    try:
        assert final_text(send(alice, key, "what should I plant in March?")) == "echo: what should I plant in March?"

        def title() -> str | None:
            return {s["key"]: s["title"] for s in sessions_snapshot(alice)}[key]

        wait_until(lambda: title() == "Planning the spring garden", timeout_s=20, what="the model's title")
        # Other sessions' title jobs may be asked meanwhile: this session's is the one with its question.
        mine = [r["messages"][-1]["content"] for r in model.titled[before:]
                if "what should I plant in March?" in r["messages"][-1]["content"]]
        assert len(mine) == 1
        assert "echo: what should I plant in March?" in mine[0]  # it read the answer too
        # Only the first exchange is titled, and a person's name for the session wins.
        send(alice, key, "and in April?")
        assert alice.patch(f"/api/sessions/{key}", json={"title": "Garden"}).status_code == 200
        assert title() == "Garden"
        assert not any("and in April?" in r["messages"][-1]["content"] for r in model.titled[before:])
    finally:
        model.titler = lambda body: Reply(text="")


async def test_a_blocked_event_loop_shows_as_lag() -> None:
    metrics = ProcessMetrics()
    watching = asyncio.create_task(metrics.watch_event_loop(every_s=0.01))
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # a handler that blocks the loop: every request of the process waits this long
    await asyncio.sleep(0.05)
    watching.cancel()
    text = metrics.response({}).body.decode()
    assert re.search(r'^ember_event_loop_lag_seconds_bucket\{le="0.1"\} (\S+)$', text, re.MULTILINE)
    below = float(re.search(r'^ember_event_loop_lag_seconds_bucket\{le="0.1"\} (\S+)$', text, re.MULTILINE)[1])
    count = float(re.search(r"^ember_event_loop_lag_seconds_count (\S+)$", text, re.MULTILINE)[1])
    assert count - below == 1  # the one sample the block delayed by about 0.3 s
    assert float(re.search(r"^ember_event_loop_lag_seconds_sum (\S+)$", text, re.MULTILINE)[1]) >= 0.25
