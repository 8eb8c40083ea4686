"""Server-Sent Events as the tests read them: Ember's native stream (named events, JSON data) and
the OpenAI-compatible one (unnamed chunks, ending in [DONE]). The one reader the tests share."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


@dataclass(frozen=True, slots=True)
class Event:
    name: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


def events(lines: Iterable[str]) -> Iterator[Event]:
    """The events of a stream's lines, each as soon as the blank line that ends it is read."""
    name: str | None = None
    data: list[str] = []
    for line in _ended(lines):
        if not line:
            if data:
                yield Event(name, "\n".join(data))
            name, data = None, []
        elif line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))


def _ended(lines: Iterable[str]) -> Iterator[str]:
    yield from lines
    yield ""  # a stream cut after its last data line still gives that event


def sse_events(text: str) -> list[Event]:
    return list(events(text.splitlines()))


def chunks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI-compatible stream, [DONE] aside."""
    for event in events(lines):
        if event.data != DONE:
            yield event.json()
