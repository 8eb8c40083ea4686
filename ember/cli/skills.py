"""`ember skills`: what the agent knows how to do, what it proposes to learn, and
every version of both. The terminal is the person who runs Ember: it sees the
shared skills and everyone's learned ones (`--identity` narrows to one), and
its approvals are recorded as `local`. A running `ember serve` sees a change
at its next turn.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ember.cli.common import (
    ProgressBar,
    err,
    glance_at,
    open_store,
    out,
    print_json,
    run_command,
    settings_or_exit,
    setup_logging,
)
from ember.core.errors import SkillError
from ember.core.memory import LOCAL_IDENTITY
from ember.core.skills import SHARED, Proposal, ProposalStatus, SkillStatus

if TYPE_CHECKING:
    from ember.core.skills import Skill
    from ember.skills.library import SkillLibrary

skills_app = typer.Typer(help="Skills: list, show, pending proposals, approve, reject, diff, rollback, import.",
                         no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
IdentityOption = Annotated[str | None, typer.Option(
    "--identity", help="Whose learned skills (default: the shared ones, and for lists everyone's).")]
NameArgument = Annotated[str, typer.Argument(help="The skill's name (ember skills list shows them).")]
ProposalArgument = Annotated[str, typer.Argument(help="The proposal's id (ember skills pending shows them).")]


@asynccontextmanager
async def _library() -> AsyncIterator[SkillLibrary]:
    from ember.app.services import skill_library

    settings = settings_or_exit()
    setup_logging(settings, verbose=False)
    async with open_store(settings) as stores:
        library = skill_library(settings, stores.db)
        await library.sync()
        yield library


async def _at_a_glance(identity: str | None, archived: bool) -> tuple[list[Skill], dict[str, str]] | None:
    """The skills, and the folders that could not be read, when no skill folder changed since the store
    last read them: then there is nothing to write, and the read-only glance lists them. None when one
    did (the library reads it in first) or the store cannot be glanced at."""
    from ember.config.locate import plain_home
    from ember.config.paths import SKILLS_FOLDER
    from ember.skills.folders import default_folders, edited, read_folders, vanished

    home = plain_home(also_unset=("skills_dir",))
    with glance_at(home) as quick:
        if home is None or quick is None:
            return None
        found, errors = read_folders(default_folders(home / SKILLS_FOLDER))
        known = await quick.skills.disk_digests()
        kept = {skill.name for skill in await quick.skills.visible(SHARED, include_archived=True)
                if skill.status is not SkillStatus.ARCHIVED}
        if edited(found, known) or kept.intersection(vanished(found, known)):
            return None
        return await quick.skills.visible(identity, include_archived=archived), errors


def _when(timestamp: float | None) -> str:
    return dt.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M") if timestamp else "never"


def _proposal_lines(proposal: Proposal, *, diff: bool) -> None:
    risk = f"{proposal.risk.value} risk" + (f": {', '.join(proposal.risk_reasons)}" if proposal.risk_reasons else "")
    out.print(f"[bold]{proposal.id}[/bold] {proposal.action} [bold]{escape(proposal.name)}[/bold] "
              f"for {escape(proposal.identity)} [{proposal.status.value}, {escape(risk)}]")
    out.print(f"  from session {escape(proposal.session_key or '?')}, {_when(proposal.created_at)}; "
              f"review used {proposal.input_tokens}+{proposal.output_tokens} tokens")
    if proposal.reason:
        out.print(f"  {escape(proposal.reason)}")
    if diff and proposal.diff:
        out.print(escape(proposal.diff), highlight=False)


@skills_app.command("list")
def list_skills(identity: IdentityOption = None, archived: Annotated[bool, typer.Option(
        "--archived", help="Include archived skills.")] = False, as_json: JsonOption = False) -> None:
    """Every skill: name, description, scope, version, status."""
    async def body() -> int:
        listed = await _at_a_glance(identity, archived)
        if listed is None:
            async with _library() as library:
                listed = await library.skills(identity, include_archived=archived), library.load_errors
        skills, errors = listed
        if as_json:
            print_json([skill.to_json_dict() for skill in skills])
            return 0
        table = Table()
        for column in ("name", "scope", "version", "status", "uses", "last used", "description"):
            table.add_column(column, no_wrap=column == "name")
        for s in skills:
            scope = s.scope if s.identity == "" else f"learned ({s.identity})"
            table.add_row(s.name, escape(scope), str(s.version), s.status.value, str(s.use_count),
                          _when(s.last_used_at), escape(s.description))
        out.print(table if skills else "No skills.")
        for folder, reason in errors.items():
            out.print(f"[yellow]not loaded:[/yellow] {escape(folder)}: {escape(reason)}")
        return 0

    run_command(body())


@skills_app.command("show")
def show(name: NameArgument, identity: IdentityOption = None,
         version: Annotated[int | None, typer.Option("--version", help="Which version (default: current).")] = None,
         as_json: JsonOption = False) -> None:
    """A skill's SKILL.md and its history."""
    async def body() -> int:
        async with _library() as library:
            skill, chosen, history = await library.show(identity, name, version)
        if as_json:
            print_json({**skill.to_json_dict(), "shown": chosen.to_json_dict(),
                         "history": [v.to_json_dict(with_text=False) for v in history]})
            return 0
        out.print(f"[bold]{skill.name}[/bold] version {chosen.version} of {len(history)} ({skill.status.value})")
        out.print(escape(chosen.text), highlight=False)
        if chosen.files:
            out.print(f"files: {escape(', '.join(sorted(chosen.files)))}")
        out.print("history:")
        for v in history:
            mark = "*" if v.version == skill.version else " "
            out.print(f" {mark} v{v.version} {_when(v.created_at)} by {escape(v.admitted_by)}: {escape(v.source)}")
        return 0

    run_command(body())


