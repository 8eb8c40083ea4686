"""`ember memory`: what the agent remembers, added, searched, imported, forgotten.

Every command acts on one identity's memory: `local` (the terminal's person)
unless `--identity` names another. Commands that write finish the embedding
they queued before they exit, so a search right after them finds by meaning.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ember.cli.common import (
    ProgressBar,
    err,
    open_listings,
    open_store,
    out,
    print_json,
    run_command,
    settings_or_exit,
    setup_logging,
)
from ember.core.errors import MemoryInputError
from ember.core.memory import (
    LOCAL_IDENTITY,
    MemoryKind,
    MemoryRecord,
    MemoryStatus,
    NewMemory,
    SourceRank,
    check_content,
)

if TYPE_CHECKING:  # the runtime loads when a command runs
    from ember.config.settings import Settings
    from ember.memory.service import MemoryService

memory_app = typer.Typer(help="What the agent remembers: add, search, import, forget.", no_args_is_help=True)

IMPORT_BATCH = 500

IdentityOption = Annotated[str, typer.Option("--identity", help="Whose memory (local: the terminal's person).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
AllOption = Annotated[bool, typer.Option("--all", help="Include superseded and archived memories.")]


@asynccontextmanager
async def _memory(settings: Settings, *, search: bool = True) -> AsyncIterator[MemoryService]:
    """The memory service; with `search`, its embedder too (commands that only list need none)."""
    from ember.memory.service import MemoryService

    async with open_store(settings) as stores:
        if search:
            from ember.app.services import memory_service  # only where an embedder is needed

            service = memory_service(settings, stores.db)
        else:
            service = MemoryService(stores.memory, None)
        await service.open()
        yield service


def _settings() -> Settings:
    settings = settings_or_exit()
    setup_logging(settings, verbose=False)
    return settings


def _when(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


def _table(records: list[MemoryRecord], scores: list[float] | None = None) -> Table:
    """The content gets the width; a column that would say the same on every row is left out."""
    statuses = any(r.status is not MemoryStatus.ACTIVE for r in records)
    abouts = [f"{r.subject or ''}.{r.key}" if r.key else (r.subject or "") for r in records]
    table = Table(expand=True)
    table.add_column("id", no_wrap=True)  # an id is copied whole into the next command
    table.add_column("kind", no_wrap=True)
    if statuses:
        table.add_column("status", no_wrap=True)
    if any(abouts):
        table.add_column("about", max_width=24)
    table.add_column("content", ratio=1, overflow="fold")
    table.add_column("created", no_wrap=True)
    if scores:
        table.add_column("score", no_wrap=True)
    for index, (r, about) in enumerate(zip(records, abouts)):
        row = [r.id, r.kind.value, *([r.status.value] if statuses else []), *([escape(about)] if any(abouts) else []),
               escape(r.content), _when(r.created_at), *([f"{scores[index]:.4f}"] if scores else [])]
        table.add_row(*row)
    return table


async def _finish_embedding(memory: MemoryService) -> None:
    pending = await memory.store.count_unembedded()
    if not pending:
        return
    with ProgressBar("embedding") as bar:
        bar(0, pending)
        await memory.flush_embeddings(progress=lambda done: bar(done, pending))


@memory_app.command("add")
def add(
    text: Annotated[str, typer.Argument(help="What to remember.")],
    subject: Annotated[str | None, typer.Option(help="Whom or what it is about.")] = None,
    key: Annotated[str | None, typer.Option(help="The attribute; a new fact with the same subject and key "
                                                  "replaces the old one.")] = None,
    identity: IdentityOption = LOCAL_IDENTITY,
    as_json: JsonOption = False,
) -> None:
    """Remember TEXT as a fact the person stated; prints the new memory's id."""
    settings = _settings()

    async def main() -> int:
        async with _memory(settings) as memory:
            outcome = await memory.remember(identity, text, subject=subject, key=key, source="ember memory add")
            await _finish_embedding(memory)
        if as_json:
            print_json({**outcome.record.to_json_dict(), "created": outcome.created,
                         "superseded": list(outcome.superseded)})
        else:
            print(outcome.record.id)
            if not outcome.created:
                err.print("already remembered: that is the existing memory's id", markup=False)
        return 0

    run_command(main())


