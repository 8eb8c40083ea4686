"""Markdown as Slack's mrkdwn shows it: `&`, `<` and `>` escaped (Slack reads `<…>` as a link or a
mention), `**bold**` as `*bold*`, `~~struck~~` as `~struck~`, `[text](url)` as `<url|text>`,
headings as bold lines; code, fenced or inline, as it was written."""

from __future__ import annotations

import re

_FENCE = re.compile(r"(```.*?```)", re.DOTALL)
_INLINE_CODE = re.compile(r"(`[^`\n]+`)")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")
_STRUCK = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)


def slack_mrkdwn(markdown: str) -> str:
    return "".join(_escape(part) if part.startswith("```") else _prose(part) for part in _FENCE.split(markdown))


def _prose(text: str) -> str:
    return "".join(_escape(part) if part.startswith("`") else _styled(_escape(part))
                   for part in _INLINE_CODE.split(text))


def _styled(text: str) -> str:
    text = _HEADING.sub(lambda m: f"*{m.group(1)}*", text)
    text = _BOLD.sub(r"*\1*", text)
    text = _STRUCK.sub(r"~\1~", text)
    return _LINK.sub(lambda m: f"<{m.group(2)}|{m.group(1)}>", text)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
