"""The turns this process runs at once, and a session's messages taken in the order sent.

On a bus several workers share, a message whose session has an earlier one not yet handled
(by another worker, or by a dead one until it is taken over) waits for it. It gives its slot
back meanwhile: the earlier message may be one this process takes over, only when it has room.
"""

from __future__ import annotations

import asyncio

from ember.bus.base import InboundQueue
from ember.core.events import InboundEvent

# How often a waiting message looks again (and whenever this process acknowledges one): from the
# first to the last, doubling.
ORDER_POLL_S = (0.01, 0.5)


class TurnSlots:
    def __init__(self, bus: InboundQueue, max_turns: int) -> None:
        self._bus = bus
        self._free = asyncio.Semaphore(max_turns)
        self._given_back: set[asyncio.Task[None]] = set()  # turns waiting in order, without their slot
        self._acked = asyncio.Event()  # set, and replaced, whenever this process acknowledges a message
        self.waiting = 0  # takers waiting for a slot: the process takes no message from the bus meanwhile

    async def take(self) -> None:
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1

    def give_back(self) -> None:
        self._free.release()

    def finished(self, task: asyncio.Task[None]) -> None:
        """`task`'s turn is over: its slot is free, unless it had given it back."""
        if task in self._given_back:
            self._given_back.discard(task)
        else:
            self._free.release()

    async def in_order(self, event: InboundEvent) -> None:
        """Once every message of `event`'s session sent before it is handled."""
        acked = self._acked  # taken before each look, so that no acknowledgement after it is missed
        if not await self._bus.earlier_in_session(event):
            return
        task = asyncio.current_task()
        assert task is not None
        self._given_back.add(task)
        self._free.release()
        delay, longest = ORDER_POLL_S
        while True:
            try:
                await asyncio.wait_for(acked.wait(), delay)
            except TimeoutError:
                delay = min(delay * 2, longest)
            acked = self._acked
            if not await self._bus.earlier_in_session(event):
                break
        await self._free.acquire()
        self._given_back.discard(task)

    async def ack(self, event: InboundEvent) -> None:
        """`event` is handled: acknowledged on the bus, and the messages waiting here look again."""
        await self._bus.ack_inbound(event)
        self._acked.set()
        self._acked = asyncio.Event()