@memory_app.command("search")
def search(
    query: Annotated[str, typer.Argument(help="What to look for.")],
    limit: Annotated[int, typer.Option(help="How many results.")] = 10,
    include_all: AllOption = False,
    identity: IdentityOption = LOCAL_IDENTITY,
    as_json: JsonOption = False,
) -> None:
    """Search memories by words and by meaning, best first."""
    settings = _settings()

    async def main() -> int:
        async with _memory(settings) as memory:
            hits = await memory.search(identity, query, limit=limit, include_inactive=include_all)
        if as_json:
            print_json([hit.to_json_dict() for hit in hits])
        elif hits:
            out.print(_table([h.record for h in hits], [h.score for h in hits]))
        else:
            out.print("Nothing found.")
        return 0

    run_command(main())


# What a person reads as their memory: the facts and the conversations' summaries, not every chat line.
LISTED_KINDS = (MemoryKind.FACT, MemoryKind.EPISODIC)


@memory_app.command("list")
def list_memories(
    kind: Annotated[list[MemoryKind] | None, typer.Option(
        "--kind", help="Only this tier; repeat it for several (default: fact and episodic).")] = None,
    include_all: Annotated[bool, typer.Option(
        "--all", help="Every tier, and superseded and archived memories too.")] = False,
    identity: IdentityOption = LOCAL_IDENTITY,
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 100,
    as_json: JsonOption = False,
) -> None:
    """Memories, newest first: active facts and episodes unless --kind or --all say otherwise."""
    kinds = tuple(kind) if kind else () if include_all else LISTED_KINDS

    async def main() -> int:
        async with open_listings() as stores:
            records = await stores.memory.list(identity, kinds=kinds, include_inactive=include_all, limit=limit)
        if as_json:
            print_json([r.to_json_dict() for r in records])
        elif records:
            out.print(_table(records))
        else:
            out.print("No memories yet." if include_all or kind else
                      "No facts or episodes yet (--kind archival lists the archived chat, --all everything).")
        return 0

    run_command(main())


@memory_app.command("history")
def history(
    memory_id: Annotated[str, typer.Argument(metavar="ID")],
    identity: IdentityOption = LOCAL_IDENTITY,
    as_json: JsonOption = False,
) -> None:
    """The supersession chain of a fact, oldest first."""
    settings = _settings()

    async def main() -> int:
        async with _memory(settings, search=False) as memory:
            chain = await memory.store.history(identity, memory_id)
        if as_json:
            print_json([r.to_json_dict() for r in chain])
        else:
            out.print(_table(chain))
        return 0

    run_command(main())


@memory_app.command("forget")
def forget(memory_id: Annotated[str, typer.Argument(metavar="ID")], identity: IdentityOption = LOCAL_IDENTITY) -> None:
    """Archive a memory: never recalled again, still listed with --all. `purge` deletes."""
    settings = _settings()

    async def main() -> int:
        async with _memory(settings, search=False) as memory:
            record = await memory.forget(identity, memory_id)
        out.print(f"archived {record.id}")
        return 0

    run_command(main())


@memory_app.command("purge")
def purge(memory_id: Annotated[str, typer.Argument(metavar="ID")], identity: IdentityOption = LOCAL_IDENTITY) -> None:
    """Delete a memory for good: its row, its text index entry and its vector."""
    settings = _settings()

    async def main() -> int:
        async with _memory(settings, search=False) as memory:
            await memory.store.purge(identity, memory_id)
        out.print(f"purged {memory_id}")
        return 0

    run_command(main())


@memory_app.command("reindex")
def reindex() -> None:
    """Rebuild the full-text index from the memory rows and embed what has no vector."""
    settings = _settings()

    async def main() -> int:
        async with _memory(settings) as memory:
            with ProgressBar("indexing") as bar:
                rows = await memory.store.reindex_text(progress=bar)
            await _finish_embedding(memory)
        out.print(f"text index rebuilt: {rows} memories; vectors complete")
        return 0

    run_command(main())