@skills_app.command("diff")
def diff(name: NameArgument, identity: IdentityOption = None, version: Annotated[int | None, typer.Option(
        "--version", help="The version whose change to show (default: the current one).")] = None,
         as_json: JsonOption = False) -> None:
    """What a version changed from the one before it."""
    async def body() -> int:
        async with _library() as library:
            skill, chosen, _ = await library.show(identity, name, version)
            text = await library.diff(identity, name, chosen.version)
        if as_json:
            print_json({"name": skill.name, "identity": skill.identity or None, "version": chosen.version,
                        "diff": text})
            return 0
        print(text or "(no change)", end="" if text.endswith("\n") else "\n")
        return 0

    run_command(body())


@skills_app.command("pending")
def pending(identity: IdentityOption = None, as_json: JsonOption = False) -> None:
    """Proposals waiting for a person, with their diffs."""
    async def body() -> int:
        async with _library() as library:
            proposals = await library.proposals(identity)
        if as_json:
            print_json([p.to_json_dict() for p in proposals])
            return 0
        if not proposals:
            out.print("No proposals are pending.")
        for proposal in proposals:
            _proposal_lines(proposal, diff=True)
        return 0

    run_command(body())


@skills_app.command("proposals")
def proposals(identity: IdentityOption = None, as_json: JsonOption = False) -> None:
    """Every proposal, decided or not: admitted, rejected, refused by the gate (with why), pending."""
    async def body() -> int:
        async with _library() as library:
            found = await library.proposals(identity, None)
        if as_json:
            print_json([p.to_json_dict() for p in found])
            return 0
        for proposal in found:
            _proposal_lines(proposal, diff=False)
        if not found:
            out.print("No proposals yet.")
        return 0

    run_command(body())


def _decide(proposal_id: str, approve: bool) -> None:
    async def body() -> int:
        async with _library() as library:
            decided = await library.decide(proposal_id, approve, LOCAL_IDENTITY)
        if decided.status is ProposalStatus.ADMITTED:
            out.print(f"Approved: {decided.name} is now at version {decided.version}.")
        else:
            out.print(f"Rejected: {decided.name} is unchanged.")
        return 0

    run_command(body())


@skills_app.command("approve")
def approve(proposal_id: ProposalArgument) -> None:
    """Admit a pending proposal: a new version of the proposer's skill."""
    _decide(proposal_id, True)


@skills_app.command("reject")
def reject(proposal_id: ProposalArgument) -> None:
    """Turn down a pending proposal: nothing changes."""
    _decide(proposal_id, False)


@skills_app.command("rollback")
def rollback(name: NameArgument, version: Annotated[int, typer.Argument(help="The version to restore.")],
             identity: IdentityOption = None) -> None:
    """Restore a version's exact text as a new version (an archived skill comes back too)."""
    async def body() -> int:
        async with _library() as library:
            restored = await library.rollback(identity, name, version, LOCAL_IDENTITY)
        out.print(f"{restored.name} is now at version {restored.version}, the text of version {version}.")
        return 0

    run_command(body())


@skills_app.command("import")
def import_skill(paths: Annotated[list[Path], typer.Argument(
        metavar="PATH", help="Folders, each with a SKILL.md.")]) -> None:
    """Add skill folders as shared skills, admitted at once; a name that exists gets a new version.
    A folder that cannot be imported is named with why, and the others are imported."""
    async def body() -> int:
        imported: list[str] = []  # printed once the bar is gone: it is drawn on standard error only
        async with _library() as library:
            with ProgressBar("importing skills") as bar:
                for done, path in enumerate(paths):
                    if len(paths) > 1:
                        bar(done, len(paths))
                    try:
                        added = await library.import_folder(path, LOCAL_IDENTITY)
                    except SkillError as exc:
                        which = f"{path}: " if len(paths) > 1 else ""
                        err.print(f"[red]error:[/red] {escape(which + str(exc))}")
                    else:
                        files = f" with {len(added.files)} files" if added.files else ""
                        imported.append(f"Imported {added.name} as version {added.version}{files}.")
        for line in imported:
            out.print(line, markup=False)
        return 0 if len(imported) == len(paths) else 1

    run_command(body())


@skills_app.command("curate")
def curate() -> None:
    """Archive the skills unused for skills_archive_after_days (the background does this too)."""
    async def body() -> int:
        async with _library() as library:
            archived = await library.curate()
        out.print(f"Archived {len(archived)} unused skills." + "".join(f"\n  {s.name}" for s in archived))
        return 0

    run_command(body())
