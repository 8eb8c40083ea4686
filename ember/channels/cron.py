"""The `cron` channel: fires scheduled tasks' runs as messages, each answered to its task's chat.

It polls the store every `poll_s` (so tasks added by `ember cron add` in another
process are picked up within it) and sleeps no longer than until the next run
is due. Claiming is one transaction per batch (store/tasks.py), so a run
fires once whatever crashes, and the clock is injectable for tests. Where
several processes share the store, each worker has a scheduler, and only the
one holding the `leader` lease fires runs; another takes over within the
lease's time if it stops, and first publishes the runs the last leader claimed
but did not get to publish (`unstarted`: accepted, never begun).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ember.bus.base import InboundPublisher
from ember.core.channels import ChannelCapabilities
from ember.core.events import InboundEvent, OutboundEvent
from ember.core.leases import Leadership
from ember.core.tasks import CHANNEL
from ember.runtime.tasks import cancel_task
from ember.store.protocols import DueTasks

log = logging.getLogger(__name__)


class Scheduler:
    name = CHANNEL
    capabilities = ChannelCapabilities()
    MISSED_AFTER_S = 60.0  # a run later than this was missed (Ember was down): the task's policy says if it runs
    BATCH = 500  # runs claimed at once

    def __init__(self, bus: InboundPublisher, tasks: DueTasks, *, clock: Callable[[], float] = time.time,
                 poll_s: float = 1.0, leader: Leadership | None = None,
                 unstarted: Callable[[], Awaitable[list[InboundEvent]]] | None = None) -> None:
        self._bus = bus
        self._leader = leader
        self._unstarted = unstarted
        self._leading = False
        self._tasks = tasks
        self._clock = clock
        self._poll_s = poll_s
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._runner = asyncio.create_task(self._run(), name="ember-scheduler")

    async def stop(self) -> None:
        await cancel_task(self._runner)
        self._runner = None
        if self._leader is not None:
            await self._leader.release()

    async def deliver(self, event: OutboundEvent) -> None:
        """A task without a chat to answer: its answers stay in its own session."""

    def wake(self) -> None:
        """Look for due runs now (a task was added or changed in this process)."""
        self._wake.set()

    async def fire_due(self) -> int:
        """Claim and publish the runs due now; how many were published."""
        events = await self._tasks.claim_due(self._clock(), missed_after_s=self.MISSED_AFTER_S, limit=self.BATCH)
        for event in events:
            await self._bus.publish_inbound(event)
        return len(events)

    async def _lead(self) -> bool:
        """Whether this process fires the runs; on taking the lead, the runs another leader
        claimed but did not publish (it died in between) are published first."""
        if self._leader is None:
            return True
        if not await self._leader.held():
            self._leading = False
            return False
        if not self._leading:
            self._leading = True
            for event in await self._unstarted() if self._unstarted is not None else []:
                await self._bus.publish_inbound(event)
        return True

    async def _run(self) -> None:
        while True:
            delay = self._poll_s
            try:
                if await self._lead():  # else another process fires them
                    await self.fire_due()
                    due = await self._tasks.next_due_at()
                    if due is not None:
                        delay = min(delay, max(0.0, due - self._clock()))
            except Exception:  # the store was busy or failed: the runs stay due, for the next look
                log.warning("the scheduler could not claim due runs; it tries again", exc_info=True)
            if delay > 0:
                try:
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            self._wake.clear()
