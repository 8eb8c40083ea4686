"""`ember worker`: runs turns and background jobs for the gateways that share its store and bus.

It serves no client: `ember serve --workers 0` processes take the messages and
stream the answers; workers, on this machine or others, take the messages off
the Redis bus, run their turns under the sessions' leases, and run the
background jobs and the scheduled tasks (one worker leads those). Start as many
as the load needs; one that dies has its messages, sessions and jobs taken over
by the others after `worker_timeout_s`.

With `worker_metrics_port` set it also serves Prometheus text at /metrics: the
tokens, cost and calls of the models its turns and jobs call, which the
gateways do not see, and the job queue's counts.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.app.runtime import Runtime, configured_runtime, require_shared_bus, running
from ember.app.serve import bind
from ember.channels.gateway.metrics import ProcessMetrics
from ember.config.settings import Settings
from ember.models.base import ModelClient


async def work(settings: Settings, model: ModelClient, on_ready: Callable[[str | None], None]) -> int:
    """Work until SIGINT or SIGTERM; then let the running turns finish for a while, and put the
    background jobs back for another worker. 0 after a clean stop. `on_ready` is told where
    the metrics are served, if they are."""
    require_shared_bus(settings, "ember worker")
    port = settings.worker_metrics_port
    # Taken first, so that a port in use fails the start at once.
    sock = bind(settings.worker_metrics_host, port) if port is not None else None
    try:
        return await _work(settings, model, on_ready, sock)
    finally:
        if sock is not None:
            sock.close()


async def _work(settings: Settings, model: ModelClient, on_ready: Callable[[str | None], None],
                sock: socket.socket | None) -> int:
    runtime = await configured_runtime(settings, model)
    runtime.channels.register(runtime.scheduler())
    stopping = asyncio.Event()

    def stop(sig: int) -> None:
        if stopping.is_set():
            return
        print(f"ember worker: stopping ({signal.Signals(sig).name}); running turns get a few seconds to finish, "
              "then their messages go back to the other workers", file=sys.stderr, flush=True)
        stopping.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    try:
        async with running(runtime), serving_metrics(runtime, sock) as metrics_url:
            on_ready(metrics_url)
            await stopping.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


class _MetricsServer(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the worker stops on its own signal handlers, and then stops this server


@asynccontextmanager
async def serving_metrics(runtime: Runtime, sock: socket.socket | None) -> AsyncIterator[str | None]:
    """/metrics on `sock` for the block (nothing without one); yields its URL."""
    if sock is None:
        yield None
        return
    metrics = ProcessMetrics()
    runtime.usage.observe(metrics.count_usage)

    async def metrics_text(request: Request) -> Response:
        return metrics.response(await runtime.jobs.counts())

    app = Starlette(routes=[Route("/metrics", metrics_text, methods=["GET"])])
    server = _MetricsServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="ember-worker-metrics")
    watcher = asyncio.create_task(metrics.watch_event_loop(), name="ember-loop-lag")
    host, port = sock.getsockname()[:2]
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if not server.started:
            serving.result()  # raises what stopped it, if anything did
            raise RuntimeError("the worker's /metrics server stopped as it started")
        yield f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
    finally:
        watcher.cancel()
        server.should_exit = True
        await serving
