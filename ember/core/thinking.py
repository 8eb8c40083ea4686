"""Keeps model reasoning out of everything Ember stores or shows (invariant I4).

`ThinkFilter` is a streaming state machine: feed it deltas in any split and it
emits only the visible text, holding back just enough characters to recognise a
tag cut across deltas (`"<thi"` + `"nk>"`). `strip_thinking` runs the same
machine over a whole text, so a streamed answer and its stored copy agree.
"""

from __future__ import annotations

import re

_TAG_NAMES = ("think", "thinking", "thought")
_OPEN_TAGS = tuple(f"<{name}>" for name in _TAG_NAMES)
_CLOSE_TAGS = tuple(f"</{name}>" for name in _TAG_NAMES)
_ANY_TAG = re.compile(r"</?(?:think|thinking|thought)>", re.IGNORECASE)
_CLOSE_TAG = re.compile(r"</(?:think|thinking|thought)>", re.IGNORECASE)


def _could_become_tag(tail: str, tags: tuple[str, ...]) -> bool:
    lowered = tail.lower()
    return any(tag.startswith(lowered) for tag in tags)


def _held_suffix_start(text: str, tags: tuple[str, ...]) -> int:
    """Index of the last '<' whose suffix may still grow into one of `tags`."""
    start = text.rfind("<")
    if start != -1 and _could_become_tag(text[start:], tags):
        return start
    return len(text)


class ThinkFilter:
    """Visible text out of a stream that may contain think blocks.

    Leading whitespace of the visible output is dropped, since models commonly
    put a blank line after a closing tag.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._hidden = False
        self._started = False

    def feed(self, chunk: str) -> str:
        self._pending += chunk
        out: list[str] = []
        while self._pending:
            if self._hidden:
                match = _CLOSE_TAG.search(self._pending)
                if match is None:
                    # Discard reasoning, keeping only a possible partial closing tag.
                    keep = _held_suffix_start(self._pending, _CLOSE_TAGS)
                    self._pending = self._pending[keep:]
                    break
                self._pending = self._pending[match.end() :]
                self._hidden = False
                continue
            match = _ANY_TAG.search(self._pending)
            if match is None:
                hold = _held_suffix_start(self._pending, _OPEN_TAGS + _CLOSE_TAGS)
                out.append(self._pending[:hold])
                self._pending = self._pending[hold:]
                break
            out.append(self._pending[: match.start()])
            # A lone closing tag is dropped; an opening tag starts a hidden block.
            self._hidden = not match.group(0).startswith("</")
            self._pending = self._pending[match.end() :]
        return self._visible("".join(out))

    def flush(self) -> str:
        """End of stream: a held partial tag was text after all; an unclosed
        block runs to the end and stays hidden."""
        rest = "" if self._hidden else self._pending
        self._pending = ""
        return self._visible(rest)

    def _visible(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text


def strip_thinking(text: str) -> str:
    machine = ThinkFilter()
    return machine.feed(text) + machine.flush()
