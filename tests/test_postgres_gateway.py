"""`ember serve` with its store on PostgreSQL (EMBER_DATABASE_URL), over real HTTP: turns commit
and read back, and a restart finds what the first process left."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.gatewayproc import EMBER, LaunchGateway, gateway_env
from tests.modelserver import ModelServer, Reply, tool_call
from tests.test_gateway_api import final_text, history, send

KEY = "alice-secret-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_turns_commit_to_postgresql_and_survive_a_restart(model_server: ModelServer, pg_database: str,
                                                         launch_gateway: LaunchGateway) -> None:
    model_server.responder = lambda body: Reply(text=f"echo: {body['messages'][-1]['content']}")
    gateway = launch_gateway(model_server, keys={"alice": KEY}, EMBER_DATABASE_URL=pg_database)
    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=30) as alice:
        assert final_text(send(alice, "work", "first")) == "echo: first"
        model_server.push(Reply(tool_calls=(tool_call("list_dir", path="."),)), Reply(text="An empty folder."))
        model_server.responder = None
        assert final_text(send(alice, "work", "what is here?")) == "An empty folder."
    gateway.stop()
    assert not (gateway.home / "ember.db").exists()  # nothing went to SQLite

    model_server.responder = lambda body: Reply(text=f"echo: {body['messages'][-1]['content']}")
    again = launch_gateway(model_server, keys={"alice": KEY}, EMBER_DATABASE_URL=pg_database)
    with httpx.Client(base_url=again.base_url, headers=AUTH, timeout=30) as alice:
        assert [m["role"] for m in history(alice, "work")] == ["user", "assistant", "user", "assistant", "tool",
                                                              "assistant"]
        assert final_text(send(alice, "work", "still there?")) == "echo: still there?"
        sessions = alice.get("/api/sessions").json()["sessions"]
        assert [s["key"] for s in sessions] == ["work"] and sessions[0]["messages"] == 8


def test_memories_are_kept_and_found_on_postgresql(model_server: ModelServer, pg_database: str,
                                                  launch_gateway: LaunchGateway) -> None:
    gateway = launch_gateway(model_server, keys={"alice": KEY, "bob": "bob-secret-0123456789ab"},
                             EMBER_DATABASE_URL=pg_database)
    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=30) as alice:
        for fact in ("My sister lives in Lisbon.", "我喜欢喝乌龙茶。", "The deadline is Friday."):
            assert alice.post("/api/memory", json={"content": fact}).status_code == 201
        found = alice.get("/api/memory/search", params={"q": "where does my sister live"}).json()
        assert found[0]["content"] == "My sister lives in Lisbon."
        chinese = alice.get("/api/memory/search", params={"q": "乌龙茶"}).json()
        assert chinese[0]["content"] == "我喜欢喝乌龙茶。"
    bob = httpx.get(gateway.url("/api/memory/search"), params={"q": "sister Lisbon"},
                    headers={"Authorization": "Bearer bob-secret-0123456789ab"}, timeout=30).json()
    assert bob == []  # one person's memories are never another's


def test_doctor_checks_a_postgresql_store(model_server: ModelServer, pg_database: str, tmp_path: Path) -> None:
    env = gateway_env(tmp_path / "home", model_server, None, EMBER_DATABASE_URL=pg_database)
    done = subprocess.run([EMBER, "doctor"], env=env, capture_output=True, text=True, timeout=120)
    assert "store on PostgreSQL (database_url): schema v" in done.stdout, done.stdout + done.stderr
    assert "leases: 0 held now, by 0 process(es)" in done.stdout, done.stdout
    assert "FAIL" not in done.stdout.split("model endpoint")[0], done.stdout
    assert pg_database.rsplit("@", 1)[0] not in done.stdout  # the URL (and a password in it) stays out
