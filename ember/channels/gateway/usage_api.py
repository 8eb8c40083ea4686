"""What the caller's model calls took and cost over HTTP, by day and by session, for the page.

The caller's usage is its identity's (the one its memory is kept under): every
channel's turns and the background work charged to its sessions (titles,
consolidation, reviews). Another identity's usage is never read. Costs are in
USD, of the calls whose model has a price in `[models]`; the calls without one
are counted apart, never guessed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.gateway.http import known_params, query_int
from ember.channels.gateway.turns import CHANNEL, namespace
from ember.core.usage import UsageCell
from ember.memory.identity import Identities
from ember.store.protocols import SessionBrowser, UsageReport

DEFAULT_DAYS = 30
MAX_DAYS = 366
MAX_OFFSET_MIN = 16 * 60  # the widest UTC offsets are -12:00 and +14:00
_PARAMS = ("days", "tz_offset")
_SUMMED = ("calls", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "cost_usd",
           "unpriced_calls")


class UsageApi:
    def __init__(self, usage: UsageReport, sessions: SessionBrowser, identities: Identities) -> None:
        self._usage = usage
        self._sessions = sessions
        self._identities = identities

    def routes(self) -> list[Route]:
        return [Route("/api/usage", self.usage, methods=["GET"])]

    async def usage(self, request: Request) -> Response:
        """`?days=N` (1–366, default 30) ending today; `?tz_offset=M`: the caller's clock is M minutes
        behind UTC (JavaScript's getTimezoneOffset; default 0), which says where its days begin."""
        params = known_params(request, _PARAMS)
        days = query_int(params, "days", DEFAULT_DAYS, 1, MAX_DAYS)
        shift_s = -60 * query_int(params, "tz_offset", 0, -MAX_OFFSET_MIN, MAX_OFFSET_MIN)
        today = int((time.time() + shift_s) // 86400)
        since = (today - days + 1) * 86400 - shift_s
        identity = self._identities.resolve(CHANNEL, request.state.identity)
        cells = await self._usage.by_day_and_session(identity, since, shift_s)
        prefix = namespace(request.state.identity)
        titles = {summary.key: summary.title for summary in await self._sessions.list_sessions(prefix)}
        by_day: dict[int, list[UsageCell]] = {}
        by_session: dict[str | None, list[UsageCell]] = {}
        for cell in cells:
            by_day.setdefault(cell.day, []).append(cell)
            by_session.setdefault(cell.session_key, []).append(cell)
        sessions = [{"session": None if key is None else key.removeprefix(prefix),
                     "title": titles.get(key) if key is not None else None, **_summed(group)}
                    for key, group in by_session.items()]
        sessions.sort(key=lambda s: (-s["cost_usd"], -(s["input_tokens"] + s["output_tokens"]), s["session"] or ""))
        return JSONResponse({
            "days": days, "since": since, "currency": "USD", "total": _summed(cells),
            "by_day": [{"day": _date(day), **_summed(by_day[day])} for day in sorted(by_day, reverse=True)],
            "by_session": sessions,
        })


def _summed(cells: Iterable[UsageCell]) -> dict[str, Any]:
    total = dict.fromkeys(_SUMMED, 0)
    for cell in cells:
        for name in _SUMMED:
            total[name] += getattr(cell, name)
    total["cost_usd"] = round(total["cost_usd"], 6)
    return total


def _date(day: int) -> str:
    return datetime.fromtimestamp(day * 86400, UTC).date().isoformat()
