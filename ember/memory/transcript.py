"""Render messages as plain text for a model that reads them as a document."""

from __future__ import annotations

from collections.abc import Iterable

from ember.core.messages import Message, Role


def render_transcript(messages: Iterable[Message], *, max_chars_per_message: int = 2_000) -> str:
    lines = []
    for message in messages:
        content = message.content[:max_chars_per_message]
        if message.role is Role.TOOL:
            lines.append(f"[tool result] {content}")
        elif message.has_tool_calls:
            calls = ", ".join(f"{c.name}({c.arguments})" for c in message.tool_calls)
            lines.append(f"assistant: {content} [called {calls}]".replace(":  [", ": ["))
        else:
            lines.append(f"{message.role.value}: {content}")
    return "\n".join(lines)
