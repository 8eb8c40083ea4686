"""`ember store`: the store itself. `copy --to URL` moves this home's SQLite store into an empty
PostgreSQL database, checked table by table; the target is named user@host:port/database only,
so its password (in the URL) is never printed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ember.cli.common import ProgressBar, err, out, print_json, settings_or_exit, setup_logging
from ember.core.errors import EmberError

if TYPE_CHECKING:
    from ember.store.copy import CopyReport, TableCheck

store_app = typer.Typer(help="The store: copy this home's SQLite store into PostgreSQL.", no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]


@store_app.command("copy")
def copy(
    to: Annotated[str, typer.Option("--to", show_default=False, help=(
        "The PostgreSQL database to copy into, new or empty: postgresql://user@host:5432/database "
        "(a password may come from PGPASSWORD or ~/.pgpass instead of the URL)."))],
    as_json: JsonOption = False,
) -> None:
    """Copy this home's SQLite store into an empty PostgreSQL database, and check the copy.

    Each table's rows and checksum are compared on both sides before the copy is kept. Stop Ember
    first. Exit 1 when the target already holds Ember's rows or the copy differs (nothing is kept).
    """
    from sqlalchemy import make_url

    from ember.store.copy import CopyError, CopyMismatch, target_name
    settings = settings_or_exit()
    setup_logging(settings, verbose=False)
    try:
        name = target_name(to)
    except CopyError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    source = settings.database_path
    if not source.is_file():
        err.print(f"[red]error:[/red] there is no SQLite store at {escape(str(source))}: nothing to copy")
        raise typer.Exit(1)
    password = make_url(to).password

    async def main() -> None:
        try:
            report = await _copy(source, to, settings.sqlite_synchronous)
        except CopyMismatch as exc:
            _show(exc.checks, source, name, None, as_json)
            raise
        _show(report.tables, source, name, report, as_json)

    import asyncio  # here: `ember --help` needs no event loop

    try:
        asyncio.run(main())
    except EmberError as exc:
        message = str(exc).replace(password, "***") if password else str(exc)
        err.print(f"[red]error:[/red] cannot copy to {escape(name)}: {escape(message)}")
        raise typer.Exit(1) from None


async def _copy(path: Path, url: str, synchronous: str) -> CopyReport:
    """Both stores opened (each migrated to this Ember's schema), then the copy, with a bar for each."""
    from ember.app.database import sqlite_database
    from ember.store.copy import copy_store
    from ember.store.postgres import PostgresDatabase

    source = sqlite_database(path, synchronous=synchronous)
    with ProgressBar("upgrading the store") as bar:
        await source.open(bar)
    try:
        target = PostgresDatabase(url)
        with ProgressBar("preparing the target") as bar:
            await target.open(bar)
        try:
            with ProgressBar("copying and checking") as bar:
                return await copy_store(source, target, progress=bar)
        finally:
            await target.close()
    finally:
        await source.close()


def _show(checks: list[TableCheck], source: Path, name: str, report: CopyReport | None, as_json: bool) -> None:
    """Every table's rows and whether its checksum matched; `report` None: the copy was not kept."""
    if as_json:
        print_json({"source": str(source), "target": name, "kept": report is not None,
                    "schema_version": report.schema_version if report else None,
                    "rows": report.rows if report else None,
                    "ok": all(check.ok for check in checks), "tables": [check.to_json_dict() for check in checks]})
        return
    table = Table("table", "rows", "checksum")
    for check in checks:
        rows = str(check.rows) if check.rows == check.target_rows else f"{check.rows} (target: {check.target_rows})"
        verdict = "ok" if check.ok else "[red]differs[/red]"
        table.add_row(check.table, rows, verdict)
    out.print(table)
    if report is not None:
        out.print(f"copied {report.rows} rows of {len(checks)} tables from "
                  f"{escape(str(source))} to {escape(name)} (schema v{report.schema_version}); every checksum "
                  "matches")
