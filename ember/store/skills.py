"""Skills, their versions, and the proposals of the background review.

Nothing is overwritten: a change to a skill is a new row in `skill_versions`
and the skill's `version` pointing at it, in one transaction. A proposal is
written once per review job (`job_id` is unique), in the transaction that also
advances the session's review mark, so a review retried after a crash never
proposes twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy import Boolean, Text, bindparam, case, func, insert, or_, select, update

from ember.core.redact import derived_text
from ember.core.skills import (
    SHARED,
    NewVersion,
    Proposal,
    ProposalStatus,
    Skill,
    SkillOrigin,
    SkillRisk,
    SkillStatus,
    SkillVersion,
)
from ember.store import schema
from ember.store.engine import Database
from ember.store.records import skill_of, visible_to
from ember.store.tx import Statement, Tx, Work, upsert

T = TypeVar("T")

_s, _v, _p, _r = schema.skills, schema.skill_versions, schema.skill_proposals, schema.skill_reviews
# The columns _skill, _version and _proposal read, in their order.
_SKILL = select(*(_s.c[name] for name in (
    "name", "description", "identity", "version", "status", "origin", "use_count", "last_used_at", "updated_at")))
_VERSION = select(*(_v.c[name] for name in (
    "name", "identity", "version", "text", "source", "admitted_by", "created_at", "files_json", "turn_id", "job_id")))
_PROPOSAL = select(*(_p.c[name] for name in (
    "id", "identity", "name", "action", "text", "risk", "risk_reasons", "status", "reason", "created_at",
    "base_version", "session_key", "turn_id", "job_id", "decided_at", "decided_by", "version", "input_tokens",
    "output_tokens", "cost_usd")))
_viewer = bindparam("identity", type_=Text)  # None: everyone's
_named = (_s.c.identity == bindparam("owner"), _s.c.name == bindparam("skill"))
_versions_of = (_v.c.identity == bindparam("owner"), _v.c.name == bindparam("skill"))

# Locked on PostgreSQL (SQLite has one writer): two processes adding a version of one skill at
# once number them one after the other.
_CURRENT_VERSION = Statement(select(_s.c.version).where(*_named).with_for_update())
_LAST_FILES = Statement(select(_v.c.files_json).where(*_versions_of).order_by(_v.c.version.desc()).limit(1))
_NEXT_VERSION = Statement(select(func.coalesce(func.max(_v.c.version), 0) + 1).where(*_versions_of))
_INSERT_VERSION = Statement(insert(_v))
_INSERT_SKILL = Statement(insert(_s).values(
    identity=bindparam("owner"), name=bindparam("skill"), description=bindparam("description"),
    version=bindparam("version"), status="active", origin=bindparam("origin"), disk_digest=bindparam("disk_digest"),
    created_at=bindparam("now"), updated_at=bindparam("now")))
_UPDATE_SKILL = Statement(update(_s).where(*_named).values(
    description=bindparam("description"), version=bindparam("version"), status="active", updated_at=bindparam("now"),
    disk_digest=func.coalesce(bindparam("disk_digest"), _s.c.disk_digest)))
_VISIBLE = Statement(_SKILL.where(or_(_viewer.is_(None), _s.c.identity.in_([SHARED, _viewer])),
                                  or_(bindparam("include_archived", type_=Boolean), _s.c.status == "active"))
                     .order_by(_s.c.name, _s.c.identity))
_FRESHNESS = Statement(select(func.count(), func.max(_s.c.updated_at), func.sum(_s.c.version))
                       .where(_s.c.identity.in_([SHARED, bindparam("identity")])))
# The identity's own skill first, then the shared one.
_GET = Statement(_SKILL.where(_s.c.name == bindparam("name"), _s.c.identity.in_([SHARED, bindparam("identity")]))
                 .order_by(_s.c.identity.desc()).limit(1))
_VERSION_OF = Statement(_VERSION.where(*_versions_of, _v.c.version == bindparam("version")))
_HISTORY = Statement(_VERSION.where(*_versions_of).order_by(_v.c.version))
_DISK_DIGESTS = Statement(select(_s.c.name, _s.c.disk_digest, _s.c.origin).where(_s.c.identity == SHARED))
_SET_STATUS = Statement(update(_s).where(*_named, _s.c.status != bindparam("new_status"))
                        .values(status=bindparam("new_status"), updated_at=bindparam("now")))
_RECORD_USE = Statement(update(_s).where(*_named).values(use_count=_s.c.use_count + 1,
                                                         last_used_at=bindparam("at")))
_UNUSED_SINCE = Statement(_SKILL.where(_s.c.status == "active",
                                       func.coalesce(_s.c.last_used_at, _s.c.created_at) < bindparam("before")))
_REVIEW_MARK = Statement(select(_r.c.reviewed_seq).where(_r.c.session_key == bindparam("session_key")))
_PROPOSAL_OF_JOB = Statement(_PROPOSAL.where(_p.c.job_id == bindparam("job_id")))
_PROPOSAL_BY_ID = Statement(_PROPOSAL.where(_p.c.id == bindparam("id"),
                                            or_(_viewer.is_(None), _p.c.identity == _viewer)))
_status = bindparam("status", type_=Text)  # None: any
_PROPOSALS = Statement(_PROPOSAL.where(or_(_viewer.is_(None), _p.c.identity == _viewer),
                                       or_(_status.is_(None), _p.c.status == _status))
                       .order_by(_p.c.created_at.desc()).limit(bindparam("limit")))
_DECIDE = Statement(update(_p).where(_p.c.id == bindparam("proposal"), _p.c.status == "pending")
                    .values(status=bindparam("status"), decided_at=bindparam("now"), decided_by=bindparam("by")))
_SET_PROPOSAL_VERSION = Statement(update(_p).where(_p.c.id == bindparam("proposal"))
                                  .values(version=bindparam("version")))
_INSERT_PROPOSAL = Statement(insert(_p))


def _moved_on(ins: Callable[..., Any]) -> Any:
    """A review's mark only moves forward: a late retry of an older review leaves it."""
    statement = ins(_r).values(session_key=bindparam("session_key"), reviewed_seq=bindparam("reviewed_seq"),
                               updated_at=bindparam("now"))
    new = statement.excluded
    return statement.on_conflict_do_update(index_elements=["session_key"], set_={
        "reviewed_seq": case((new.reviewed_seq > _r.c.reviewed_seq, new.reviewed_seq), else_=_r.c.reviewed_seq),
        "updated_at": new.updated_at})


