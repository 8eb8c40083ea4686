"""Stopping the tasks a component owns."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def stop_tasks(tasks: Iterable[asyncio.Task[None]], grace_s: float) -> None:
    """Give `tasks` `grace_s` to finish, then cancel the rest and wait for them."""
    running = set(tasks)
    if not running:
        return
    _, pending = await asyncio.wait(running, timeout=grace_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
