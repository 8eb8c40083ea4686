"""Session windows kept between turns, so a load need not re-read and re-parse them.

Without it every turn reads and parses each message since the consolidation
boundary, a cost that grows with the session. A kept window is used only
when both still hold:

- the session's head row, read afresh by every load, is the one the window
  was taken with. Every write Ember makes to a session's messages moves its
  head (an append bumps next_seq by compare-and-set, consolidation moves
  last_consolidated, a repair moves next_seq, and each sets updated_at), so
  an unmoved head means unchanged rows, whichever Ember process wrote last;
- no admin transaction went through `AdminDatabase.write()` since: its statements are
  arbitrary (a test or a tool editing rows), so every window is assumed
  changed (`Database.write_epoch`).

An append extends the window only if the head it replaced, read inside its
own transaction, is the window's; any other outcome, a failed
compare-and-set included, drops it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ember.core.messages import Message
from ember.store.session_rows import Head

# Windows of the most recently used sessions; a busy server keeps only its active ones.
CAPACITY = 512


@dataclass(frozen=True, slots=True)
class Window:
    """The first `length` of `rows`. An append hands `rows` on to the next window,
    extended in place: copying it each time would make a commit's cost grow with
    the window. Nothing else writes to it; readers take a copy (`messages()`)."""

    head: Head
    rows: list[Message]
    length: int
    epoch: int

    @classmethod
    def of(cls, head: Head, messages: Sequence[Message], epoch: int) -> Window:
        return cls(head, list(messages), len(messages), epoch)

    def messages(self) -> list[Message]:
        return self.rows[:self.length]


class WindowCache:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._windows: OrderedDict[str, Window] = OrderedDict()

    def get(self, key: str, epoch: int) -> Window | None:
        """The kept window, unless a `write()` transaction ran since it was taken."""
        window = self._windows.get(key)
        if window is None or window.epoch != epoch:
            return None
        self._windows.move_to_end(key)
        return window

    def put(self, key: str, window: Window) -> None:
        self._windows[key] = window
        self._windows.move_to_end(key)
        while len(self._windows) > self._capacity:
            self._windows.popitem(last=False)

    def drop(self, key: str) -> None:
        self._windows.pop(key, None)

    def appended(self, key: str, replaced: Head | None, head: Head, messages: Sequence[Message],
                 epoch: int) -> None:
        """An append committed `messages`, moving the head from `replaced` to `head`."""
        if replaced is None:  # the append created the session: its window is exactly these messages
            self.put(key, Window.of(head, messages, epoch))
            return
        window = self.get(key, epoch)
        if window is None or window.head != replaced:
            self.drop(key)
            return
        rows = window.rows if len(window.rows) == window.length else window.messages()
        rows.extend(messages)
        self.put(key, Window(head, rows, len(rows), epoch))
