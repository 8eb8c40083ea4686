"""A ModelClient that counts what every call through it used, and what it cost."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from ember.core.messages import Message
from ember.core.tools import ToolSpec
from ember.core.usage import Price, UsageRow, cost_usd, current_scope
from ember.models.base import ModelClient, ModelEvent, ModelReply


class MeteredModel:
    """Passes `inner`'s stream on; at its reply, hands `record` a UsageRow charged to the
    current scope, priced by the model that answered (a router's reply names it)."""

    def __init__(self, inner: ModelClient, prices: Mapping[str, Price],
                 record: Callable[[UsageRow], None]) -> None:
        self.inner = inner
        self.name = inner.name
        self._prices = prices
        self._record = record

    async def stream(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> AsyncIterator[ModelEvent]:
        async for event in self.inner.stream(messages, tools):
            if isinstance(event, ModelReply):
                self._count(event)
            yield event

    def _count(self, reply: ModelReply) -> None:
        model = reply.model or self.inner.name
        tokens = {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens,
                  "cache_read_tokens": reply.cache_read_tokens, "cache_write_tokens": reply.cache_write_tokens}
        self._record(UsageRow(at=time.time(), model=model, scope=current_scope.get(), **tokens,
                              cost_usd=cost_usd(self._prices.get(model), **tokens)))

    async def aclose(self) -> None:
        await self.inner.aclose()
