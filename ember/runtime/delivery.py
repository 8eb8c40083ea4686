"""Delivery of committed answers: confirmed in batches, re-sent when never confirmed.

Every answer is committed with an outbox record. Whoever hands it to a
channel (the stream's finalize, or the loop) reports `delivered(id)`; the
worker writes those marks in batches, off the turn's path: one transaction
for the marks of every `batch_s`, and at stop. At start, and
every `sweep_s`, records of the channels this process serves that are still
unconfirmed are sent again with the same delivery id, so a channel that
dedupes shows each answer once. A crash between the commit and the send
loses nothing; a crash between the send and the mark (up to `batch_s` of
answers) re-sends a duplicate that the delivery id lets the channel drop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from ember.bus.base import OutboundPublisher
from ember.core.delivery import Delivery
from ember.core.errors import StoreError
from ember.core.events import OutboundEvent, TurnUsage
from ember.runtime.tasks import cancel_task
from ember.store.protocols import DeliveryStore

log = logging.getLogger(__name__)


def answer_event(delivery: Delivery, usage: TurnUsage | None = None) -> OutboundEvent:
    """A committed record as its channel takes it: the whole answer, in place of any draft."""
    return OutboundEvent(
        channel=delivery.channel, chat_id=delivery.chat_id, kind=delivery.kind.outbound, text=delivery.text,
        turn_id=delivery.turn_id, reply_to=delivery.reply_to, stream_full_text=True,
        delivery_id=delivery.delivery_id, usage=usage, attachments=delivery.attachments,
        session_key=delivery.session_key)


class DeliveryWorker:
    def __init__(self, store: DeliveryStore, bus: OutboundPublisher, *, sweep_s: float = 30.0,
                 batch_s: float = 1.0) -> None:
        self.store = store
        self._bus = bus
        self._sweep_s = sweep_s
        self._batch_s = batch_s
        self._channels: frozenset[str] = frozenset()
        self._marks: list[str] = []
        self._given_up: list[tuple[str, str]] = []
        self._confirmed_by_channel: frozenset[str] = frozenset()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def delivered(self, delivery_id: str) -> None:
        """The answer reached its channel; recorded soon, in a batch."""
        self._marks.append(delivery_id)
        self._wake.set()

    def handed_over(self, channel: str, delivery_id: str) -> None:
        """The answer is on the bus to `channel`. A channel in this process takes it from there, so
        it counts as delivered, unless the channel confirms its deliveries itself (a remote target)."""
        if channel not in self._confirmed_by_channel:
            self.delivered(delivery_id)

    def gave_up(self, delivery_id: str, reason: str) -> None:
        """The channel refused the answer for good (a 4xx from a webhook target): recorded, never re-sent."""
        self._given_up.append((delivery_id, reason))
        self._wake.set()

    async def start(self, channels: Iterable[str] = (), *, confirming: Iterable[str] = ()) -> None:
        """Start marking; re-send what the given channels are still owed (at once, then every sweep).
        `confirming`: the channels that report their deliveries themselves (`delivered`, `gave_up`)."""
        self._channels = frozenset(channels)
        self._confirmed_by_channel = frozenset(confirming)
        if self._channels:
            await self.resend()
        self._task = asyncio.create_task(self._run(), name="ember-delivery")

    async def stop(self) -> None:
        await cancel_task(self._task)
        self._task = None
        await self.flush()

    async def send(self, delivery: Delivery, usage: TurnUsage | None = None) -> None:
        """Hand a committed record to its channel, replacing any draft shown there, and mark it delivered."""
        await self._bus.publish_outbound(answer_event(delivery, usage))
        self.handed_over(delivery.channel, delivery.delivery_id)

    async def resend(self, *, older_than_s: float = 0.0) -> int:
        owed = await self.store.undelivered(self._channels, older_than_s=older_than_s)
        for delivery in owed:
            try:
                await self.send(delivery)
            except Exception:  # the channel's edge: it stays owed, for the next sweep or start
                log.warning("could not re-send %s to %s; it stays owed", delivery.delivery_id, delivery.channel,
                            exc_info=True)
        if owed:
            log.info("re-sent %d committed answers that were never confirmed", len(owed))
        return len(owed)

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self._sweep_s):
                    await self._wake.wait()
            except TimeoutError:
                if self._channels:
                    await self._guarded(self.resend(older_than_s=self._sweep_s))
            else:
                await asyncio.sleep(self._batch_s)  # the marks of the turns meanwhile join this batch
            self._wake.clear()
            await self._guarded(self.flush())

    async def flush(self) -> None:
        """Write the marks gathered so far now (the worker does every `batch_s`, and at stop)."""
        marks, self._marks = self._marks, []
        given_up, self._given_up = self._given_up, []
        try:
            await self.store.mark_delivered(marks)
            await self.store.mark_given_up(given_up)
        except BaseException:
            self._marks[:0] = marks  # kept for the next flush
            self._given_up[:0] = given_up
            raise

    async def _guarded(self, work: Coroutine[Any, Any, object]) -> None:
        try:
            await work
        except StoreError:
            log.warning("delivery bookkeeping failed; it will be retried", exc_info=True)
