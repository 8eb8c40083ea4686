"""Signed webhooks against a real `ember serve`: requests in, answers out to a receiver of the
test's own that checks them with the Standard Webhooks reference library."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import sqlite3
import subprocess
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks import Webhook, WebhookVerificationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.webhooks.signing import SignatureError, sign_standard, standard_key, verify_standard
from ember.channels.webhooks.template import TemplateError, render
from tests.gatewayproc import EMBER, GatewayProcess, LaunchGateway, free_port, gateway_env
from tests.loopback import LoopbackServer, started, wait_until
from tests.modelserver import ModelServer, Reply, serving

SECRET = "whsec_" + base64.b64encode(b"ember-test-webhook-key-32-bytes!").decode()
OPS_SECRET = "whsec_" + base64.b64encode(b"the-ops-receiver-key-of-the-test").decode()
GITHUB_SECRET = "a plain github secret"
PATH_TOKEN = "path-token-never-logged"  # chat platforms put a webhook's secret in its URL


@dataclass
class Receiver:
    """An outbound target: records every POST, answers with the statuses the test queues (200 after)."""

    statuses: deque[int] = field(default_factory=deque)
    received: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server = LoopbackServer(Starlette(routes=[Route("/hook", self._hook, methods=["POST"])]), "receiver")

    @property
    def url(self) -> str:
        return f"{self._server.origin}/hook"

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    async def _hook(self, request: Request) -> Response:
        body = await request.body()
        try:
            Webhook(OPS_SECRET).verify(body, dict(request.headers))
            verified = True
        except WebhookVerificationError:
            verified = False
        status = self.statuses.popleft() if self.statuses else 200
        self.received.append({"id": request.headers.get("webhook-id"), "verified": verified,
                              "body": json.loads(body), "status": status})
        return JSONResponse({"ok": status < 300}, status_code=status)

    def ids(self) -> list[str]:
        return [r["id"] for r in self.received]


def config(receiver_url: str) -> str:
    return f"""
web_fetch_allowed_hosts = ["127.0.0.1"]

[webhooks.ci]
secret = "{SECRET}"
message = "CI says: {{text}} (build {{build.number}})"
session = "ci-{{repo.name}}"
reply_to = "ops"

[webhooks.quiet]
secret = "{SECRET}"
message = "{{text}}"

[webhooks.gh]
scheme = "github"
secret = "{GITHUB_SECRET}"
message = "GitHub: {{action}} on {{repository.full_name}}"

