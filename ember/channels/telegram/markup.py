"""Markdown as Telegram renders it: its small HTML subset, escaped everywhere else.

Only complete constructs are converted; anything unclosed (a draft cut mid-way)
stays as escaped text, so a draft never sends HTML Telegram would refuse.
"""

from __future__ import annotations

import html
import re

_FENCE = re.compile(r"```([\w+-]*)\n?(.*?)```", re.DOTALL)
_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^\s)]+)\)")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*|__(?=\S)(.+?)(?<=\S)__")
_ITALIC = re.compile(r"(?<![*\w])\*(?=\S)([^*\n]+?)(?<=\S)\*(?![*\w])|(?<![_\w])_(?=\S)([^_\n]+?)(?<=\S)_(?![_\w])")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_HEADING = re.compile(r"^#{1,6}\s+(.+)$", re.MULTILINE)


def _inline(text: str) -> str:
    text = html.escape(text, quote=False)
    # The URL is escaped already, with the rest; a quote must not end the attribute.
    text = _LINK.sub(lambda m: f'<a href="{m[2].replace(chr(34), "&quot;")}">{m[1]}</a>', text)
    text = _HEADING.sub(r"<b>\1</b>", text)
    text = _BOLD.sub(lambda m: f"<b>{m[1] or m[2]}</b>", text)
    text = _ITALIC.sub(lambda m: f"<i>{m[1] or m[2]}</i>", text)
    return _STRIKE.sub(r"<s>\1</s>", text)


def _spans(text: str) -> str:
    out, at = [], 0
    for match in _CODE.finditer(text):
        out += [_inline(text[at:match.start()]), f"<code>{html.escape(match[1], quote=False)}</code>"]
        at = match.end()
    return "".join([*out, _inline(text[at:])])


def telegram_html(markdown: str) -> str:
    out, at = [], 0
    for match in _FENCE.finditer(markdown):
        language = f' class="language-{match[1]}"' if match[1] else ""
        out += [_spans(markdown[at:match.start()]),
                f"<pre><code{language}>{html.escape(match[2].rstrip(), quote=False)}</code></pre>"]
        at = match.end()
    return "".join([*out, _spans(markdown[at:])])
