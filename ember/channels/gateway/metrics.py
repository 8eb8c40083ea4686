"""What a process counts, in Prometheus text at /metrics: a gateway its turns as clients see
them, and every process that runs turns its model calls and background jobs."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.responses import Response

from ember.core.usage import UsageRow

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LOOP_TICK_S = 0.1  # how often the event loop's lag is sampled


class ProcessMetrics:
    """The model calls of the turns and jobs this process runs, and the job queue's counts
    (an `ember worker`'s /metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge("ember_background_jobs", "Background jobs by status", ["status"], registry=self.registry)
        self.model_tokens = Counter("ember_model_tokens", "Tokens of model calls, by model and kind (input, output,"
                                    " cache_read, cache_write)", ["model", "kind"], registry=self.registry)
        self.model_cost = Counter("ember_model_cost_usd", "USD of priced model calls, by model", ["model"],
                                  registry=self.registry)
        self.model_calls = Counter("ember_model_calls", "Model calls, by model and whether they were priced",
                                   ["model", "priced"], registry=self.registry)
        self.loop_lag = Histogram("ember_event_loop_lag_seconds", "How late the event loop ran a timer due every "
                                  f"{LOOP_TICK_S:g} s: what every request and turn of this process waits on top of "
                                  "its own work", buckets=_LAG_BUCKETS, registry=self.registry)

    async def watch_event_loop(self, every_s: float = LOOP_TICK_S) -> None:
        """Sample the event loop's lag until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + every_s
            await asyncio.sleep(every_s)
            self.loop_lag.observe(max(0.0, loop.time() - due))

    def count_usage(self, row: UsageRow) -> None:
        for kind in ("input", "output", "cache_read", "cache_write"):
            if tokens := getattr(row, f"{kind}_tokens"):
                self.model_tokens.labels(row.model, kind).inc(tokens)
        self.model_calls.labels(row.model, "yes" if row.cost_usd is not None else "no").inc()
        if row.cost_usd:
            self.model_cost.labels(row.model).inc(row.cost_usd)

    def response(self, job_counts: dict[str, int]) -> Response:
        """What GET /metrics answers, the queue's `job_counts` as they are now."""
        for status in ("pending", "running", "done", "failed", "superseded"):
            self.jobs.labels(status).set(job_counts.get(status, 0))
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")


class GatewayMetrics(ProcessMetrics):
    """A gateway's: the process's, and the turns through its APIs."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = Counter("ember_turns", "Turns through the gateway, by API and outcome (final, error)",
                             ["api", "outcome"], registry=self.registry)
        self.turn_seconds = Histogram("ember_turn_duration_seconds", "From request to final answer",
                                      ["api"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.first_delta_seconds = Histogram("ember_first_delta_seconds", "From request to the first streamed text",
                                             ["api"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.deliveries = Counter("ember_deliveries", "Final answers and errors, by whether the client got them "
                                  "(client_gone: it left; the answer stays in the history)",
                                  ["outcome"], registry=self.registry)

    def clock(self, api: str) -> TurnClock:
        return TurnClock(self, api)


class TurnClock:
    """Times one turn as its client sees it."""

    def __init__(self, metrics: GatewayMetrics, api: str) -> None:
        self._metrics = metrics
        self._api = api
        self._start = time.perf_counter()
        self._first_delta_seen = False
        self._closed = False

    def delta(self) -> None:
        if not self._first_delta_seen:
            self._first_delta_seen = True
            self._metrics.first_delta_seconds.labels(self._api).observe(time.perf_counter() - self._start)

    def closed(self, outcome: str) -> None:
        """The turn's final or error reached the client."""
        self._closed = True
        self._metrics.turns.labels(self._api, outcome).inc()
        self._metrics.turn_seconds.labels(self._api).observe(time.perf_counter() - self._start)
        self._metrics.deliveries.labels("delivered").inc()

    def abandoned(self) -> None:
        """The client left before the final; the turn runs on and commits it."""
        if not self._closed:
            self._metrics.deliveries.labels("client_gone").inc()
