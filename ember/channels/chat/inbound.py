"""What a chat platform does with what comes in: who may talk, what a stranger is told, which ids it saw."""

from __future__ import annotations

import logging
from collections.abc import Collection, Hashable, MutableMapping
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

REMEMBERED = 1_024  # ids of one run a platform may send again (a retry, a replay)


def refusal(platform_id: str, user_id: object) -> str:
    """What a stranger is told: the id they give the owner to be let in."""
    return (f"Sorry, I only talk with the people my owner allowed. If that should include you, "
            f"send them your {platform_id}: {user_id}.")


class AllowList(Generic[K]):
    """The people a platform's `allowed_users` names. An empty list lets everyone in, unless
    `empty_refuses` (Telegram's bots are public: there it lets nobody in). A stranger is told once
    a run, and nothing of theirs is stored."""

    def __init__(self, channel: str, allowed: Collection[K], *, empty_refuses: bool = False) -> None:
        self._channel = channel
        self._allowed = frozenset(allowed)
        self._empty_refuses = empty_refuses
        self._refused: set[K] = set()

    @property
    def everyone(self) -> bool:
        return not self._allowed and not self._empty_refuses

    def admits(self, sender: K) -> bool:
        return self.everyone or sender in self._allowed

    def first_refusal(self, sender: K) -> bool:
        """True the first time this run that `sender` is refused: tell them then, and only then."""
        if sender in self._refused:
            return False
        self._refused.add(sender)
        log.info("%s: refused user %s", self._channel, sender)
        return True


def remember(kept: MutableMapping[K, V], key: K, value: V, limit: int = REMEMBERED) -> None:
    """Keep `key` among the last `limit` kept; the oldest goes first."""
    kept[key] = value
    while len(kept) > limit:
        del kept[next(iter(kept))]
