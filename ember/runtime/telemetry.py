"""OpenTelemetry traces of turns, model calls, tool calls and background jobs, over OTLP/HTTP.

Off unless `otel_endpoint` is set (then the official SDK and its OTLP/HTTP
exporter, imported only then). The spans:

- `turn`, the root of a turn's trace (`ember.turn.id`, `ember.session.key`);
- `stage context|inference|response` under it;
- `chat {model}` for each model call (GenAI semantic conventions:
  `gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.model`,
  `gen_ai.response.model`, `gen_ai.usage.*`; `ember.cost.usd` when priced),
  made by MeteredModel under whatever span is current;
- `execute_tool {name}` for each tool call (`gen_ai.tool.name`,
  `gen_ai.tool.call.id`), with an `approval` event when one was asked;
- `background_job {kind}`, linked to the turn that queued it. A turn's trace
  and root span ids are derived from its turn id, so a job that only knows the
  turn id can link to it, even from another process or after a restart.

Nothing that may hold a secret becomes an attribute: no message text, no
tool arguments or output, no approval subject; errors are named by type. What
the SDK adds by itself (an exception's message and stack trace as an event, a
status description) is redacted on the way out, as every name, attribute and
event is (RedactingExporter).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from ember.core.journal import ApprovalEvent, Delegated, Routed, ToolCalled, ToolProgress, TurnEvent
from ember.core.redact import redact

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

# The ids the next root span takes: a turn's, derived from its turn id.
_root_ids: ContextVar[tuple[int, int] | None] = ContextVar("ember_otel_root_ids", default=None)


def turn_span_context(turn_id: str) -> SpanContext:
    digest = hashlib.sha256(turn_id.encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


class _TurnIds(IdGenerator):
    """Random ids, except for a turn's root span, whose ids its turn id gives."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_span_id(self) -> int:
        ids = _root_ids.get()
        return ids[1] if ids else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        ids = _root_ids.get()
        return ids[0] if ids else self._random.generate_trace_id()


def _ns_since(started: float) -> int:
    """The wall-clock time, in ns, of the perf_counter reading `started`."""
    return time.time_ns() - int((time.perf_counter() - started) * 1e9)


class SpanObserver:
    """The TurnObserver that makes a turn's stage and tool spans."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        with self._tracer.start_as_current_span(f"stage {name}", attributes={"ember.stage": name}):
            yield

    def event(self, event: TurnEvent) -> None:
        # A model call's own span is MeteredModel's: it sees every call, a background job's too.
        # No text reaches a span: not what a tool, an agent or an approval's subject said.
        match event:
            case ToolCalled():
                self._tool_span(event)
            case ApprovalEvent():
                trace.get_current_span().add_event("approval", {
                    "gen_ai.tool.call.id": event.call_id, "gen_ai.tool.name": event.tool,
                    "ember.approval.decision": event.decision, "ember.approval.decided_by": event.decided_by,
                    "ember.approval.explained": event.explanation is not None})
            case ToolProgress():
                trace.get_current_span().add_event("tool_progress", {"gen_ai.tool.name": event.tool})
            case Routed():
                trace.get_current_span().add_event("routed", {"ember.route.chain": event.chain})
            case Delegated():
                trace.get_current_span().add_event("delegated", {
                    "ember.delegate.turn_id": event.turn_id, "ember.delegate.status": event.status,
                    "gen_ai.usage.input_tokens": event.input_tokens,
                    "gen_ai.usage.output_tokens": event.output_tokens})

    def _tool_span(self, call: ToolCalled) -> None:
        span = self._tracer.start_span(
            f"execute_tool {call.name}", kind=SpanKind.INTERNAL, start_time=_ns_since(call.started),
            attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call.name,
                        "gen_ai.tool.call.id": call.call_id, "ember.tool.result_chars": len(call.result)})
        if call.failed:
            span.set_status(Status(StatusCode.ERROR))
            span.set_attribute("error.type", "tool_error")
        span.end()


def _attributes(attributes: Any) -> dict[str, Any]:
    # By look only: the names are Ember's own, and some are counts ("gen_ai.usage.input_tokens").
    return {key: redact(value, by_name=False) for key, value in (attributes or {}).items()}


def redacted_span(span: ReadableSpan) -> ReadableSpan:
    status = span.status
    if status.description:
        status = Status(status.status_code, redact(status.description))
    return ReadableSpan(
        name=redact(span.name), context=span.context, parent=span.parent, resource=span.resource,
        attributes=_attributes(span.attributes),
        events=[Event(event.name, _attributes(event.attributes), event.timestamp) for event in span.events],
        links=[Link(link.context, _attributes(link.attributes)) for link in span.links], kind=span.kind,
        status=status, start_time=span.start_time, end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope)


class RedactingExporter(SpanExporter):
    """An exporter that sends every span through the redaction pass first."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._exporter.export([redacted_span(span) for span in spans])

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class Telemetry:
    def __init__(self, endpoint: str, *, service_name: str = "ember", exporter: SpanExporter | None = None) -> None:
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces", timeout=10)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                        id_generator=_TurnIds())
        self._provider.add_span_processor(BatchSpanProcessor(RedactingExporter(exporter), schedule_delay_millis=1_000))
        self.tracer: Tracer = self._provider.get_tracer("ember")
        self.observer = SpanObserver(self.tracer)

    @contextmanager
    def turn(self, turn_id: str, session_key: str) -> Iterator[None]:
        ids = turn_span_context(turn_id)
        token = _root_ids.set((ids.trace_id, ids.span_id))
        try:
            # A new trace, whatever span is current: each turn is its own.
            span = self.tracer.start_span("turn", context=trace.set_span_in_context(trace.INVALID_SPAN),
                                          kind=SpanKind.SERVER,
                                          attributes={"ember.turn.id": turn_id, "ember.session.key": session_key})
        finally:
            _root_ids.reset(token)
        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=True):
            yield

    @contextmanager
    def job(self, kind: str, job_id: str, session_key: str | None, turn_id: str | None) -> Iterator[None]:
        attributes: dict[str, Any] = {"ember.job.kind": kind, "ember.job.id": job_id}
        if session_key:
            attributes["ember.session.key"] = session_key
        links = []
        if turn_id:
            attributes["ember.turn.id"] = turn_id
            links.append(Link(turn_span_context(turn_id), {"ember.link": "queued by"}))
        with self.tracer.start_as_current_span(f"background_job {kind}", context=trace.set_span_in_context(
                trace.INVALID_SPAN), kind=SpanKind.CONSUMER, attributes=attributes, links=links,
                record_exception=False):
            yield

    def shutdown(self) -> None:
        """Send what is left, then stop."""
        self._provider.shutdown()
