"""One step of a schema migration: SQL text both engines run alike, a `ByDialect` where they need
different SQL, or a function for data that SQL alone cannot move."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection


@dataclass(frozen=True, slots=True)
class ByDialect:
    """A step each engine takes in SQL of its own: one statement or several, in order; () for none."""

    sqlite: str | tuple[str, ...]
    postgresql: str | tuple[str, ...]

    @classmethod
    def edited(cls, sqlite: str, old: str, new: str) -> ByDialect:
        """SQLite's statement, and PostgreSQL's: the same with `old` (which it must contain) made `new`."""
        if old not in sqlite:
            raise ValueError(f"{old!r} is not in the statement it should replace in")
        return cls(sqlite, sqlite.replace(old, new))

    def statements(self, dialect: str) -> tuple[str, ...]:
        sql = self.sqlite if dialect == "sqlite" else self.postgresql
        return (sql,) if isinstance(sql, str) else sql


Step = str | ByDialect | Callable[["AsyncConnection"], Awaitable[None]]
