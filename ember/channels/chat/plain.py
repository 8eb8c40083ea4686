"""Markdown as plain text, for platforms that show a message's characters as they are."""

from __future__ import annotations

import re

_FENCE = re.compile(r"```[\w+-]*\n?(.*?)```", re.DOTALL)
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^\s)]+)\)")
_EMPHASIS = re.compile(r"(\*\*|__|~~)(?=\S)(.+?)(?<=\S)\1")
_CODE = re.compile(r"`([^`\n]+)`")
_HEADING = re.compile(r"^#{1,6}\s+", re.MULTILINE)


def plain_text(markdown: str) -> str:
    """The text a reader of the rendered Markdown would see: markers gone, a link's address kept
    beside its text (a plain-text reader cannot follow it otherwise)."""
    text = _FENCE.sub(lambda m: m[1].rstrip("\n"), markdown)
    text = _LINK.sub(lambda m: m[1] if m[1] == m[2] else f"{m[1]} ({m[2]})", text)
    text = _EMPHASIS.sub(r"\2", text)
    text = _CODE.sub(r"\1", text)
    return _HEADING.sub("", text)