_MARK_REVIEWED = upsert(_moved_on)





def _version(row: Sequence[Any]) -> SkillVersion:
    name, identity, version, text, source, by, created, files, turn_id, job_id = row
    return SkillVersion(name, identity, version, text, source, by, created, json.loads(files), turn_id, job_id)


def _proposal(row: Sequence[Any]) -> Proposal:
    (id_, identity, name, action, text, risk, reasons, status, reason, created, base, session_key, turn_id, job_id,
     decided_at, decided_by, version, tokens_in, tokens_out, cost) = row
    return Proposal(id_, identity, name, action, text, SkillRisk(risk), tuple(json.loads(reasons)),
                    ProposalStatus(status), reason, created, base, session_key, turn_id, job_id, decided_at,
                    decided_by, version, input_tokens=tokens_in, output_tokens=tokens_out, cost_usd=cost)





def _add_version(tx: Tx, change: NewVersion, now: float) -> SkillVersion:
    """A learned skill is derived from what was said, so it is kept redacted and without the model's
    thinking (the gate has refused one with a secret already: this holds whatever path admits it).
    A person's own skill, read from a folder or imported, is kept as they wrote it."""
    if change.origin is SkillOrigin.LEARNED:
        change = replace(change, text=derived_text(change.text), description=derived_text(change.description))
    named = {"owner": change.identity, "skill": change.name}
    row = tx.execute(_CURRENT_VERSION, named).fetchone()
    files = change.files
    if files is None:
        previous = tx.execute(_LAST_FILES, named).fetchone()
        files = json.loads(previous[0]) if previous else {}
    version = tx.execute(_NEXT_VERSION, named).fetchone()[0]
    tx.execute(_INSERT_VERSION, {
        "identity": change.identity, "name": change.name, "version": version, "text": change.text,
        "source": change.source, "admitted_by": change.admitted_by, "created_at": now,
        "files_json": json.dumps(files, ensure_ascii=False), "turn_id": change.turn_id, "job_id": change.job_id})
    skill = {**named, "description": change.description, "version": version, "disk_digest": change.disk_digest,
             "now": now}
    if row is None:
        tx.execute(_INSERT_SKILL, {**skill, "origin": change.origin.value})
    else:
        tx.execute(_UPDATE_SKILL, skill)
    return SkillVersion(change.name, change.identity, version, change.text, change.source, change.admitted_by, now,
                        files, change.turn_id, change.job_id)


