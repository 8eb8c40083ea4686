"""Long-term memory over `ember serve`'s HTTP API, as its clients see it: the
round trip, isolation between people, keys bound to one person, bad input.

One gateway serves the module. Its `ember.toml` binds the keys alice and
alice-phone to one person; "Alice" differs from "alice" only in case and is
another person. Each test writes memories with words of its own (`word()`), so
tests do not depend on each other's order.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema_rs
import pytest

from ember.channels.gateway.schemas import NOT_BLANK_PATTERN, MemoryItem
from tests.gatewayproc import EMBER, GatewayProcess, LaunchGateway
from tests.loopback import wait_until

SECRETS = {
    "alice": "alice-secret-0123456789",
    "alice-phone": "alice-phone-secret-0123456789",
    "bob": "bob-secret-0123456789ab",
    "Alice": "ALICE-secret-9876543210",
    # Sends the bad requests, so its memory stays small and its own.
    "carol": "carol-secret-0123456789",
}
IDENTITIES = 'identities = {alice = ["http:alice", "http:alice-phone"]}\n'
MAX_BODY_BYTES = 16_384
MAX_CONTENT_CHARS = 8_000
ERROR_FIELDS = {"message", "type", "code", "param"}
# What `ember memory search --json` prints for every hit, at least.
HIT_FIELDS = {"id", "content", "kind", "subject", "key", "status", "created_at", "source", "score"}


@pytest.fixture(scope="module")
def gateway(launch_module_gateway: LaunchGateway, tmp_path_factory: pytest.TempPathFactory) -> GatewayProcess:
    """`ember serve` on the demo model: these tests run no turns."""
    home = tmp_path_factory.mktemp("memory") / "home"
    home.mkdir()
    (home / "ember.toml").write_text(IDENTITIES)
    return launch_module_gateway(None, keys=SECRETS, home=home,
                                 EMBER_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY_BYTES),
                                 EMBER_GATEWAY_RATE_PER_MINUTE="1000000", EMBER_GATEWAY_RATE_BURST="1000000")


Clients = dict[str, httpx.Client]


@pytest.fixture(scope="module")
def clients(gateway: GatewayProcess) -> Iterator[Clients]:
    """`clients["alice"]`: an HTTP client of the gateway holding that key."""
    made = {name: httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {secret}"},
                               timeout=30) for name, secret in SECRETS.items()}
    yield made
    for each in made.values():
        each.close()


def word() -> str:
    """A word no other memory has: a search for it finds one test's memories only."""
    return f"zq{uuid.uuid4().hex[:10]}"


def add(client: httpx.Client, content: str, **fields: str) -> dict[str, Any]:
    response = client.post("/api/memory", json={"content": content, **fields})
    assert response.status_code == 201, response.text
    record: dict[str, Any] = response.json()
    return record


