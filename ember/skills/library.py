"""The skill library: every skill an identity may use, the prompt's index of
them, and the ways a person changes them (import, approve, reject, rollback).

Skills come from three places: the folders bundled with Ember, the person's
folders in EMBER_HOME/skills (which override a bundled one of the same name),
and what was imported or learned, which lives only in the store. A folder is
read into the store as a version whenever its content changes, so every skill
has one history, whatever its source.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Literal

from sqlalchemy.exc import IntegrityError

from ember.core.errors import SkillError, SkillNotFound
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
from ember.skills.folders import SkillFolder, edited, read_folders, signature, vanished
from ember.skills.format import SkillFormatError, check_name, parse_skill_md, read_folder
from ember.store.protocols import SkillStore
from ember.tools.workspace import Workspace

log = logging.getLogger(__name__)

INDEX_HEADING = ("Skills you can use. Before following one, call skill_view with its name to read its "
                 "instructions:")
INDEX_LINE_CHARS = 240  # a long description is cut in the index; skill_view shows it whole
CHANGE_CHECK_S = 2.0  # how often a turn may look whether a skill folder changed


@dataclass(frozen=True, slots=True)
class SkillPolicy:
    auto_admit: Literal["none", "low-risk"] = "none"  # which proposals need no person
    index_chars: int = 4_000  # the prompt's index of skills, at most
    archive_after_days: float = 90.0  # a skill unused this long leaves the index (it is kept)


def _place_script(workspace: Workspace, relative: str, content: str) -> str:
    """Writes a skill's script into the workspace through its jail (a link planted on the
    way is not followed); returns where it is."""
    path = workspace.resolve(relative)
    file, _ = workspace.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_parents=True)
    with file:
        file.write(content.encode("utf-8"))
    return workspace.display(path)


def unified_diff(before: str, after: str, before_label: str, after_label: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        before_label, after_label))


class SkillLibrary:
    def __init__(self, store: SkillStore, folders: Sequence[SkillFolder] = (), policy: SkillPolicy | None = None,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.policy = policy or SkillPolicy()
        self._folders = list(folders)
        self._clock = clock
        self.load_errors: dict[str, str] = {}  # folder -> why it was not loaded
        self._signature: tuple[tuple[str, int], ...] | None = None
        self._checked_at = 0.0
        self._refresh: asyncio.Task[None] | None = None
        self._sync_lock = asyncio.Lock()
        # (identity, the index's patterns) -> (freshness, text)
        self._indexes: dict[tuple[str, tuple[str, ...] | None], tuple[object, str]] = {}

    # Folders

    async def sync(self, *, force: bool = False) -> None:
        """Read the skill folders into the store where they changed since they were last read."""
        async with self._sync_lock:
            marks = await asyncio.to_thread(signature, self._folders)
            if marks == self._signature and not force:
                return
            found, errors = await asyncio.to_thread(read_folders, self._folders)
            known = await self.store.disk_digests()
            for name in edited(found, known):
                skill = found[name]
                content = skill.digest
                source = f"{'edited in' if name in known else 'read from'} {skill.path}"
                change = NewVersion(SHARED, name, skill.doc.description, skill.doc.text, source=source,
                                    admitted_by="local", origin=skill.origin, files=skill.files, disk_digest=content)
                try:
                    await self.store.add_version(change)
                except IntegrityError:
                    # Another process on a shared store (PostgreSQL) added a version of this skill at the
                    # same moment (processes starting together read the bundled folders together).
                    if (await self.store.disk_digests()).get(name, (None, ""))[0] != content:
                        await self.store.add_version(change)  # another text: this one is the next version
            if gone := vanished(found, known):
                await self.store.set_status(SHARED, gone, SkillStatus.ARCHIVED)
            for folder, reason in errors.items():
                if self.load_errors.get(folder) != reason:
                    log.warning("skill %s was not loaded: %s", folder, reason)
            self.load_errors = errors
            self._signature = marks

    def _look_at_folders_now_and_then(self) -> None:
        """A turn never waits for the folders: an edit is read in the background, for the next turn."""
        if not self._folders or time.monotonic() - self._checked_at < CHANGE_CHECK_S:
            return
        if self._refresh is None or self._refresh.done():
            self._checked_at = time.monotonic()
            self._refresh = asyncio.create_task(self._sync_logged(), name="ember-skill-folders")

    async def _sync_logged(self) -> None:
        try:
            await self.sync()
        except Exception:  # the store's versions stay as they were; the next look tries again
            log.warning("could not read the skill folders", exc_info=True)

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)

    # What the model sees

    async def index(self, identity: str, only: Sequence[str] | None = None) -> str:
        """The prompt's section: name and description of each active skill, by name, within the
        budget; `only`: the names or patterns a named agent's index keeps (None: every skill)."""
        self._look_at_folders_now_and_then()
        freshness = await self.store.freshness(identity)
        key = (identity, tuple(only) if only is not None else None)
        cached = self._indexes.get(key)
        if cached is not None and cached[0] == freshness:
            return cached[1]
        skills = await self.store.visible(identity)
        if only is not None:
            skills = [skill for skill in skills if any(fnmatchcase(skill.name, pattern) for pattern in only)]
        text = self._render_index(skills)
        self._indexes[key] = (freshness, text)
        return text

    def _render_index(self, skills: Sequence[Skill]) -> str:
        if not skills:
            return ""
        def omitted(count: int) -> str:
            return f"({count} more skills are not listed; skill_view with a word for the name lists those that match.)"

        lines, used = [INDEX_HEADING], len(INDEX_HEADING)
        for shown, skill in enumerate(skills):
            description = " ".join(skill.description.split())
            if len(description) > INDEX_LINE_CHARS:
                description = description[:INDEX_LINE_CHARS - 1].rstrip() + "…"
            line = f"- {skill.name}: {description}"
            after = len(skills) - shown - 1
            # Room for this line, and for the note on the ones after it if there are any.
            if used + 1 + len(line) + (1 + len(omitted(after)) if after else 0) > self.policy.index_chars:
                lines.append(omitted(after + 1))
                break
            lines.append(line)
            used += 1 + len(line)
        return "\n".join(lines)

    async def find(self, identity: str | None, name: str) -> Skill:
        """The active skill `identity` sees as `name`; SkillNotFound saying which names come close."""
        skill = await self.store.get(identity, name) if _plain_name(name) else None
        if skill is not None and skill.status is SkillStatus.ACTIVE:
            return skill
        skills = await self.store.visible(identity)
        words = name.lower().replace("-", " ").split()
        close = difflib.get_close_matches(name, [s.name for s in skills], n=5, cutoff=0.6)
        close += [s.name for s in skills if s.name not in close and words and all(
            word in f"{s.name} {s.description}".lower() for word in words)][:10 - len(close)]
        archived = " It is archived (unused for long); a person can restore it with `ember skills rollback`." \
            if skill is not None else ""
        hint = f" Skills that come close: {', '.join(close)}." if close else ""
        raise SkillNotFound(f"no skill {name[:80]!r}.{archived}{hint}")

    async def view(self, identity: str, name: str, file: str | None = None, *,
                   workspace: Workspace | None = None) -> str:
        """A skill's instructions, or one of its files; a script is also put in `workspace` to run."""
        skill = await self.find(identity, name)
        version = await self.store.version(skill)
        assert version is not None
        if file is None:
            await self.store.record_use(skill, self._clock())
            doc = parse_skill_md(version.text)
            listed = (f"\n\nFiles of this skill (skill_view with file=...): {', '.join(sorted(version.files))}"
                      if version.files else "")
            return f"# Skill {skill.name} (version {skill.version})\n\n{doc.body}{listed}"
        if file not in version.files:
            known = ", ".join(sorted(version.files)) or "none"
            raise SkillNotFound(f"skill {skill.name} has no file {file[:120]!r}; its files: {known}")
        content = version.files[file]
        if file.startswith("scripts/") and workspace is not None:
            placed = await asyncio.to_thread(_place_script, workspace, f".skills/{skill.name}/{file}", content)
            return f"{content}\n\n[This script is at {placed} in the workspace; run it with the shell tool.]"
        return content

    # What a person does

    async def skills(self, identity: str | None, *, include_archived: bool = False) -> list[Skill]:
        await self.sync()
        return await self.store.visible(identity, include_archived=include_archived)

    async def show(self, identity: str | None, name: str,
                   version: int | None = None) -> tuple[Skill, SkillVersion, list[SkillVersion]]:
        """The skill, the version asked for (default: the current one) and its whole history."""
        skill = await self.store.get(identity, name) if _plain_name(name) else None
        if skill is None:
            await self.find(identity, name)  # raises with the names that come close
            raise AssertionError("unreachable")
        history = await self.store.history(skill)
        chosen = next((v for v in history if v.version == (version or skill.version)), None)
        if chosen is None:
            raise SkillNotFound(f"skill {name} has no version {version}; it has 1 to {history[-1].version}")
        return skill, chosen, history

    async def diff(self, identity: str | None, name: str, version: int | None = None) -> str:
        """What `version` (default: the current one) changed from the one before it."""
        _, chosen, history = await self.show(identity, name, version)
        before = next((v.text for v in history if v.version == chosen.version - 1), "")
        return unified_diff(before, chosen.text, f"{name} v{chosen.version - 1}" if before else "/dev/null",
                            f"{name} v{chosen.version}")

    async def rollback(self, identity: str | None, name: str, version: int, by: str) -> SkillVersion:
        """A new version with the exact text and files of `version`; nothing is overwritten."""
        skill, chosen, _ = await self.show(identity, name, version)
        doc = parse_skill_md(chosen.text)
        return await self.store.add_version(NewVersion(
            skill.identity, skill.name, doc.description, chosen.text, source=f"rollback to version {version}",
            admitted_by=by, origin=skill.origin, files=dict(chosen.files)))

    async def import_folder(self, path: Path, by: str) -> SkillVersion:
        """A person's own act: admitted at once, shared; a name that exists gets a new version."""
        doc, files = await asyncio.to_thread(read_folder, path.expanduser().resolve())
        existing = await self.store.get(SHARED, doc.name)
        return await self.store.add_version(NewVersion(
            SHARED, doc.name, doc.description, doc.text, source=f"imported from {path}", admitted_by=by,
            origin=existing.origin if existing else SkillOrigin.IMPORTED, files=files))

    async def proposals(self, identity: str | None,
                        status: ProposalStatus | None = ProposalStatus.PENDING) -> list[Proposal]:
        return [await self._with_diff(p) for p in await self.store.proposals(identity, status)]

    async def proposal(self, proposal_id: str, identity: str | None = None) -> Proposal:
        proposal = await self.store.proposal(proposal_id, identity)
        if proposal is None:
            raise SkillNotFound(f"no skill proposal {proposal_id[:64]!r}")
        return await self._with_diff(proposal)

    async def _with_diff(self, proposal: Proposal) -> Proposal:
        before = ""
        if proposal.base_version is not None:
            skill = await self.store.get(proposal.identity, proposal.name)
            base = await self.store.version(skill, proposal.base_version) if skill else None
            before = base.text if base else ""
        label = f"{proposal.name} v{proposal.base_version}" if before else "/dev/null"
        return replace(proposal, diff=unified_diff(before, proposal.text, label, f"{proposal.name} proposed"))

    async def decide(self, proposal_id: str, approve: bool, by: str, identity: str | None = None) -> Proposal:
        """Approve (a new version of the proposer's skill) or reject (nothing changes) a pending proposal."""
        proposal = await self.proposal(proposal_id, identity)
        if proposal.status is not ProposalStatus.PENDING:
            raise SkillError(f"proposal {proposal.id} is already {proposal.status.value}")
        decided = await self.store.decide(proposal, by, await self.admission(proposal, by) if approve else None)
        if decided is None:
            raise SkillError(f"proposal {proposal.id} was decided meanwhile")
        return decided

    async def admission(self, proposal: Proposal, by: str) -> NewVersion:
        """The version a proposal becomes: the proposer's own skill, with the files of the one it patches."""
        doc = parse_skill_md(proposal.text)
        current = await self.store.get(proposal.identity, proposal.name)
        files: dict[str, str] | None = None
        if current is None:
            files = {}
        elif current.identity == SHARED:  # the proposer's own version of a shared skill; others keep theirs
            base = await self.store.version(current)
            files = dict(base.files) if base else {}
        source = f"review of session {proposal.session_key}" + (f" (job {proposal.job_id})" if proposal.job_id else "")
        return NewVersion(proposal.identity, doc.name, doc.description, proposal.text, source=source, admitted_by=by,
                          origin=SkillOrigin.LEARNED, files=files, turn_id=proposal.turn_id, job_id=proposal.job_id)

    def auto_admits(self, risk: SkillRisk) -> bool:
        return self.policy.auto_admit == "low-risk" and risk is SkillRisk.LOW

    async def curate(self) -> list[Skill]:
        """Archive the skills unused for `archive_after_days` (they keep their history, and come back
        with a new version)."""
        before = self._clock() - self.policy.archive_after_days * 86_400
        unused = await self.store.unused_since(before)
        for identity in {skill.identity for skill in unused}:
            await self.store.set_status(identity, [s.name for s in unused if s.identity == identity],
                                        SkillStatus.ARCHIVED)
        return unused


def _plain_name(name: str) -> bool:
    try:
        check_name(name)
    except SkillFormatError:
        return False
    return True

