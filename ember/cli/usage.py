"""`ember usage`: what the models cost, by session, identity, background job kind or model."""

from __future__ import annotations

import datetime as dt
import enum
import re
import time
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ember.cli.common import err, open_listings, out, print_json, run_command

_SPAN = re.compile(r"(\d+)\s*([hdw])")
_SPAN_S = {"h": 3600, "d": 86_400, "w": 7 * 86_400}


class By(enum.StrEnum):
    session = "session"
    identity = "identity"
    job = "job"
    model = "model"
    agent = "agent"


def since_timestamp(text: str | None, now: float | None = None) -> float:
    """--since: a span back from now (24h, 7d, 2w) or an ISO date or time (UTC unless it says)."""
    if not text:
        return 0.0
    now = time.time() if now is None else now
    if span := _SPAN.fullmatch(text.strip().lower()):
        return now - int(span.group(1)) * _SPAN_S[span.group(2)]
    try:
        moment = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: give a span (24h, 7d, 2w) or a date (2026-11-01)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)).timestamp()


def usage(
    since: Annotated[str | None, typer.Option("--since", help="Only calls since: 24h, 7d, 2w or a date.")] = None,
    by: Annotated[By, typer.Option("--by", help="Group by session, identity, job, model or agent.")] = By.session,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Tokens and cost of the model calls: turns and background jobs, charged to their session and identity."""

    try:
        start = since_timestamp(since)
    except ValueError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(2) from None

    async def main() -> int:
        async with open_listings() as stores:
            groups = await stores.usage.totals(by.value, start)
        if as_json:
            print_json(groups)
            return 0
        if not groups:
            out.print("No model calls recorded" + (f" since {since}." if since else "."), markup=False)
            return 0
        table = Table(by.value, "calls", "tokens in", "out", "cache read", "cache write", "cost (USD)")
        for group in groups:
            table.add_row(escape(str(group["key"])), *(f"{group[k]:,}" for k in (
                "calls", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")),
                _cost(group["cost_usd"], group["unpriced_calls"]))
        out.print(table)
        if any(group["unpriced_calls"] for group in groups):
            out.print("Calls to a model without a price in [models] count tokens only.", markup=False)
        return 0

    run_command(main())


def _cost(cost: float, unpriced: int) -> str:
    shown = f"{cost:.4f}" if cost else "0"
    return f"{shown} (+{unpriced} unpriced)" if unpriced else shown
