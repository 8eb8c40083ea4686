"""Models that answer from code, for tests and the offline demo.

They implement the real ModelClient protocol and stream their text in small
pieces, so everything downstream runs exactly as with a remote model.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

from ember.core.errors import ModelError
from ember.core.messages import Message
from ember.core.sampling import Sampling
from ember.core.tools import ToolSpec
from ember.models.base import ModelEvent, ModelReply, ReasoningDelta, TextDelta

ReplyFunction = Callable[[list[Message], list[ToolSpec]], ModelReply | Awaitable[ModelReply]]


def _pieces(text: str, size: int) -> Iterable[str]:
    return (text[i : i + size] for i in range(0, len(text), size))


class FunctionModel:
    """Answers each request with `fn(messages, tools)`."""

    def __init__(self, fn: ReplyFunction, *, name: str = "function-model", chunk_size: int = 4,
                 delta_delay_s: float = 0.0) -> None:
        self.name = name
        self._fn = fn
        self._chunk_size = chunk_size
        self._delta_delay_s = delta_delay_s
        self.requests: list[list[Message]] = []
        self.samplings: list[Sampling | None] = []  # each request's, in order

    async def stream(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *,
                     sampling: Sampling | None = None) -> AsyncIterator[ModelEvent]:
        self.requests.append(list(messages))
        self.samplings.append(sampling)
        reply = self._fn(list(messages), list(tools))
        if inspect.isawaitable(reply):
            reply = await reply
        if reply.reasoning:
            yield ReasoningDelta(reply.reasoning)
        for piece in _pieces(reply.text, self._chunk_size):
            if self._delta_delay_s:
                await asyncio.sleep(self._delta_delay_s)
            yield TextDelta(piece)
        yield reply

    async def aclose(self) -> None:
        """Nothing to release: no connection is held."""


class ScriptedModel(FunctionModel):
    """Plays back a fixed list of replies; an Exception in the list is raised.

    `assert_complete()` checks that the script was used up.
    """

    def __init__(self, replies: Iterable[ModelReply | Exception], *, name: str = "scripted", chunk_size: int = 4,
                 delta_delay_s: float = 0.0) -> None:
        self._script: deque[ModelReply | Exception] = deque(replies)
        super().__init__(self._next, name=name, chunk_size=chunk_size, delta_delay_s=delta_delay_s)

    def _next(self, messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        if not self._script:
            raise ModelError(f"{self.name}: the script has no reply left for request {len(self.requests)}")
        item = self._script.popleft()
        if isinstance(item, Exception):
            raise item
        return item

    def push(self, *replies: ModelReply | Exception) -> None:
        self._script.extend(replies)

    def assert_complete(self) -> None:
        assert not self._script, f"{len(self._script)} scripted replies were never requested"