@memory_app.command("import")
def import_memories(
    file: Annotated[Path, typer.Argument(help="JSON Lines: {\"content\", \"subject\"?, \"key\"?, \"created_at\"?, "
                                             "\"source\"?} per line; - for standard input.")],
    identity: IdentityOption = LOCAL_IDENTITY,
) -> None:
    """Import memories from JSON Lines; a bad line is reported by its number and skipped."""
    settings = _settings()

    async def main() -> int:
        added = known = bad = 0
        lines = None if str(file) == "-" else _count_lines(file)
        async with _memory(settings) as memory:
            with ProgressBar("importing") as bar:
                for batch, problems in _batches(file, identity):
                    for number, problem in problems:
                        err.print(f"line {number}: {problem}; skipped", markup=False)
                    bad += len(problems)
                    if batch:
                        outcomes = await memory.remember_many(batch)
                        added += sum(o.created for o in outcomes)
                        known += sum(not o.created for o in outcomes)
                        if not bar.shown:  # the bar says it on a terminal
                            err.print(f"imported {added + known} so far", markup=False)
                    bar(added + known + bad, lines)
            await _finish_embedding(memory)
        out.print(f"imported {added} new, {known} already known, {bad} bad line(s) skipped")
        return 1 if bad and not added and not known else 0

    run_command(main())


def _batches(file: Path, identity: str) -> Iterator[tuple[list[NewMemory], list[tuple[int, str]]]]:
    stream = sys.stdin if str(file) == "-" else _open(file)
    batch: list[NewMemory] = []
    problems: list[tuple[int, str]] = []
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            batch.append(_parse_line(line, identity))
        except MemoryInputError as exc:
            problems.append((number, str(exc)))
        if len(batch) >= IMPORT_BATCH:
            yield batch, problems
            batch, problems = [], []
    yield batch, problems


def _count_lines(file: Path) -> int | None:
    """The non-blank lines of an import file: the bar's total (None when it cannot be read)."""
    try:
        with file.open("rb") as stream:
            return sum(1 for line in stream if line.strip())
    except OSError:
        return None  # _open says why


def _open(file: Path) -> Any:
    try:
        return file.open(encoding="utf-8")
    except OSError as exc:
        raise MemoryInputError(f"cannot read {file}: {exc.strerror}") from exc


def _parse_line(line: str, identity: str) -> NewMemory:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MemoryInputError(f"not JSON ({exc.msg})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("content"), str):
        raise MemoryInputError('each line must be an object with a "content" string')
    for field in ("subject", "key", "source"):
        if data.get(field) is not None and not isinstance(data[field], str):
            raise MemoryInputError(f'"{field}" must be a string')
    return NewMemory(identity=identity, content=check_content(data["content"]), subject=data.get("subject"),
                     key=data.get("key"), source=data.get("source") or "import",
                     source_rank=SourceRank.USER_STATED, created_at=parse_time(data.get("created_at")))


def parse_time(value: object) -> float | None:
    """ISO 8601 (a date alone is midnight UTC; no zone means UTC) or epoch seconds."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise MemoryInputError('"created_at" must be ISO 8601 or epoch seconds')
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError as exc:
            raise MemoryInputError(f'"created_at" {value!r} is not ISO 8601') from exc
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)).timestamp()
    raise MemoryInputError('"created_at" must be ISO 8601 or epoch seconds')


@memory_app.command("export")
def export(
    identity: IdentityOption = LOCAL_IDENTITY,
    include_all: AllOption = False,
    kind: Annotated[MemoryKind | None, typer.Option(help="Only this tier (default: facts and episodes).")] = None,
) -> None:
    """Write memories as JSON Lines (the import format) to standard output."""
    settings = _settings()

    async def main() -> int:
        kinds = (kind,) if kind else (MemoryKind.FACT, MemoryKind.EPISODIC)
        async with _memory(settings, search=False) as memory:
            records = await memory.store.list(
                identity, kinds=kinds, include_inactive=include_all, limit=10_000_000)
        for r in reversed(records):
            line: dict[str, object] = {"content": r.content, "created_at": dt.datetime.fromtimestamp(
                r.created_at, dt.UTC).isoformat()}
            line.update({name: value for name, value in (("subject", r.subject), ("key", r.key),
                                                          ("source", r.source)) if value is not None})
            if r.status is not MemoryStatus.ACTIVE:
                line["status"] = r.status.value
            print(json.dumps(line, ensure_ascii=False))
        return 0

    run_command(main())
