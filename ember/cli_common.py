"""What every `ember` subcommand shares: its consoles, settings and the way it runs."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from ember.config import Settings, load_settings
from ember.core.errors import EmberError

# soft_wrap: never break a line a user may copy (the configure hint) at the terminal width.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc


def run_command(work: Coroutine[Any, Any, int]) -> None:
    """Run a command's async body; an EmberError is one clear line, not a traceback."""
    try:
        code = asyncio.run(work)
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


def setup_logging(settings: Settings, verbose: bool) -> None:
    settings.home_dir.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(settings.home_dir / "ember.log")]
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # httpx logs every request's full URL at INFO, and a URL can hold a token (a chat webhook's).
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


