"""What every `ember` subcommand shares: its consoles, settings and the way it runs."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape

from ember.core.errors import EmberError

if TYPE_CHECKING:  # the runtime's modules load when a command runs, not when `ember --help` does
    from rich.progress import Progress, TaskID

    from ember.app.database import Stores
    from ember.config.settings import Settings
    from ember.store.sqlite.glance import Glance

# soft_wrap: never break a line a user may copy (the configure hint) at the terminal width.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def print_json(value: object) -> None:
    """What every `--json` prints: one JSON document on standard output, no markup, no colour."""
    print(json.dumps(value, ensure_ascii=False, indent=2, default=str), flush=True)


class ProgressBar:
    """A long command's progress, on standard error; `bar(done, total)` reports it
    (total None: not known yet). A report may come from another thread (the store's).

    Drawn only when standard error is an interactive terminal, and only from the
    first report on: a command with nothing to report (a store without pending
    migrations) shows nothing. It is erased when done reaches total, or on
    leaving the `with` block. Pipes, scripts and `--json` output never see it.
    """

    def __init__(self, description: str) -> None:
        self._description = description
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    @property
    def shown(self) -> bool:
        return err.is_interactive

    def __call__(self, done: int, total: int | None) -> None:
        if not self.shown:
            return
        if self._progress is None:
            from rich.progress import Progress

            # No redirection: standard output written meanwhile stays on standard output.
            self._progress = Progress(console=err, transient=True, redirect_stdout=False, redirect_stderr=False)
            self._task = self._progress.add_task(self._description, total=total)
            self._progress.start()
        assert self._task is not None
        self._progress.update(self._task, completed=done, total=total)
        if total is not None and done >= total:
            self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


@asynccontextmanager
async def open_store(settings: Settings) -> AsyncIterator[Stores]:
    """The store, migrated, with a bar over the migrations when some are pending
    (a new home, an upgrade); gone before the command prints anything."""
    from ember.app.database import Stores, open_database

    with ProgressBar("upgrading the store") as bar:
        async with open_database(settings, progress=bar) as db:
            bar.close()
            yield Stores(db)


@contextmanager
def glance_at(home: Path | None) -> Iterator[Glance | None]:
    """A read-only glance at the home's SQLite store (store/sqlite/glance.py: no SQLAlchemy, no settings
    to validate) when config/locate.py found the home plain and the store's schema is current; else None."""
    from ember.config.paths import DATABASE_FILE
    from ember.store.sqlite.glance import glance

    with glance(home / DATABASE_FILE if home is not None else None) as quick:
        yield quick


@asynccontextmanager
async def open_listings() -> AsyncIterator[Stores | Glance]:
    """The store, for a command that only lists what it holds: glanced at when it can be, else opened
    whole (settings checked, store created or migrated)."""
    from ember.config.locate import plain_home

    with glance_at(plain_home()) as quick:
        if quick is not None:
            yield quick
            return
    settings = settings_or_exit()
    setup_logging(settings, verbose=False)
    async with open_store(settings) as stores:
        yield stores


def settings_or_exit() -> Settings:
    from ember.config.settings import load_settings

    try:
        return load_settings()
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc


def run_command(work: Coroutine[Any, Any, int]) -> None:
    """Run a command's async body; an EmberError is one clear line, not a traceback."""
    import asyncio  # here: `ember --help` needs no event loop

    try:
        code = asyncio.run(work)
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


def setup_logging(settings: Settings, verbose: bool) -> None:
    from ember.core.redact import redact_handlers

    settings.home_dir.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(settings.home_dir / "ember.log")]
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    # Every line is redacted where it is written: a handler sees the records of every logger,
    # uvicorn's and the libraries' included (they propagate to the root's handlers).
    redact_handlers(handlers)
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # httpx logs every request's full URL at INFO, and a URL can hold a token (a chat webhook's);
    # httpx2 is the copy the openai SDK ships, which would log a line for every model call.
    for chatty in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


