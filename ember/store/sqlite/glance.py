"""A read-only look at a SQLite store for the CLI's list commands, on the standard library alone.

Importing SQLAlchemy and validating the settings take about half a second: more than a list command
may take in all (0.3 s). So when the configuration plainly names the SQLite file (config/locate.py)
and its schema is this Ember's, `ember sessions list`, `trace list`, `cron list` and `usage` read it
here: the stores' own SQL (tests/test_glance.py holds each text to its statement's compiled form),
decoded by the stores' own functions (store/records.py). Anything else (PostgreSQL, a store to
create or migrate, an unreadable file) goes to the whole store, which also explains a bad configuration.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ember.core.memory import MemoryKind, MemoryRecord
from ember.core.skills import Skill
from ember.core.tasks import Task
from ember.core.traces import TurnTrace
from ember.store.records import (
    SessionSummary,
    record_of,
    scheduled_task,
    session_summary,
    skill_of,
    turn_trace,
    usage_totals,
    visible_to,
)

SCHEMA_VERSION = 23  # migrations.SCHEMA_VERSION, which imports SQLAlchemy; a test keeps them equal

SESSIONS = (
    'SELECT sessions."key", sessions.next_seq, sessions.last_consolidated, sessions.updated_at, '
    "coalesce(session_labels.title, (SELECT substr(messages.content, 1, 80) AS substr_1 \nFROM messages \n"
    "WHERE messages.session_key = sessions.\"key\" AND messages.role = 'user' ORDER BY messages.seq\n"
    " LIMIT 1 OFFSET 0)) AS coalesce_1, session_labels.archived_at \n"
    'FROM sessions LEFT OUTER JOIN session_labels ON session_labels.session_key = sessions."key" \n'
    'WHERE substr(sessions."key", 1, :prefix_chars) = :prefix ORDER BY sessions.updated_at DESC')
_TRACE_COLUMNS = ("SELECT traces.turn_id, traces.session_key, traces.status, traces.error, traces.detail, "
                  "traces.started_at, traces.finished_at \nFROM traces \n"
                  "WHERE substr(traces.session_key, 1, :prefix_chars) = :prefix")
_NEWEST_TURNS = " ORDER BY traces.started_at DESC\n LIMIT :limit OFFSET 0"
TRACES = _TRACE_COLUMNS + _NEWEST_TURNS
TRACES_OF_SESSION = _TRACE_COLUMNS + " AND traces.session_key = :session_key" + _NEWEST_TURNS
TASKS = ("SELECT tasks.id, tasks.identity, tasks.prompt, tasks.kind, tasks.spec, tasks.tz, tasks.anchor, "
         "tasks.reply_channel, tasks.reply_chat_id, tasks.missed, tasks.grant_approvals, tasks.state, "
         "tasks.next_run_at, tasks.runs, tasks.created_at \nFROM tasks \n"
         "WHERE tasks.state != 'removed' AND (:identity IS NULL OR tasks.identity = :identity) "
         "ORDER BY tasks.created_at")
_USAGE_KEYS = {"session": "COALESCE(session_key, '-')", "identity": "COALESCE(identity, '-')",
               "job": "COALESCE(job_kind, 'turn')", "model": "model", "agent": "COALESCE(agent, '-')"}
USAGE = {by: f"SELECT {key} AS k, COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cache_read_tokens), "
             "SUM(cache_write_tokens), COALESCE(SUM(cost_usd), 0), SUM(CASE WHEN cost_usd IS NULL THEN 1 ELSE 0 END) "
             "FROM model_usage WHERE at >= :since GROUP BY k ORDER BY 7 DESC, 3 + 4 DESC, k"
         for by, key in _USAGE_KEYS.items()}
_MEMORIES = ("SELECT memory_items.num, memory_items.id, memory_items.identity, memory_items.kind, "
             "memory_items.status, memory_items.content, memory_items.subject, memory_items.fact_key, "
             "memory_items.source, memory_items.source_rank, memory_items.session_key, memory_items.seq_start, "
             "memory_items.seq_end, memory_items.created_at, memory_items.valid_from, memory_items.invalid_at, "
             "memory_items.superseded_by, memory_items.recall_count, memory_items.last_recalled_at, "
             "memory_items.strength \nFROM memory_items \nWHERE memory_items.identity = :identity")
_ACTIVE = " AND memory_items.status = 'active'"
_OF_KINDS = " AND memory_items.kind IN (SELECT value \nFROM json_each(:kinds))"
_NEWEST_MEMORIES = " ORDER BY memory_items.created_at DESC, memory_items.num DESC\n LIMIT :limit OFFSET 0"
# By (include_inactive, kinds given), as the memory store's listings.
MEMORIES = {(inactive, of_kinds): _MEMORIES + ("" if inactive else _ACTIVE) + (_OF_KINDS if of_kinds else "")
            + _NEWEST_MEMORIES for inactive in (False, True) for of_kinds in (False, True)}
SKILLS = ("SELECT skills.name, skills.description, skills.identity, skills.version, skills.status, skills.origin, "
          "skills.use_count, skills.last_used_at, skills.updated_at \nFROM skills \n"
          "WHERE (:identity IS NULL OR skills.identity IN ('', :identity)) "
          "AND (:include_archived = 1 OR skills.status = 'active') ORDER BY skills.name, skills.identity")
SKILL_DIGESTS = "SELECT skills.name, skills.disk_digest, skills.origin \nFROM skills \nWHERE skills.identity = ''"


class _Reads:
    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    def _rows(self, sql: str, params: dict[str, Any]) -> list[Any]:
        return self._connection.execute(sql, params).fetchall()


class GlancedSessions(_Reads):
    async def list_sessions(self) -> list[SessionSummary]:
        return [session_summary(row) for row in self._rows(SESSIONS, {"prefix": "", "prefix_chars": 0})]


class GlancedTraces(_Reads):
    async def recent(self, limit: int, session_key: str | None = None) -> list[TurnTrace]:
        params: dict[str, Any] = {"limit": limit, "prefix": "", "prefix_chars": 0, "session_key": session_key}
        return [turn_trace(row) for row in self._rows(TRACES if session_key is None else TRACES_OF_SESSION, params)]


class GlancedTasks(_Reads):
    async def list(self) -> list[Task]:
        return [scheduled_task(row) for row in self._rows(TASKS, {"identity": None})]


class GlancedUsage(_Reads):
    async def totals(self, by: str, since: float = 0.0) -> list[dict[str, Any]]:
        return usage_totals(self._rows(USAGE[by], {"since": since}))


class GlancedMemories(_Reads):
    async def list(self, identity: str, *, kinds: Sequence[MemoryKind] = (), include_inactive: bool = False,
                   limit: int = 100) -> list[MemoryRecord]:
        params = {"identity": identity, "kinds": json.dumps([k.value for k in kinds]), "limit": limit}
        return [record_of(row)[1] for row in self._rows(MEMORIES[include_inactive, bool(kinds)], params)]


class GlancedSkills(_Reads):
    async def visible(self, identity: str | None, *, include_archived: bool = False) -> list[Skill]:
        rows = self._rows(SKILLS, {"identity": identity, "include_archived": include_archived})
        return visible_to(identity, [skill_of(row) for row in rows])

    async def disk_digests(self) -> dict[str, tuple[str | None, str]]:
        return {name: (digest, origin) for name, digest, origin in self._rows(SKILL_DIGESTS, {})}


class Glance:
    """The listings of one store, read in one read-only connection."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.sessions = GlancedSessions(connection)
        self.traces = GlancedTraces(connection)
        self.tasks = GlancedTasks(connection)
        self.usage = GlancedUsage(connection)
        self.memory = GlancedMemories(connection)
        self.skills = GlancedSkills(connection)


@contextlib.contextmanager
def glance(path: Path | None) -> Iterator[Glance | None]:
    """A Glance at the SQLite store at `path`; None when there is none to glance at (no path, no file, or
    a schema other than this Ember's)."""
    if path is None or not path.is_file():
        yield None
        return
    try:
        connection = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        yield None
        return
    with contextlib.closing(connection):
        try:
            version = connection.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
        except sqlite3.Error:
            version = None
        yield Glance(connection) if version == SCHEMA_VERSION else None
