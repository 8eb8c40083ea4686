"""Splitting an answer too long for one platform message, where a reader would break it."""

from __future__ import annotations

import re

# A Latin sentence ends at its punctuation and the space after it; a Chinese or Japanese one at
# its punctuation, which no space follows.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？…；])")


def _cut(text: str, limit: int) -> int:
    """Where to end the first piece of `text`: a paragraph break, else a line break, else a
    sentence end, else a space, within `limit`; a hard cut only when there is none."""
    window = text[:limit + 1]
    for separator in ("\n\n", "\n"):
        at = window.rfind(separator, 0, limit)
        if at > limit // 3:
            return at + len(separator)
    ends = [m.end() for m in _SENTENCE_END.finditer(window) if m.end() <= limit]
    if ends and ends[-1] > limit // 3:
        return ends[-1]
    at = window.rfind(" ", 0, limit)
    return at + 1 if at > limit // 3 else limit


def split_message(text: str, limit: int) -> list[str]:
    """`text` in pieces of at most `limit` characters, joined back they are `text` (up to the
    whitespace at the cuts); an empty text is one empty piece."""
    pieces = []
    while len(text) > limit:
        cut = _cut(text, limit)
        pieces.append(text[:cut].rstrip())
        text = text[cut:].lstrip("\n")
    pieces.append(text)
    return [piece for piece in pieces if piece.strip()] or [""]
