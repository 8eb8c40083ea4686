"""`ember worker`: runs turns and background jobs for the gateways that share its store and bus.

It serves no client: `ember serve --workers 0` processes take the messages and
stream the answers; workers, on this machine or others, take the messages off
the Redis bus, run their turns under the sessions' leases, and run the
background jobs and the scheduled tasks (one worker leads those). Start as many
as the load needs; one that dies has its messages, sessions and jobs taken over
by the others after `worker_timeout_s`.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable

from ember.app import build_runtime, configured_approval_model, configured_background_model, require_shared_bus, running
from ember.config import Settings
from ember.models.base import ModelClient


async def work(settings: Settings, model: ModelClient, on_ready: Callable[[], None]) -> int:
    """Work until SIGINT or SIGTERM; then let the running turns finish for a while, and put the
    background jobs back for another worker. 0 after a clean stop."""
    require_shared_bus(settings, "ember worker")
    background = configured_background_model(settings) if settings.model_configured else None
    approval = configured_approval_model(settings, model) if settings.model_configured else None
    runtime = await build_runtime(settings, model, background_model=background, approval_model=approval)
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
        async with running(runtime):
            on_ready()
            await stopping.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0
