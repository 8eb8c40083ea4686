"""Stopping the tasks a component owns."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


CANCEL_WAIT_S = 10.0


async def stop_tasks(tasks: Iterable[asyncio.Task[None]], grace_s: float) -> None:
    """Give `tasks` `grace_s` to finish, then cancel the rest and wait for them,
    for a bounded time: a task that ignores cancellation is reported, not awaited forever."""
    running = set(tasks)
    if not running:
        return
    _, pending = await asyncio.wait(running, timeout=grace_s)
    for task in pending:
        task.cancel()
    if pending:
        _, stuck = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
        for task in stuck:
            log.error("task %s did not stop within %.0fs of being cancelled", task.get_name(), CANCEL_WAIT_S)


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        await stop_tasks([task], grace_s=0)
