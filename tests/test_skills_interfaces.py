"""`ember skills` and `/api/skills` as a person and their scripts use them: the
commands in a terminal, the routes over real HTTP on `ember serve`, each person
seeing the shared skills and only their own learned ones and proposals."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ember.core.skills import Proposal, ProposalStatus, SkillRisk, new_proposal_id
from ember.skills.format import render_skill_md
from ember.store.skills import SqlSkillStore
from ember.store.sqlite.database import SqliteDatabase
from tests.gatewayproc import GatewayProcess, LaunchGateway

EMBER = str(Path(sys.executable).with_name("ember"))
LIST_FIELDS = {"name", "description", "scope", "version", "status"}
SECRETS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}


def skills(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EMBER_HOME": str(home)}
    return subprocess.run([EMBER, "skills", *args], env=env, capture_output=True, text=True, timeout=120)


def write_skill(folder: Path, name: str, body: str) -> Path:
    (folder / name).mkdir(parents=True, exist_ok=True)
    (folder / name / "SKILL.md").write_text(render_skill_md(name, f"The {name} procedure.", body))
    return folder / name


def propose(home: Path, identity: str, name: str, body: str) -> str:
    """A pending proposal, as a review would leave it."""
    async def write() -> str:
        db = SqliteDatabase(home / "ember.db")
        await db.open()
        try:
            proposal = Proposal(id=new_proposal_id(), identity=identity, name=name, action="create",
                                text=render_skill_md(name, f"The {name} procedure.", body), risk=SkillRisk.LOW,
                                risk_reasons=(), status=ProposalStatus.PENDING, reason="seen twice",
                                created_at=time.time(), session_key=f"http:{identity}:work")
            await SqlSkillStore(db).finish_review(f"http:{identity}:work", 0, proposal)
            return proposal.id
        finally:
            await db.close()

    return asyncio.run(write())


def test_the_terminal_lists_imports_diffs_and_rolls_back(tmp_path: Path) -> None:
    home = tmp_path / "home"
    listed = skills(home, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    records = json.loads(listed.stdout)
    assert {r["name"] for r in records} >= {"web-research", "reminders", "write-a-skill"}
    assert all(set(r) >= LIST_FIELDS and r["scope"] == "shared" and r["version"] == 1 for r in records)

    source = write_skill(tmp_path / "src", "tidy-notes", "Sort the notes by date.")
    imported = skills(home, "import", str(source))
    assert imported.returncode == 0 and "Imported tidy-notes as version 1" in imported.stdout
    (source / "SKILL.md").write_text(render_skill_md("tidy-notes", "The tidy-notes procedure.", "Sort by topic."))
    assert "as version 2" in skills(home, "import", str(source)).stdout
    diff = skills(home, "diff", "tidy-notes").stdout
    assert "-Sort the notes by date." in diff and "+Sort by topic." in diff
    assert "is now at version 3" in skills(home, "rollback", "tidy-notes", "1").stdout
    shown = json.loads(skills(home, "show", "tidy-notes", "--json").stdout)
    assert shown["version"] == 3 and "Sort the notes by date." in shown["shown"]["text"]
    assert [v["source"] for v in shown["history"]][-1] == "rollback to version 1"
    assert "v1" in skills(home, "show", "tidy-notes").stdout  # the history, for a person

    bad = tmp_path / "src" / "Bad Name"
    bad.mkdir()
    refused = skills(home, "import", str(bad))
    assert refused.returncode == 1 and "invalid skill name 'Bad Name'" in refused.stderr
    assert "Traceback" not in refused.stderr
    missing = skills(home, "show", "tidy-note")
    assert missing.returncode == 1 and "come close: tidy-notes" in missing.stderr


def test_the_terminal_imports_several_folders_and_prints_a_diff_as_json(tmp_path: Path) -> None:
    home = tmp_path / "home"
    folders = [write_skill(tmp_path / "src", name, f"Do {name}.") for name in ("alpha-notes", "beta-notes")]
    bad = tmp_path / "src" / "no-skill-md"
    bad.mkdir()
    done = skills(home, "import", str(folders[0]), str(bad), str(folders[1]))
    assert done.returncode == 1, done.stderr  # one of them failed, and is named
    assert done.stdout.splitlines() == ["Imported alpha-notes as version 1.", "Imported beta-notes as version 1."]
    assert f"{bad}: " in done.stderr and "has no SKILL.md" in done.stderr and "Traceback" not in done.stderr

    (folders[0] / "SKILL.md").write_text(render_skill_md("alpha-notes", "The alpha-notes procedure.", "Do less."))
    assert skills(home, "import", str(folders[0])).returncode == 0
    shown = json.loads(skills(home, "diff", "alpha-notes", "--json").stdout)
    assert shown["name"] == "alpha-notes" and shown["version"] == 2 and shown["identity"] is None
    assert "-Do alpha-notes." in shown["diff"] and "+Do less." in shown["diff"]
    first = json.loads(skills(home, "diff", "alpha-notes", "--version", "1", "--json").stdout)
    assert first["version"] == 1 and "+Do alpha-notes." in first["diff"]


def test_the_terminal_approves_and_rejects_proposals(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert skills(home, "list").returncode == 0  # creates the store
    keep = propose(home, "alice", "weekly-report", "Group the week's work by project.")
    drop = propose(home, "alice", "bad-idea", "Do it the long way.")
    pending = json.loads(skills(home, "pending", "--json").stdout)
    assert {p["id"] for p in pending} == {keep, drop}
    assert "+Group the week's work by project." in skills(home, "pending").stdout
    assert "version 1" in skills(home, "approve", keep).stdout
    assert "unchanged" in skills(home, "reject", drop).stdout
    again = skills(home, "approve", drop)
    assert again.returncode == 1 and "already rejected" in again.stderr
    everyone = {r["name"]: r for r in json.loads(skills(home, "list", "--json").stdout)}
    assert everyone["weekly-report"]["scope"] == "learned" and "bad-idea" not in everyone
    alices = json.loads(skills(home, "show", "weekly-report", "--identity", "alice", "--json").stdout)
    assert alices["history"][0]["admitted_by"] == "local"


@pytest.fixture
def gateway(launch_gateway: LaunchGateway, tmp_path: Path) -> GatewayProcess:
    home = tmp_path / "home"
    home.mkdir()
    assert skills(home, "list").returncode == 0
    return launch_gateway(None, keys=SECRETS, home=home)


@pytest.fixture
def clients(gateway: GatewayProcess) -> Iterator[dict[str, httpx.Client]]:
    made = {name: httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {secret}"},
                               timeout=30) for name, secret in SECRETS.items()}
    yield made
    for client in made.values():
        client.close()


def test_the_api_shows_each_person_their_own_and_decides_their_proposals(
        gateway: GatewayProcess, clients: dict[str, httpx.Client]) -> None:
    home = Path(gateway.env["EMBER_HOME"])
    keep = propose(home, "alice", "weekly-report", "Group the week's work by project.")
    drop = propose(home, "alice", "bad-idea", "Do it the long way.")
    alice, bob = clients["alice"], clients["bob"]

    pending = alice.get("/api/skills/pending").json()
    assert {p["id"] for p in pending} == {keep, drop}
    assert all("+Group" in p["diff"] or "+Do it" in p["diff"] for p in pending)
    assert bob.get("/api/skills/pending").json() == []
    assert bob.post(f"/api/skills/pending/{keep}", json={"decision": "approve"}).status_code == 404

    approved = alice.post(f"/api/skills/pending/{keep}", json={"decision": "approve"})
    assert approved.status_code == 200 and approved.json()["status"] == "admitted"
    assert alice.post(f"/api/skills/pending/{drop}", json={"decision": "reject"}).json()["status"] == "rejected"
    late = alice.post(f"/api/skills/pending/{drop}", json={"decision": "approve"})
    assert late.status_code == 409 and "already rejected" in late.json()["error"]["message"]
    assert alice.get("/api/skills/pending").json() == []

    mine = {s["name"]: s for s in alice.get("/api/skills").json()}
    assert mine["weekly-report"]["scope"] == "learned" and mine["weekly-report"]["version"] == 1
    assert set(mine["web-research"]) >= LIST_FIELDS and "bad-idea" not in mine
    assert "weekly-report" not in {s["name"] for s in bob.get("/api/skills").json()}
    shown = alice.get("/api/skills/weekly-report").json()
    assert "Group the week's work by project." in shown["text"] and len(shown["history"]) == 1
    assert bob.get("/api/skills/weekly-report").status_code == 404
    assert bob.get("/api/skills/web-research").status_code == 200


def test_the_api_refuses_bad_decisions_clearly(gateway: GatewayProcess, clients: dict[str, httpx.Client]) -> None:
    alice = clients["alice"]
    proposal = propose(Path(gateway.env["EMBER_HOME"]), "alice", "one-more", "Steps.")
    wrong = alice.post(f"/api/skills/pending/{proposal}", json={"decision": "maybe"})
    assert wrong.status_code == 422 and wrong.json()["error"]["param"] == "decision"
    assert alice.post(f"/api/skills/pending/{proposal}", content=b"{", headers={
        "content-type": "application/json"}).status_code == 400
    assert alice.post("/api/skills/pending/sp_nothing", json={"decision": "reject"}).status_code == 404
    assert alice.get("/api/skills/..%2F..%2Fetc").status_code == 404
    assert httpx.get(f"{gateway.base_url}/api/skills").status_code == 401
    assert alice.get("/api/skills/pending").json()[0]["id"] == proposal  # nothing was decided