# How long a turn trusts the skills' freshness it read, unless this store changed them meanwhile: a
# change made by another process (a worker, `ember skills approve`) reaches the index within this.
FRESHNESS_RECHECK_S = 2.0


class SqlSkillStore:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._writes = 0  # this store's writes so far: any of them may change what freshness says
        self._fresh: dict[str, tuple[float, int, tuple[Any, ...]]] = {}  # identity -> (read at, _writes, value)

    async def visible(self, identity: str | None, *, include_archived: bool = False) -> list[Skill]:
        """The shared skills and `identity`'s own, by name; a learned skill hides a shared one of its name.
        `identity` None: every skill of everyone (the local CLI)."""
        rows = await self._db.run_read(lambda tx: tx.execute(
            _VISIBLE, {"identity": identity, "include_archived": include_archived}).fetchall())
        return visible_to(identity, [skill_of(row) for row in rows])

    async def freshness(self, identity: str) -> tuple[Any, ...]:
        """Changes whenever the skills `identity` sees change (not when they are only used): at once
        for this store's own writes, within FRESHNESS_RECHECK_S for other processes'. A turn asks
        every time, and the store is read at most that often."""
        now, writes = time.monotonic(), self._writes
        kept = self._fresh.get(identity)
        if kept is not None and kept[1] == writes and now - kept[0] < FRESHNESS_RECHECK_S:
            return kept[2]
        value = await self._db.run_read(lambda tx: tuple(tx.execute(_FRESHNESS, {"identity": identity}).fetchone()))
        self._fresh[identity] = (now, writes, value)
        return value

    async def _write(self, work: Work[T]) -> T:
        try:
            return await self._db.run_write(work)
        finally:
            self._writes += 1

    async def get(self, identity: str | None, name: str) -> Skill | None:
        """The skill `identity` sees under `name` (its own first); identity None: the shared one."""
        row = await self._db.run_read(lambda tx: tx.execute(
            _GET, {"name": name, "identity": identity or SHARED}).fetchone())
        return skill_of(row) if row else None

    async def version(self, skill: Skill, version: int | None = None) -> SkillVersion | None:
        number = skill.version if version is None else version
        row = await self._db.run_read(lambda tx: tx.execute(
            _VERSION_OF, {"owner": skill.identity, "skill": skill.name, "version": number}).fetchone())
        return _version(row) if row else None

    async def history(self, skill: Skill) -> list[SkillVersion]:
        rows = await self._db.run_read(lambda tx: tx.execute(
            _HISTORY, {"owner": skill.identity, "skill": skill.name}).fetchall())
        return [_version(row) for row in rows]

    async def disk_digests(self) -> dict[str, tuple[str | None, str]]:
        """Shared skills: name -> (digest of the folder last read, origin)."""
        rows = await self._db.run_read(lambda tx: tx.execute(_DISK_DIGESTS).fetchall())
        return {name: (digest, origin) for name, digest, origin in rows}

    async def add_version(self, change: NewVersion) -> SkillVersion:
        return await self._write(lambda tx: _add_version(tx, change, time.time()))

    async def set_status(self, identity: str, names: Sequence[str], status: SkillStatus) -> None:
        now = time.time()
        await self._write(lambda tx: tx.executemany(_SET_STATUS, [
            {"owner": identity, "skill": name, "new_status": status.value, "now": now} for name in names]))

    async def record_use(self, skill: Skill, at: float) -> None:
        await self._write(lambda tx: tx.execute(
            _RECORD_USE, {"owner": skill.identity, "skill": skill.name, "at": at}))

    async def unused_since(self, before: float) -> list[Skill]:
        """Active skills not used since `before` (counting from when they were added)."""
        rows = await self._db.run_read(lambda tx: tx.execute(_UNUSED_SINCE, {"before": before}).fetchall())
        return [skill_of(row) for row in rows]

    # Proposals

    async def review_mark(self, session_key: str) -> int:
        row = await self._db.run_read(lambda tx: tx.execute(_REVIEW_MARK, {"session_key": session_key}).fetchone())
        return row[0] if row else 0

    async def finish_review(self, session_key: str, reviewed_seq: int, proposal: Proposal | None,
                            admit: NewVersion | None = None) -> Proposal | None:
        """Record a review's outcome in one transaction: its proposal (admitted at once when `admit` is
        given), and the session's mark moved on. A job that already recorded its outcome gets that one."""
        def write(tx: Tx) -> Proposal | None:
            now = time.time()
            tx.execute(_MARK_REVIEWED, {"session_key": session_key, "reviewed_seq": reviewed_seq, "now": now})
            if proposal is None:
                return None
            if proposal.job_id is not None:
                row = tx.execute(_PROPOSAL_OF_JOB, {"job_id": proposal.job_id}).fetchone()
                if row is not None:
                    return _proposal(row)
            recorded = _kept(proposal)
            if admit is not None:
                version = _add_version(tx, admit, now)
                recorded = _decided(proposal, ProposalStatus.ADMITTED, admit.admitted_by, now, version.version)
            _insert_proposal(tx, recorded)
            return recorded

        return await self._write(write)

    async def proposal(self, proposal_id: str, identity: str | None = None) -> Proposal | None:
        row = await self._db.run_read(lambda tx: tx.execute(
            _PROPOSAL_BY_ID, {"id": proposal_id, "identity": identity}).fetchone())
        return _proposal(row) if row else None

    async def proposals(self, identity: str | None, status: ProposalStatus | None = ProposalStatus.PENDING,
                        limit: int = 100) -> list[Proposal]:
        rows = await self._db.run_read(lambda tx: tx.execute(
            _PROPOSALS, {"identity": identity, "status": status, "limit": limit}).fetchall())
        return [_proposal(row) for row in rows]

    async def decide(self, proposal: Proposal, by: str, admit: NewVersion | None) -> Proposal | None:
        """Admit (`admit` given) or reject a pending proposal; None if it was decided meanwhile."""
        def write(tx: Tx) -> Proposal | None:
            now = time.time()
            status = ProposalStatus.ADMITTED if admit is not None else ProposalStatus.REJECTED
            claimed = tx.execute(_DECIDE, {"proposal": proposal.id, "status": status.value, "now": now, "by": by})
            if claimed.rowcount == 0:
                return None
            version = _add_version(tx, admit, now).version if admit is not None else None
            tx.execute(_SET_PROPOSAL_VERSION, {"proposal": proposal.id, "version": version})
            return _decided(proposal, status, by, now, version)

        return await self._write(write)


def _decided(proposal: Proposal, status: ProposalStatus, by: str, at: float, version: int | None) -> Proposal:
    return replace(proposal, status=status, decided_by=by, decided_at=at, version=version)


def _kept(proposal: Proposal) -> Proposal:
    """As a proposal is kept: the model's text and its reason may quote what was said (a refused one,
    the secret) or carry its thinking."""
    return replace(proposal, text=derived_text(proposal.text), reason=derived_text(proposal.reason))


def _insert_proposal(tx: Tx, p: Proposal) -> None:
    p = _kept(p)
    tx.execute(_INSERT_PROPOSAL, {
        "id": p.id, "identity": p.identity, "name": p.name, "action": p.action, "text": p.text,
        "risk": p.risk.value, "risk_reasons": json.dumps(list(p.risk_reasons)), "status": p.status.value,
        "reason": p.reason,
        "created_at": p.created_at, "base_version": p.base_version, "session_key": p.session_key,
        "turn_id": p.turn_id, "job_id": p.job_id, "decided_at": p.decided_at, "decided_by": p.decided_by,
        "version": p.version, "input_tokens": p.input_tokens, "output_tokens": p.output_tokens,
        "cost_usd": p.cost_usd})
