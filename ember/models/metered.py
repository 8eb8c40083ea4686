"""A ModelClient that counts what every call through it used, and what it cost."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ember.core.messages import Message
from ember.core.sampling import Sampling
from ember.core.tools import ToolSpec
from ember.core.usage import CallBudget, Price, UsageRow, cost_usd, current_scope, reservation_usd
from ember.models.base import ModelClient, ModelEvent, ModelReply

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer


class MeteredModel:
    """Passes `inner`'s stream on; at its reply, hands `record` a UsageRow charged to the
    current scope, priced by the model that answered (a router's reply names it). With a
    `tracer`, each call is also an OpenTelemetry span under the current one."""

    def __init__(self, inner: ModelClient, prices: Mapping[str, Price], record: Callable[[UsageRow], None],
                 tracer: Tracer | None = None, budget: CallBudget | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self._prices = prices
        self._record = record
        self._tracer = tracer
        self._budget = budget

    async def stream(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *,
                     sampling: Sampling | None = None) -> AsyncIterator[ModelEvent]:
        release = await self._reserve(messages, tools, sampling)
        try:
            async for event in self._metered(messages, tools, sampling):
                yield event
        finally:
            release()  # after the reply's row was counted: the two never both miss

    async def _reserve(self, messages: Sequence[Message], tools: Sequence[ToolSpec],
                       sampling: Sampling | None) -> Callable[[], None]:
        """The call's reservation in its person's budget, at the dearest configured price: a chain may
        fall over to any of its models."""
        scope = current_scope.get()
        if self._budget is None or not self._budget.holds(scope):
            return lambda: None
        chars = sum(len(m.content) for m in messages) + sum(len(t.description) + len(str(t.parameters))
                                                            for t in tools)
        output = sampling.max_tokens if sampling else None
        usd = max(filter(None, (reservation_usd(price, chars, output) for price in self._prices.values())), default=0)
        if not usd:
            return lambda: None
        return await self._budget.reserve(scope, usd)

    async def _metered(self, messages: Sequence[Message], tools: Sequence[ToolSpec],
                       sampling: Sampling | None) -> AsyncIterator[ModelEvent]:
        span = None
        if self._tracer is not None:
            from opentelemetry.trace import SpanKind  # only when traces are on: the import costs a CLI start

            span = self._tracer.start_span(f"chat {self.name}", kind=SpanKind.CLIENT, attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": self.name})
        try:
            async for event in self.inner.stream(messages, tools, sampling=sampling):
                if isinstance(event, ModelReply):
                    row = self._count(event)
                    if span is not None:
                        _describe(span, event, row)
                yield event
        except BaseException as exc:
            if span is not None:
                from opentelemetry.trace import Status, StatusCode

                span.set_attribute("error.type", type(exc).__name__)
                span.set_status(Status(StatusCode.ERROR))
            raise
        finally:
            if span is not None:
                span.end()

    def cost_of(self, reply: ModelReply) -> float | None:
        """What `reply` cost at the configured price of the model that answered; None if it has none."""
        return cost_usd(self._prices.get(reply.model or self.inner.name), **_tokens(reply))

    def _count(self, reply: ModelReply) -> UsageRow:
        row = UsageRow(at=time.time(), model=reply.model or self.inner.name, scope=current_scope.get(),
                       **_tokens(reply), cost_usd=self.cost_of(reply))
        self._record(row)
        return row

    async def aclose(self) -> None:
        await self.inner.aclose()


def _tokens(reply: ModelReply) -> dict[str, int]:
    return {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens,
            "cache_read_tokens": reply.cache_read_tokens, "cache_write_tokens": reply.cache_write_tokens}


def _describe(span: Span, reply: ModelReply, row: UsageRow) -> None:
    attributes: dict[str, str | int | float] = {
        "gen_ai.response.model": row.model,
        "gen_ai.usage.input_tokens": reply.input_tokens + reply.cache_read_tokens + reply.cache_write_tokens,
        "gen_ai.usage.output_tokens": reply.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": reply.cache_read_tokens,
        "gen_ai.usage.cache_creation.input_tokens": reply.cache_write_tokens,
    }
    if reply.provider:
        attributes["gen_ai.provider.name"] = reply.provider
    if row.cost_usd is not None:
        attributes["ember.cost.usd"] = row.cost_usd
    if reply.passed_over:
        attributes["ember.model.passed_over"] = len(reply.passed_over)
    span.set_attributes(attributes)