def listed(client: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    response = client.get("/api/memory", params=params)
    assert response.status_code == 200, response.text
    records: list[dict[str, Any]] = response.json()
    assert isinstance(records, list)
    return records


def search(client: httpx.Client, query: str, **params: Any) -> list[dict[str, Any]]:
    response = client.get("/api/memory/search", params={"q": query, **params})
    assert response.status_code == 200, response.text
    hits: list[dict[str, Any]] = response.json()
    assert isinstance(hits, list)
    return hits


def ids(records: list[dict[str, Any]]) -> list[str]:
    return [record["id"] for record in records]


def by_id(records: list[dict[str, Any]], memory_id: str) -> dict[str, Any]:
    found = [record for record in records if record["id"] == memory_id]
    assert len(found) == 1, records
    return found[0]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """A JSON error in the OpenAI shape, with that status (and code, if given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str) and error["message"].strip()
    if code is not None:
        assert error["code"] == code, error
    return error


# --- the round trip ------------------------------------------------------------------------------


def test_add_list_search_and_forget_a_memory(clients: Clients) -> None:
    alice = clients["alice"]
    tag = word()
    record = add(alice, f"  My cat {tag} is called Mochi  ", subject="My Cat", key="Name")
    assert record["content"] == f"My cat {tag} is called Mochi"
    assert (record["kind"], record["status"], record["subject"], record["key"]) == ("fact", "active", "my_cat",
                                                                                     "name")
    assert record["source"] == "http:alice"
    assert set(record) == set(MemoryItem.model_fields)  # what the OpenAPI document says a memory is

    again = alice.post("/api/memory", json={"content": f"my cat {tag} is called mochi."})
    assert again.status_code == 200, again.text  # already remembered: the same memory, not a second one
    assert again.json() == record

    assert listed(alice)[0] == record  # newest first
    hit = by_id(search(alice, f"what is my cat {tag} called?"), record["id"])
    assert set(hit) >= HIT_FIELDS
    assert hit["score"] > 0
    assert {k: v for k, v in hit.items() if k != "score"} == record

    forgotten = alice.delete(f"/api/memory/{record['id']}")
    assert forgotten.status_code == 200, forgotten.text
    assert forgotten.json()["status"] == "archived"
    assert forgotten.json()["id"] == record["id"]
    assert record["id"] not in ids(listed(alice))
    assert record["id"] not in ids(search(alice, tag))
    assert by_id(listed(alice, all="true"), record["id"])["status"] == "archived"
    assert by_id(search(alice, tag, all="true"), record["id"])["status"] == "archived"


def test_a_memory_added_over_http_keeps_no_thinking(clients: Clients) -> None:
    """I4: a client relaying a model's raw reply adds the fact, not the thinking, closed or cut off."""
    bob = clients["bob"]
    tag = word()
    closed = add(bob, f"<think>they said {tag} twice</think>{tag} drinks jasmine tea.")
    unclosed = add(bob, f"{tag} drinks it at four.<thinking>and maybe {tag} also")
    assert (closed["content"], unclosed["content"]) == (f"{tag} drinks jasmine tea.", f"{tag} drinks it at four.")
    assert sorted(hit["content"] for hit in search(bob, tag)) == sorted([closed["content"], unclosed["content"]])
    only = bob.post("/api/memory", json={"content": f"<think>{tag} is thinking</think>"})
    assert "but for thinking" in assert_error(only, 422, "invalid_memory")["message"]
    assert not [record for record in listed(bob, all="true") if "thinking" in record["content"]]


def test_a_fact_with_the_same_subject_and_key_replaces_the_old_one(clients: Clients) -> None:
    alice = clients["alice"]
    subject = word()
    old = add(alice, "lives in Porto", subject=subject, key="city")
    new = add(alice, "lives in Lisbon", subject=subject, key="city")
    active = ids(listed(alice))
    assert new["id"] in active and old["id"] not in active
    replaced = by_id(listed(alice, all="true"), old["id"])
    assert (replaced["status"], replaced["superseded_by"]) == ("superseded", new["id"])


def test_a_fact_corrected_over_http_supersedes_the_old_text(clients: Clients) -> None:
    alice, bob = clients["alice"], clients["bob"]
    tag = word()
    keyed = add(alice, f"{tag} lives in Porto", subject=tag, key="city")
    plain = add(alice, f"{tag} is allergic to peanuts")
    for old, text in ((keyed, f"{tag} lives in Lisbon"), (plain, f"{tag} is allergic to peanuts and cashews")):
        corrected = alice.patch(f"/api/memory/{old['id']}", json={"content": text})
        assert corrected.status_code == 200, corrected.text
        new = corrected.json()
        assert (new["content"], new["kind"], new["status"], new["source_rank"]) == (text, "fact", "active",
                                                                                   "user_stated")
        assert (new["subject"], new["key"]) == (old["subject"], old["key"])
        assert old["id"] not in ids(listed(alice)) and new["id"] in ids(listed(alice))
        was = by_id(listed(alice, all="true"), old["id"])
        assert (was["status"], was["superseded_by"]) == ("superseded", new["id"])
    # Changed back: a new version again, the one before it superseded.
    lisbon = by_id(listed(alice), by_id(listed(alice, all="true"), keyed["id"])["superseded_by"])
    back = alice.patch(f"/api/memory/{lisbon['id']}", json={"content": f"{tag} lives in Porto"}).json()
    assert (back["content"], back["status"]) == (f"{tag} lives in Porto", "active") and back["id"] != keyed["id"]
    assert by_id(listed(alice, all="true"), lisbon["id"])["status"] == "superseded"
    unchanged = alice.patch(f"/api/memory/{back['id']}", json={"content": f" {tag} lives in Porto "})
    assert unchanged.status_code == 200 and unchanged.json() == back
    # Another person's id does not exist for bob; a superseded fact is not corrected again; blank is refused.
    assert_error(bob.patch(f"/api/memory/{plain['id']}", json={"content": "mine now"}), 404, "memory_not_found")
    assert "only an active fact" in assert_error(
        alice.patch(f"/api/memory/{plain['id']}", json={"content": "again"}), 422, "invalid_memory")["message"]
    assert_error(alice.patch(f"/api/memory/{keyed['id']}", json={"content": "  "}), 422, "invalid_memory")
    assert_error(alice.patch(f"/api/memory/{keyed['id']}", json={"text": "x"}), 422, "invalid_request")


def test_list_takes_a_limit_and_kinds(clients: Clients) -> None:
    bob = clients["bob"]
    tag = word()
    made = [add(bob, f"note {n} {tag}")["id"] for n in range(3)]
    assert ids(listed(bob, limit=2)) == made[:0:-1]  # the two newest, newest first
    assert not set(made) & set(ids(listed(bob, kind="episodic")))
    assert set(made) <= set(ids(listed(bob, kind=["fact", "episodic"])))
    assert len(search(bob, tag, limit=1)) == 1


def jobs_idle(client: httpx.Client) -> bool:
    """No background job pending or running (the embedding job has given every memory its vector)."""
    metrics = client.get("/metrics").text
    return all(f'ember_background_jobs{{status="{status}"}} 0.0' in metrics for status in ("pending", "running"))


def test_search_returns_the_records_the_cli_prints(gateway: GatewayProcess, clients: Clients) -> None:
    alice = clients["alice"]
    tag = word()
    for text in (f"{tag} likes green tea", f"{tag} plays the cello", "the sky was grey today"):
        add(alice, text)
    wait_until(lambda: jobs_idle(alice), what="the embedding job")
    served = search(alice, f"{tag} tea", limit=5)
    cli = subprocess.run([EMBER, "memory", "search", f"{tag} tea", "--limit", "5", "--json", "--identity", "alice"],
                         env=gateway.env, capture_output=True, text=True, timeout=120, check=True)
    printed = json.loads(cli.stdout)
    assert ids(served) == ids(printed)
    assert f"{tag} likes green tea" in [hit["content"] for hit in served]
    for mine, theirs in zip(served, printed, strict=True):
        assert {k: v for k, v in mine.items() if k != "score"} == {k: v for k, v in theirs.items() if k != "score"}
        assert mine["score"] == pytest.approx(theirs["score"], rel=1e-3)


# --- isolation between people --------------------------------------------------------------------


@dataclass
class Secret:
    tag: str
    record: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def alices_secret(clients: Clients) -> Secret:
    """A memory of alice's that no one else may see."""
    secret = Secret(word())
    secret.record = add(clients["alice"], f"alice's bank pin hint is {secret.tag}")
    return secret


@pytest.mark.parametrize("other", ["bob", "Alice"], ids=["another identity", "one differing only in case"])
def test_another_identity_never_sees_or_forgets_a_memory(clients: Clients, alices_secret: Secret,
                                                         other: str) -> None:
    them = clients[other]
    memory_id = alices_secret.record["id"]
    assert memory_id not in ids(listed(them, all="true"))
    assert memory_id not in ids(search(them, alices_secret.tag, all="true"))
    assert alices_secret.tag not in json.dumps(search(them, f"bank pin hint {alices_secret.tag}"))

    theirs = assert_error(them.delete(f"/api/memory/{memory_id}"), 404, "memory_not_found")
    # Exactly what an id that exists nowhere gets: nothing tells them the memory exists.
    nowhere = assert_error(them.delete(f"/api/memory/{uuid.uuid4().hex[:12]}"), 404, "memory_not_found")
    assert theirs["type"] == nowhere["type"]
    assert alices_secret.tag not in json.dumps(theirs)
    assert by_id(listed(clients["alice"]), memory_id)["status"] == "active"

    # The same words are a memory of their own, not alice's already remembered one.
    own = them.post("/api/memory", json={"content": alices_secret.record["content"]})
    assert own.status_code == 201, own.text
    assert own.json()["id"] != memory_id


def test_keys_bound_to_one_person_share_one_memory(clients: Clients) -> None:
    alice, phone = clients["alice"], clients["alice-phone"]
    tag = word()
    record = add(phone, f"parked on level {tag}")
    assert record["source"] == "http:alice-phone"
    assert record["id"] in ids(search(alice, tag))
    assert record["id"] in ids(listed(alice))
    again = alice.post("/api/memory", json={"content": f"Parked on level {tag}"})
    assert again.status_code == 200 and again.json()["id"] == record["id"]  # one person, one memory
    assert record["id"] not in ids(search(clients["bob"], tag))
    assert alice.delete(f"/api/memory/{record['id']}").status_code == 200
    assert record["id"] not in ids(listed(phone))


# --- bad input -----------------------------------------------------------------------------------

JSON_TYPE = {"Content-Type": "application/json"}
TOO_LONG = "x" * (MAX_BODY_BYTES + 100)


def chunked(data: bytes, size: int = 1024) -> Iterator[bytes]:
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
    params: dict[str, str] = field(default_factory=dict)
    chunks: bool = False


ADD, SEARCH = "/api/memory", "/api/memory/search"
BAD_REQUESTS = {
    "add: empty content": Bad("POST", ADD, 422, "invalid_memory", body={"content": ""}),
    "add: blank content": Bad("POST", ADD, 422, "invalid_memory", body={"content": " \n\t "}),
    "add: content too long": Bad("POST", ADD, 422, "invalid_request", body={"content": "x" * (MAX_CONTENT_CHARS + 1)}),
    "add: no content": Bad("POST", ADD, 422, "invalid_request", body={"subject": "me"}),
    "add: content not a string": Bad("POST", ADD, 422, "invalid_request", body={"content": 42}),
    "add: unknown field": Bad("POST", ADD, 422, "invalid_request", body={"content": "hi", "identity": "bob"}),
    "add: subject too long": Bad("POST", ADD, 422, "invalid_request", body={"content": "hi", "subject": "s" * 201}),
    "add: a list, not an object": Bad("POST", ADD, 422, "invalid_request", body=[{"content": "hi"}]),
    "add: malformed JSON": Bad("POST", ADD, 400, "invalid_json", content=b'{"content": ', headers=JSON_TYPE),
    "add: lone surrogate": Bad("POST", ADD, 400, "invalid_json", content=b'{"content": "a \\ud800 b"}',
                               headers=JSON_TYPE),
    "add: text/plain": Bad("POST", ADD, 415, "unsupported_media_type", content=b'{"content": "hi"}',
                           headers={"Content-Type": "text/plain"}),
    "add: no content type": Bad("POST", ADD, 415, "unsupported_media_type", content=b'{"content": "hi"}'),
    "add: oversize": Bad("POST", ADD, 413, "body_too_large", body={"content": TOO_LONG}),
    "add: oversize, chunked": Bad("POST", ADD, 413, "body_too_large", headers=JSON_TYPE, chunks=True,
                                  content=json.dumps({"content": TOO_LONG}).encode()),
    "search: no q": Bad("GET", SEARCH, 400, "missing_query"),
    "search: empty q": Bad("GET", SEARCH, 400, "missing_query", params={"q": ""}),
    "search: blank q": Bad("GET", SEARCH, 400, "missing_query", params={"q": "  "}),
    "search: only punctuation": Bad("GET", SEARCH, 400, "invalid_query", params={"q": "?!… -- ;"}),
    "search: q too long": Bad("GET", SEARCH, 400, "invalid_query", params={"q": "tea " * 300}),
    "search: limit 0": Bad("GET", SEARCH, 400, "invalid_parameter", params={"q": "tea", "limit": "0"}),
    "search: limit over 100": Bad("GET", SEARCH, 400, "invalid_parameter", params={"q": "tea", "limit": "101"}),
    "search: limit not a number": Bad("GET", SEARCH, 400, "invalid_parameter", params={"q": "tea", "limit": "ten"}),
    "search: limit not whole": Bad("GET", SEARCH, 400, "invalid_parameter", params={"q": "tea", "limit": "1.5"}),
    "search: unknown kind": Bad("GET", SEARCH, 400, "invalid_parameter", params={"q": "tea", "kind": "dream"}),
    "list: limit negative": Bad("GET", ADD, 400, "invalid_parameter", params={"limit": "-1"}),
    "list: limit too large": Bad("GET", ADD, 400, "invalid_parameter", params={"limit": "1001"}),
    "list: huge limit": Bad("GET", ADD, 400, "invalid_parameter", params={"limit": "9" * 5000}),
    "list: unknown kind": Bad("GET", ADD, 400, "invalid_parameter", params={"kind": "Fact"}),
    "list: all not a flag": Bad("GET", ADD, 400, "invalid_parameter", params={"all": "yes"}),
    "list: unknown parameter": Bad("GET", ADD, 400, "invalid_parameter", params={"limt": "5"}),
    "search: unknown parameter": Bad("GET", SEARCH, 400, "invalid_parameter", params={"q": "tea", "query": "tea"}),
    "forget: unknown id": Bad("DELETE", "/api/memory/0123456789ab", 404, "memory_not_found"),
    "forget: the search path": Bad("DELETE", SEARCH, 405, None),
    "wrong method on memory": Bad("PUT", ADD, 405, None, body={"content": "hi"}),
    "wrong method on search": Bad("POST", SEARCH, 405, None, body={"content": "hi"}),
}


@pytest.mark.parametrize("bad", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_bad_requests_get_a_clear_json_error_and_store_nothing(clients: Clients, bad: Bad) -> None:
    carol = clients["carol"]
    before = listed(carol, all="true")
    content = chunked(bad.content) if bad.chunks and bad.content is not None else bad.content
    response = carol.request(bad.method, bad.path, json=bad.body, content=content, headers=bad.headers,
                             params=bad.params)
    assert_error(response, bad.status, bad.code)
    if bad.status == 405:
        assert response.headers["Allow"]
    assert listed(carol, all="true") == before
    # The gateway still serves a good request.
    made = add(carol, f"and now a good one {word()}")
    assert carol.delete(f"/api/memory/{made['id']}").status_code == 200


def test_the_documented_content_pattern_is_what_the_core_calls_blank() -> None:
    """The document's pattern for content, read by JSON Schema's regex dialect, rules out exactly
    the strings the core's check strips to nothing (its `\\s` and Python's disagree)."""
    validator = jsonschema_rs.validator_for({"type": "string", "pattern": NOT_BLANK_PATTERN})
    for code in range(sys.maxunicode + 1):
        if not 0xD800 <= code <= 0xDFFF:
            assert validator.is_valid(chr(code)) == bool(chr(code).strip()), hex(code)


def test_routes_need_a_key(gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=gateway.base_url, timeout=30) as anonymous:
        for method, path in [("GET", ADD), ("POST", ADD), ("GET", SEARCH), ("DELETE", "/api/memory/0123456789ab")]:
            assert_error(anonymous.request(method, path, params={"q": "tea"}), 401, "invalid_api_key")

