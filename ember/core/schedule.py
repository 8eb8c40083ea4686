"""When a scheduled task runs: a cron expression in a time zone, an interval, or one moment.

Times are Unix seconds (UTC); a cron expression is read in the task's own time
zone, so "0 9 * * *" in Europe/Berlin stays at 9:00 there across a DST change.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

MIN_INTERVAL_S = 1.0
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)", re.IGNORECASE)
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class ScheduleError(ValueError):
    """A schedule that cannot be read; the message says how to write it."""


class ScheduleKind(enum.StrEnum):
    CRON = "cron"
    EVERY = "every"
    AT = "at"


def parse_duration(text: str) -> float:
    """`1s`, `90s`, `5m`, `1h30m`, `2d`, `1w` as seconds."""
    compact = text.strip().replace(" ", "")
    parts = list(_DURATION.finditer(compact))
    if not parts or "".join(p.group(0) for p in parts) != compact:
        raise ScheduleError(f"{text!r} is not a duration: write e.g. 30s, 5m, 1h30m, 2d")
    return sum(float(p.group(1)) * _UNIT_S[p.group(2).lower()] for p in parts)


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"{name!r} is not a time zone: use an IANA name such as Europe/Berlin or UTC") from None


def parse_moment(text: str, tz: ZoneInfo, now: float) -> float:
    """An ISO 8601 time (in `tz` when it names no offset), or `+DURATION` / `in DURATION` from now."""
    stripped = text.strip()
    relative = stripped.removeprefix("+") if stripped.startswith("+") else (
        stripped[3:] if stripped.lower().startswith("in ") else None)
    if relative is not None:
        return now + parse_duration(relative)
    try:
        moment = datetime.fromisoformat(stripped)
    except ValueError:
        raise ScheduleError(f"{text!r} is not a time: write e.g. 2026-12-24T09:00, or +10m") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=tz)
    return moment.timestamp()


@dataclass(frozen=True, slots=True)
class Schedule:
    """`spec`: the cron expression, the interval in seconds, or the moment (Unix seconds);
    `anchor`: when an interval counts from."""

    kind: ScheduleKind
    spec: str
    tz: str = "UTC"
    anchor: float = 0.0

    @classmethod
    def cron(cls, expression: str, tz: str = "UTC") -> Schedule:
        zone(tz)
        expression = " ".join(expression.split())
        from croniter import CroniterBadCronError, croniter  # on use: `ember --help` loads this module

        try:
            croniter(expression)
        except (CroniterBadCronError, ValueError, KeyError) as exc:
            raise ScheduleError(f"{expression!r} is not a cron expression ({exc}); "
                                "write five fields: minute hour day-of-month month day-of-week, "
                                "e.g. '0 9 * * 1-5' for weekdays at 9") from None
        return cls(ScheduleKind.CRON, expression, tz)

    @classmethod
    def every(cls, duration: str, now: float, tz: str = "UTC") -> Schedule:
        zone(tz)
        seconds = parse_duration(duration)
        if seconds < MIN_INTERVAL_S:
            raise ScheduleError(f"an interval is at least {MIN_INTERVAL_S:g} s; {duration!r} is shorter")
        return cls(ScheduleKind.EVERY, f"{seconds:g}", tz, anchor=now)

    @classmethod
    def at(cls, moment: str, now: float, tz: str = "UTC") -> Schedule:
        return cls(ScheduleKind.AT, f"{parse_moment(moment, zone(tz), now):.3f}", tz)

    def next_after(self, t: float) -> float | None:
        """The first run strictly after `t`; None when there is none (a moment that has passed)."""
        if self.kind is ScheduleKind.AT:
            moment = float(self.spec)
            return moment if moment > t else None
        if self.kind is ScheduleKind.EVERY:
            interval = float(self.spec)
            steps = max(math.floor((t - self.anchor) / interval), 0) + 1
            # The division rounds: step on until the run is strictly after t, so no time repeats.
            while self.anchor + steps * interval <= t:
                steps += 1
            return self.anchor + steps * interval
        from croniter import croniter

        start = datetime.fromtimestamp(t, UTC).astimezone(zone(self.tz))
        following: datetime = croniter(self.spec, start).get_next(datetime)
        return following.timestamp()

    def first_run(self, now: float) -> float | None:
        """A new (or newly edited) task's first run: an interval counts from its anchor, the others from now."""
        return self.next_after(self.anchor if self.kind is ScheduleKind.EVERY else now)

    def upcoming(self, after: float, count: int = 3) -> list[float]:
        times: list[float] = []
        t: float | None = after
        while len(times) < count and (t := self.next_after(t)) is not None:
            times.append(t)
        return times

    def describe(self) -> str:
        if self.kind is ScheduleKind.CRON:
            return f"cron '{self.spec}' ({self.tz})"
        if self.kind is ScheduleKind.EVERY:
            return f"every {self.spec} s"
        return f"once at {local_time(float(self.spec), self.tz)}"


def local_time(t: float, tz: str) -> str:
    """`t` as the task's person reads it: 2026-12-07 09:00 CET."""
    return datetime.fromtimestamp(t, UTC).astimezone(zone(tz)).strftime("%Y-%m-%d %H:%M:%S %Z")