[outbound.ops]
url = "{receiver_url}?token={PATH_TOKEN}"
secret = "{OPS_SECRET}"
max_attempts = 3
"""


@dataclass
class Rig:
    gateway: GatewayProcess
    model: ModelServer
    receiver: Receiver

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.gateway.home / 'ember.db'}?mode=ro", uri=True)

    def messages(self, session_key: str) -> list[tuple[str, str]]:
        with self.db() as conn:
            return conn.execute("SELECT role, content FROM messages WHERE session_key = ? ORDER BY seq",
                                (session_key,)).fetchall()

    def sessions(self) -> set[str]:
        with self.db() as conn:
            return {key for (key,) in conn.execute("SELECT key FROM sessions")}


@pytest.fixture(scope="module")
def rig(launch_module_gateway: LaunchGateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with serving() as model, started(Receiver()) as receiver:
        home = tmp_path_factory.mktemp("webhooks") / "home"
        home.mkdir()
        (home / "ember.toml").write_text(config(receiver.url))
        yield Rig(launch_module_gateway(model, home=home), model, receiver)


def signed(body: bytes, *, secret: str = SECRET, message_id: str | None = None,
           timestamp: int | None = None) -> dict[str, str]:
    message_id = message_id or f"msg_{uuid.uuid4().hex}"
    stamp = int(time.time()) if timestamp is None else timestamp
    return {"webhook-id": message_id, "webhook-timestamp": str(stamp), "content-type": "application/json",
            "webhook-signature": sign_standard(standard_key(secret, "test"), message_id, stamp, body)}


def payload(text: str, repo: str = "ember") -> bytes:
    return json.dumps({"text": text, "build": {"number": 42}, "repo": {"name": repo}}).encode()


def post(rig: Rig, name: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(rig.gateway.url(f"/webhooks/{name}"), content=body, headers=headers, timeout=10)


def settled(rig: Rig, repo: str) -> None:
    """Everything sent to `repo`'s session before now has been run and answered: a signed marker sent
    behind it, in the same session, was answered (its turns run in order), and its answer delivered."""
    marker = f"marker {uuid.uuid4().hex[:8]}"
    rig.model.push(Reply(text=marker))
    body = payload(marker, repo=repo)
    assert post(rig, "ci", body, signed(body)).status_code == 202
    wait_until(lambda: any(r["body"]["text"] == marker for r in rig.receiver.received), what="the marker's answer")


def test_a_signed_request_runs_a_turn_whose_answer_reaches_the_target_signed(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:8]
    rig.model.push(Reply(text=f"noted {tag}"))
    body = payload(f"green {tag}", repo=f"repo-{tag}")
    response = post(rig, "ci", body, signed(body))
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "accepted"
    assert response.json()["session"] == f"webhook:ci:ci-repo-{tag}"
    wait_until(lambda: any(r["body"]["text"] == f"noted {tag}" for r in rig.receiver.received),
               what="the answer at the receiver")
    [answer] = [r for r in rig.receiver.received if r["body"]["text"] == f"noted {tag}"]
    assert answer["verified"] and answer["body"]["type"] == "ember.answer"
    assert answer["id"] == answer["body"]["delivery_id"]
    assert rig.messages(f"webhook:ci:ci-repo-{tag}") == [
        ("user", f"CI says: green {tag} (build 42)"), ("assistant", f"noted {tag}")]


@pytest.mark.parametrize("problem", ["wrong secret", "tampered body", "stale timestamp", "future timestamp",
                                     "no signature", "no id", "no timestamp"])
def test_a_request_not_signed_right_is_refused_and_nothing_is_stored(rig: Rig, problem: str) -> None:
    tag = uuid.uuid4().hex[:8]
    body = payload(f"forged {tag}", repo=f"forged-{tag}")
    headers = signed(body)
    if problem == "wrong secret":
        headers = signed(body, secret=OPS_SECRET)
    elif problem == "tampered body":
        body = body.replace(b"forged", b"trusted")
    elif problem == "stale timestamp":
        headers = signed(body, timestamp=int(time.time()) - 400)  # past the 300 s tolerance
    elif problem == "future timestamp":
        headers = signed(body, timestamp=int(time.time()) + 400)  # beyond it, however late it arrives
    else:
        del headers[{"no signature": "webhook-signature", "no id": "webhook-id",
                     "no timestamp": "webhook-timestamp"}[problem]]
    requests_before = len(rig.model.requests)
    response = post(rig, "ci", body, headers)
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_signature"
    expected = {"stale timestamp": "at most 300 s", "future timestamp": "at most 300 s",
                "no signature": "missing header: webhook-signature", "no id": "missing header: webhook-id",
                "no timestamp": "missing header: webhook-timestamp"}.get(problem, "does not match")
    assert expected in error["message"]
    settled(rig, f"forged-{tag}")
    assert len(rig.model.requests) == requests_before + 1  # the marker's turn alone
    assert [text for _, text in rig.messages(f"webhook:ci:ci-forged-{tag}") if "forged" in text] == []


def test_a_replayed_message_id_is_answered_from_the_store_and_never_run_twice(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:8]
    rig.model.push(Reply(text=f"once {tag}"))
    body = payload(f"replay {tag}", repo=f"replay-{tag}")
    headers = signed(body)
    first = post(rig, "ci", body, headers)
    again = post(rig, "ci", body, headers)
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json() == {"status": "duplicate", "message_id": headers["webhook-id"],
                            "session": f"webhook:ci:ci-replay-{tag}"}
    wait_until(lambda: any(r["body"]["text"] == f"once {tag}" for r in rig.receiver.received))
    # Re-signed with a fresh timestamp: still the same message.
    assert post(rig, "ci", body, signed(body, message_id=headers["webhook-id"])).status_code == 200
    settled(rig, f"replay-{tag}")
    assert [r["body"]["text"] for r in rig.receiver.received].count(f"once {tag}") == 1
    assert rig.messages(f"webhook:ci:ci-replay-{tag}")[:2] == [
        ("user", f"CI says: replay {tag} (build 42)"), ("assistant", f"once {tag}")]


def test_the_target_is_retried_on_503_with_the_same_webhook_id(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:8]
    rig.receiver.statuses.extend([503, 503])
    rig.model.push(Reply(text=f"retried {tag}"))
    body = payload(f"flaky {tag}", repo=f"flaky-{tag}")
    assert post(rig, "ci", body, signed(body)).status_code == 202
    wait_until(lambda: any(r["body"]["text"] == f"retried {tag}" and r["status"] == 200
                           for r in rig.receiver.received), what="the third attempt")
    attempts = [r for r in rig.receiver.received if r["body"]["text"] == f"retried {tag}"]
    assert [r["status"] for r in attempts] == [503, 503, 200]
    assert len({r["id"] for r in attempts}) == 1 and all(r["verified"] for r in attempts)
    wait_until(lambda: delivery_state(rig, f"retried {tag}") == ("delivered", None), what="the delivery mark")


def delivery_state(rig: Rig, text: str) -> tuple[str, str | None] | None:
    with rig.db() as conn:
        row = conn.execute("SELECT delivered_at, failure FROM outbox WHERE text = ?", (text,)).fetchone()
    if row is None:
        return None
    return ("delivered" if row[0] is not None else "owed"), row[1]


def test_a_400_from_the_target_stops_the_retries_and_is_recorded(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:8]
    rig.receiver.statuses.append(400)
    rig.model.push(Reply(text=f"refused {tag}"))
    body = payload(f"bad {tag}", repo=f"bad-{tag}")
    assert post(rig, "ci", body, signed(body)).status_code == 202
    wait_until(lambda: (delivery_state(rig, f"refused {tag}") or ("", None))[1] is not None,
               what="the refusal to be recorded")
    state, failure = delivery_state(rig, f"refused {tag}") or ("", None)
    assert state == "owed" and failure is not None and "answered 400" in failure
    logged = rig.gateway.output() + (rig.gateway.home / "ember.log").read_text()
    assert "answered 400" in logged and PATH_TOKEN not in logged + failure
    assert [r["status"] for r in rig.receiver.received if r["body"]["text"] == f"refused {tag}"] == [400]


def test_a_webhook_without_reply_to_keeps_its_answer_in_the_session(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:8]
    rig.model.push(Reply(text=f"kept {tag}"))
    body = json.dumps({"text": f"quiet {tag}"}).encode()
    response = post(rig, "quiet", body, signed(body))
    assert response.status_code == 202 and response.json()["session"] == "webhook:quiet:quiet"
    wait_until(lambda: ("assistant", f"kept {tag}") in rig.messages("webhook:quiet:quiet"))
    assert not any(r["body"]["text"] == f"kept {tag}" for r in rig.receiver.received)


def test_github_signatures_are_checked_on_the_raw_body(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:8]
    body = json.dumps({"action": f"opened-{tag}", "repository": {"full_name": "ember/ember"}}).encode()
    digest = "sha256=" + hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
    forged = "sha256=" + hmac.new(b"not the secret", body, hashlib.sha256).hexdigest()
    headers = {"X-GitHub-Delivery": str(uuid.uuid4()), "content-type": "application/json"}
    assert post(rig, "gh", body, headers | {"X-Hub-Signature-256": forged}).status_code == 401
    assert post(rig, "gh", body, headers).json()["error"]["message"] == (
        "webhook gh: missing header: X-Hub-Signature-256")
    rig.model.push(Reply(text=f"seen {tag}"))
    assert post(rig, "gh", body, headers | {"X-Hub-Signature-256": digest}).status_code == 202
    wait_until(lambda: ("user", f"GitHub: opened-{tag} on ember/ember") in rig.messages("webhook:gh:gh"))


@pytest.mark.parametrize(("body", "status", "code"), [
    (b'{"text": "no build or repo"}', 422, "missing_field"),
    (b"not json", 400, "invalid_json"),
    (b'{"text": "' + b"x" * 2_000_000 + b'"}', 413, "body_too_large"),
])
def test_bad_payloads_get_a_clear_error(rig: Rig, body: bytes, status: int, code: str) -> None:
    response = post(rig, "ci", body, signed(body))
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    if code == "missing_field":
        assert "the payload has no field build.number" in response.json()["error"]["message"]


def test_an_unknown_webhook_is_a_404(rig: Rig) -> None:
    body = b"{}"
    response = post(rig, "nope", body, signed(body))
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_webhook"


@pytest.mark.parametrize(("table", "expected"), [
    ('[webhooks.open]\nmessage = "{text}"\n', "a secret is required"),
    ('[webhooks.weak]\nsecret = "not-whsec"\nmessage = "{text}"\n', "starts with whsec_"),
    (f'[webhooks.ci]\nsecret = "{SECRET}"\nmessage = "{{text}}"\nreply_to = "nowhere"\n', "no [outbound.nowhere]"),
])
def test_a_webhook_configured_unsafely_stops_the_gateway_at_start(tmp_path: Path, table: str,
                                                                  expected: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "ember.toml").write_text(table)
    done = subprocess.run([EMBER, "serve", "--port", str(free_port())], env=gateway_env(home, None, None),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert expected in done.stderr
    assert "whsec_" not in done.stderr.replace("starts with whsec_", "")  # the secret itself is never echoed


def test_our_signatures_are_the_reference_librarys() -> None:
    body = b'{"text": "hello"}'
    headers = signed(body, message_id="msg_1", timestamp=1_700_000_000)
    reference = Webhook(SECRET)
    assert headers["webhook-signature"] == reference.sign("msg_1", _utc(1_700_000_000), body.decode())
    assert verify_standard(standard_key(SECRET, "t"), headers, body, now=1_700_000_100) == "msg_1"


def _utc(seconds: int) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, UTC)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(min_size=1, max_size=200), position=st.integers(min_value=0), flip=st.integers(1, 255))
def test_any_changed_byte_breaks_the_signature(body: bytes, position: int, flip: int) -> None:
    key = standard_key(SECRET, "t")
    headers = {"webhook-id": "msg_x", "webhook-timestamp": "1700000000",
               "webhook-signature": sign_standard(key, "msg_x", 1_700_000_000, body)}
    tampered = bytearray(body)
    tampered[position % len(body)] ^= flip
    with pytest.raises(SignatureError, match="does not match"):
        verify_standard(key, headers, bytes(tampered), now=1_700_000_000)
    assert verify_standard(key, headers, body, now=1_700_000_000) == "msg_x"


def test_templates_fill_nested_fields_and_name_the_missing_one() -> None:
    data = {"repo": {"name": "ember", "tags": ["a", "b"]}, "n": 3, "obj": {"k": 1}}
    assert render("{repo.name}#{n} {repo.tags.1} {obj} {{literal}}", data) == 'ember#3 b {"k":1} {literal}'
    with pytest.raises(TemplateError, match=r"no field repo\.owner"):
        render("{repo.owner}", data)
