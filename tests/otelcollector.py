"""An OTLP/HTTP trace collector of the tests' own, on 127.0.0.1: it takes what the
official exporter posts to /v1/traces (protobuf ExportTraceServiceRequest), answers as
a collector does, and keeps every span with its ids, parent, links, attributes and events."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.loopback import LoopbackServer, started


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@dataclass(slots=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    service: str = ""


class Collector:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._server = LoopbackServer(Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])]),
                                      "OTLP collector")

    @property
    def endpoint(self) -> str:
        return self._server.origin

    def named(self, name: str) -> list[Span]:
        return [span for span in self.spans if span.name == name]

    async def _traces(self, request: Request) -> Response:
        if request.headers.get("content-type") != "application/x-protobuf":
            return Response("protobuf only", status_code=415)
        export = ExportTraceServiceRequest.FromString(await request.body())
        self.requests += 1
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(Span(
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in span.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        service=str(resource.get("service.name", ""))))
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()


def collecting() -> AbstractContextManager[Collector]:
    return started(Collector())
