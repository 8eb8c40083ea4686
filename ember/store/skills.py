"""Skills, their versions, and the proposals of the background review.

Nothing is overwritten: a change to a skill is a new row in `skill_versions`
and the skill's `version` pointing at it, in one transaction. A proposal is
written once per review job (`job_id` is unique), in the transaction that also
advances the session's review mark, so a review retried after a crash never
proposes twice.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ember.core.skills import (
    SHARED,
    Proposal,
    ProposalStatus,
    Skill,
    SkillOrigin,
    SkillRisk,
    SkillStatus,
    SkillVersion,
)
from ember.store.database import Database

_SKILL = "name, description, identity, version, status, origin, use_count, last_used_at, updated_at"
_VERSION = "name, identity, version, text, source, admitted_by, created_at, files_json, turn_id, job_id"
_PROPOSAL = ("id, identity, name, action, text, risk, risk_reasons, status, reason, created_at, base_version, "
             "session_key, turn_id, job_id, decided_at, decided_by, version, input_tokens, output_tokens, cost_usd")


def new_proposal_id() -> str:
    return "sp_" + secrets.token_hex(5)


def _skill(row: Sequence[Any]) -> Skill:
    name, description, identity, version, status, origin, uses, last_used, updated = row
    return Skill(name, description, identity, version, SkillStatus(status), SkillOrigin(origin), uses, last_used,
                 updated)


def _version(row: Sequence[Any]) -> SkillVersion:
    name, identity, version, text, source, by, created, files, turn_id, job_id = row
    return SkillVersion(name, identity, version, text, source, by, created, json.loads(files), turn_id, job_id)


def _proposal(row: Sequence[Any]) -> Proposal:
    (id_, identity, name, action, text, risk, reasons, status, reason, created, base, session_key, turn_id, job_id,
     decided_at, decided_by, version, tokens_in, tokens_out, cost) = row
    return Proposal(id_, identity, name, action, text, SkillRisk(risk), tuple(json.loads(reasons)),
                    ProposalStatus(status), reason, created, base, session_key, turn_id, job_id, decided_at,
                    decided_by, version, input_tokens=tokens_in, output_tokens=tokens_out, cost_usd=cost)


@dataclass(frozen=True, slots=True)
class NewVersion:
    """A change to admit: the skill's text and files, and where the change came from."""

    identity: str
    name: str
    description: str
    text: str
    source: str
    admitted_by: str
    origin: SkillOrigin
    files: dict[str, str] | None = None  # None: the previous version's files
    turn_id: str | None = None
    job_id: str | None = None
    disk_digest: str | None = None  # set when the change was read from a folder


def _add_version(conn: sqlite3.Connection, change: NewVersion, now: float) -> SkillVersion:
    row = conn.execute("SELECT version FROM skills WHERE identity = ? AND name = ?",
                       (change.identity, change.name)).fetchone()
    files = change.files
    if files is None:
        previous = conn.execute("SELECT files_json FROM skill_versions WHERE identity = ? AND name = ? "
                                "ORDER BY version DESC LIMIT 1", (change.identity, change.name)).fetchone()
        files = json.loads(previous[0]) if previous else {}
    version = (conn.execute("SELECT COALESCE(MAX(version), 0) FROM skill_versions WHERE identity = ? AND name = ?",
                            (change.identity, change.name)).fetchone()[0]) + 1
    conn.execute(f"INSERT INTO skill_versions ({_VERSION}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                 (change.name, change.identity, version, change.text, change.source, change.admitted_by, now,
                  json.dumps(files, ensure_ascii=False), change.turn_id, change.job_id))
    if row is None:
        conn.execute("INSERT INTO skills (identity, name, description, version, status, origin, disk_digest, "
                     "created_at, updated_at) VALUES (?, ?, ?, ?, 'active', ?, ?, ?, ?)",
                     (change.identity, change.name, change.description, version, change.origin.value,
                      change.disk_digest, now, now))
    else:
        conn.execute("UPDATE skills SET description = ?, version = ?, status = 'active', updated_at = ?, "
                     "disk_digest = COALESCE(?, disk_digest) WHERE identity = ? AND name = ?",
                     (change.description, version, now, change.disk_digest, change.identity, change.name))
    return SkillVersion(change.name, change.identity, version, change.text, change.source, change.admitted_by, now,
                        files, change.turn_id, change.job_id)


class SqlSkillStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def visible(self, identity: str | None, *, include_archived: bool = False) -> list[Skill]:
        """The shared skills and `identity`'s own, by name; a learned skill hides a shared one of its name.
        `identity` None: every skill of everyone (the local CLI)."""
        rows = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_SKILL} FROM skills WHERE (? IS NULL OR identity IN ('', ?)) AND (? OR status = 'active') "
            "ORDER BY name, identity", (identity, identity, include_archived)).fetchall())
        skills = [_skill(row) for row in rows]
        if identity is None:
            return skills
        own = {skill.name for skill in skills if skill.identity != SHARED}
        return [skill for skill in skills if skill.identity != SHARED or skill.name not in own]

    async def freshness(self, identity: str) -> tuple[Any, ...]:
        """Changes whenever the skills `identity` sees change (not when they are only used)."""
        return await self._db.run_read(lambda conn: conn.execute(
            "SELECT COUNT(*), MAX(updated_at), SUM(version) FROM skills WHERE identity IN ('', ?)",
            (identity,)).fetchone())

    async def get(self, identity: str | None, name: str) -> Skill | None:
        """The skill `identity` sees under `name` (its own first); identity None: the shared one."""
        row = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_SKILL} FROM skills WHERE name = ? AND identity IN ('', ?) ORDER BY identity DESC LIMIT 1",
            (name, identity or SHARED)).fetchone())
        return _skill(row) if row else None

    async def version(self, skill: Skill, version: int | None = None) -> SkillVersion | None:
        number = skill.version if version is None else version
        row = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_VERSION} FROM skill_versions WHERE identity = ? AND name = ? AND version = ?",
            (skill.identity, skill.name, number)).fetchone())
        return _version(row) if row else None

    async def history(self, skill: Skill) -> list[SkillVersion]:
        rows = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_VERSION} FROM skill_versions WHERE identity = ? AND name = ? ORDER BY version",
            (skill.identity, skill.name)).fetchall())
        return [_version(row) for row in rows]

    async def disk_digests(self) -> dict[str, tuple[str | None, str]]:
        """Shared skills: name -> (digest of the folder last read, origin)."""
        rows = await self._db.run_read(lambda conn: conn.execute(
            "SELECT name, disk_digest, origin FROM skills WHERE identity = ''").fetchall())
        return {name: (digest, origin) for name, digest, origin in rows}

    async def add_version(self, change: NewVersion) -> SkillVersion:
        return await self._db.run_write(lambda conn: _add_version(conn, change, time.time()))

    async def set_status(self, identity: str, names: Sequence[str], status: SkillStatus) -> None:
        now = time.time()
        await self._db.run_write(lambda conn: conn.executemany(
            "UPDATE skills SET status = ?, updated_at = ? WHERE identity = ? AND name = ? AND status != ?",
            [(status.value, now, identity, name, status.value) for name in names]))

    async def record_use(self, skill: Skill, at: float) -> None:
        await self._db.run_write(lambda conn: conn.execute(
            "UPDATE skills SET use_count = use_count + 1, last_used_at = ? WHERE identity = ? AND name = ?",
            (at, skill.identity, skill.name)))

    async def unused_since(self, before: float) -> list[Skill]:
        """Active skills not used since `before` (counting from when they were added)."""
        rows = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_SKILL} FROM skills WHERE status = 'active' AND COALESCE(last_used_at, created_at) < ?",
            (before,)).fetchall())
        return [_skill(row) for row in rows]

    # Proposals

    async def review_mark(self, session_key: str) -> int:
        row = await self._db.run_read(lambda conn: conn.execute(
            "SELECT reviewed_seq FROM skill_reviews WHERE session_key = ?", (session_key,)).fetchone())
        return row[0] if row else 0

    async def finish_review(self, session_key: str, reviewed_seq: int, proposal: Proposal | None,
                            admit: NewVersion | None = None) -> Proposal | None:
        """Record a review's outcome in one transaction: its proposal (admitted at once when `admit` is
        given), and the session's mark moved on. A job that already recorded its outcome gets that one."""
        def write(conn: sqlite3.Connection) -> Proposal | None:
            now = time.time()
            conn.execute("INSERT INTO skill_reviews VALUES (?, ?, ?) ON CONFLICT (session_key) DO UPDATE SET "
                         "reviewed_seq = MAX(reviewed_seq, excluded.reviewed_seq), updated_at = excluded.updated_at",
                         (session_key, reviewed_seq, now))
            if proposal is None:
                return None
            if proposal.job_id is not None:
                row = conn.execute(f"SELECT {_PROPOSAL} FROM skill_proposals WHERE job_id = ?",
                                   (proposal.job_id,)).fetchone()
                if row is not None:
                    return _proposal(row)
            recorded = proposal
            if admit is not None:
                version = _add_version(conn, admit, now)
                recorded = _decided(proposal, ProposalStatus.ADMITTED, admit.admitted_by, now, version.version)
            _insert_proposal(conn, recorded)
            return recorded

        return await self._db.run_write(write)

    async def proposal(self, proposal_id: str, identity: str | None = None) -> Proposal | None:
        row = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_PROPOSAL} FROM skill_proposals WHERE id = ? AND (? IS NULL OR identity = ?)",
            (proposal_id, identity, identity)).fetchone())
        return _proposal(row) if row else None

    async def proposals(self, identity: str | None, status: ProposalStatus | None = ProposalStatus.PENDING,
                        limit: int = 100) -> list[Proposal]:
        rows = await self._db.run_read(lambda conn: conn.execute(
            f"SELECT {_PROPOSAL} FROM skill_proposals WHERE (? IS NULL OR identity = ?) AND (? IS NULL OR status = ?) "
            "ORDER BY created_at DESC LIMIT ?",
            (identity, identity, status, status, limit)).fetchall())
        return [_proposal(row) for row in rows]

    async def decide(self, proposal: Proposal, by: str, admit: NewVersion | None) -> Proposal | None:
        """Admit (`admit` given) or reject a pending proposal; None if it was decided meanwhile."""
        def write(conn: sqlite3.Connection) -> Proposal | None:
            now = time.time()
            status = ProposalStatus.ADMITTED if admit is not None else ProposalStatus.REJECTED
            claimed = conn.execute("UPDATE skill_proposals SET status = ?, decided_at = ?, decided_by = ? "
                                   "WHERE id = ? AND status = 'pending'", (status.value, now, by, proposal.id))
            if claimed.rowcount == 0:
                return None
            version = _add_version(conn, admit, now).version if admit is not None else None
            conn.execute("UPDATE skill_proposals SET version = ? WHERE id = ?", (version, proposal.id))
            return _decided(proposal, status, by, now, version)

        return await self._db.run_write(write)


def _decided(proposal: Proposal, status: ProposalStatus, by: str, at: float, version: int | None) -> Proposal:
    return replace(proposal, status=status, decided_by=by, decided_at=at, version=version)


def _insert_proposal(conn: sqlite3.Connection, p: Proposal) -> None:
    conn.execute(f"INSERT INTO skill_proposals ({_PROPOSAL}) VALUES ({', '.join('?' * 20)})",
                 (p.id, p.identity, p.name, p.action, p.text, p.risk.value, json.dumps(list(p.risk_reasons)),
                  p.status.value, p.reason, p.created_at, p.base_version, p.session_key, p.turn_id, p.job_id,
                  p.decided_at, p.decided_by, p.version, p.input_tokens, p.output_tokens, p.cost_usd))
