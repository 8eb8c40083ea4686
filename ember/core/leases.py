"""The session lease: one writer of a session's history at a time."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol


class SessionLeases(Protocol):
    def hold(self, session_key: str) -> AbstractAsyncContextManager[None]:
        """Held while a turn runs, and while consolidation reloads or commits."""
        ...
