"""Keeps model reasoning out of everything Ember stores or shows (invariant I4).

`ThinkFilter` is a streaming state machine: feed it deltas in any split and it
emits only the visible text, holding back just enough characters to recognise a
tag cut across deltas (`"<thi"` + `"nk>"`). `strip_thinking` runs the same
machine over a whole text, so a streamed answer and its stored copy agree.

Recognised: `<think>`, `<thinking>`, `<thought>` in any case, with attributes
or spaces before `>`, nested blocks, an unclosed block (hidden to the end) and
a lone closing tag (dropped).
"""

from __future__ import annotations

import re

_NAMES = ("think", "thinking", "thought")
_TAG = re.compile(r"<(/?)(?:think|thinking|thought)(?:\s[^<>]*)?>", re.IGNORECASE)
_NAME_PREFIX = re.compile(r"</?([a-zA-Z]*)")


def _may_become_tag(tail: str) -> bool:
    """Whether `tail`, starting with '<', could still grow into a tag."""
    head = _NAME_PREFIX.match(tail)
    if head is None:
        return False
    name, rest = head.group(1).lower(), tail[head.end() :]
    if not rest:
        return any(candidate.startswith(name) for candidate in _NAMES)
    # A complete name followed by attributes still waiting for their '>'.
    return name in _NAMES and rest[0].isspace() and "<" not in rest


class ThinkFilter:
    """Visible text out of a stream that may contain think blocks.

    Leading whitespace of the visible output is dropped, since models commonly
    put a blank line after a closing tag.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._depth = 0
        self._started = False

    def feed(self, chunk: str) -> str:
        self._pending += chunk
        out: list[str] = []
        while True:
            match = _TAG.search(self._pending)
            if match is None:
                held = self._held_from()
                if not self._depth:
                    out.append(self._pending[:held])
                self._pending = self._pending[held:]
                break
            if not self._depth:
                out.append(self._pending[: match.start()])
            closing = bool(match.group(1))
            self._depth = max(0, self._depth - 1) if closing else self._depth + 1
            self._pending = self._pending[match.end() :]
        return self._visible("".join(out))

    def flush(self) -> str:
        """End of stream: a held partial tag was text after all; an unclosed
        block runs to the end and stays hidden."""
        rest = "" if self._depth else self._pending
        self._pending = ""
        return self._visible(rest)

    def _held_from(self) -> int:
        start = self._pending.rfind("<")
        if start != -1 and _may_become_tag(self._pending[start:]):
            return start
        return len(self._pending)

    def _visible(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text


def strip_thinking(text: str) -> str:
    machine = ThinkFilter()
    return machine.feed(text) + machine.flush()
