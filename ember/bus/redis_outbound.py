"""The Redis bus's outbound half: events for the channels, addressed to the process that holds
the client's connection (its stream, while it reads), else shared by the channel's readers
(bus/redis.py's docstring tells the whole design)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ember.bus.codec import decode_outbound, encode_outbound
from ember.bus.redis_support import (
    REDIS_DOWN,
    Backoff,
    RedisBusConfig,
    create_group,
    end_if_cancelled,
    lost_group,
    retrying,
    route_key,
)
from ember.core.events import OutboundEvent

log = logging.getLogger("ember.bus.redis")

READERS = "gateways"  # the consumer group of the outbound streams

# KEYS: the route, the shared stream. ARGV: the prefix of process streams, the channel, maxlen, payload,
# and "1" when the event has a route to look up.
_PUBLISH_OUTBOUND = """
local process = ARGV[5] == '1' and redis.call('GET', KEYS[1])
if process then
  local id = redis.call('XADD', ARGV[1] .. process .. ':' .. ARGV[2], 'NOMKSTREAM',
                        'MAXLEN', '~', ARGV[3], '*', 'event', ARGV[4])
  if id then return id end
end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'event', ARGV[4])
"""


@dataclass(slots=True)
class _Outbox:
    """One channel's reading state in this process."""

    own: str  # the stream addressed to this process
    shared: str
    ready: deque[OutboundEvent] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_beat: float = 0.0
    groups_made: bool = False


class OutboundStreams:
    def __init__(self, client: Redis, *, process: str, config: RedisBusConfig, where: str) -> None:
        self._client, self._process, self._config, self._where = client, process, config, where
        self._ns = config.namespace
        self._publish_script = client.register_script(_PUBLISH_OUTBOUND)
        self._outboxes: dict[str, _Outbox] = {}

    def clear(self) -> None:
        self._outboxes.clear()

    async def publish(self, event: OutboundEvent) -> None:
        payload = encode_outbound(event)
        routed = event.reply_to is not None
        keys = [route_key(self._ns, event.channel, event.reply_to or ""), f"{self._ns}:outbound:any:{event.channel}"]
        args = [f"{self._ns}:outbound:to:", event.channel, self._config.outbound_maxlen, payload, int(routed)]
        await retrying(self._where, self._config.publish_timeout_s, f"publish an event to {event.channel}",
                       lambda: self._publish_script(keys=keys, args=args))

    async def next(self, channel: str) -> OutboundEvent:
        """The next event for `channel` in this process: addressed to it, or for any reader of the channel."""
        box = self._outboxes.get(channel)
        if box is None:
            box = self._outboxes[channel] = _Outbox(own=f"{self._ns}:outbound:to:{self._process}:{channel}",
                                                   shared=f"{self._ns}:outbound:any:{channel}")
        async with box.lock:
            backoff = Backoff(self._where, f"channel {channel}")
            while not box.ready:
                end_if_cancelled()
                try:
                    await self._beat(box)
                    reply = await self._client.xreadgroup(
                        READERS, self._process, {box.own: ">", box.shared: ">"}, count=100, noack=True,
                        block=min(self._config.block_ms, self._beat_every_ms))
                except REDIS_DOWN as exc:
                    await backoff.wait(exc)
                    continue
                except ResponseError as exc:
                    if not lost_group(exc):
                        raise
                    box.groups_made, box.next_beat = False, 0.0
                    continue
                backoff.recovered()
                for stream, entries in reply or []:
                    for entry_id, fields in entries:
                        try:
                            box.ready.append(decode_outbound((fields or {}).get("event", "")))
                        except ValueError as exc:
                            log.warning("skipped the malformed outbound entry %s of %s: %s", entry_id, stream, exc)
            return box.ready.popleft()

    @property
    def _beat_every_ms(self) -> int:
        return max(1, self._config.reader_ttl_ms // 3)

    async def _beat(self, box: _Outbox) -> None:
        """This process reads the channel: keep its stream (the address events are sent to) alive."""
        now = time.monotonic()
        if now < box.next_beat:
            return
        if not box.groups_made or not await self._client.pexpire(box.own, self._config.reader_ttl_ms):
            await create_group(self._client, box.own, READERS)  # MKSTREAM: the stream is there from now on
            await create_group(self._client, box.shared, READERS)
            await self._client.pexpire(box.own, self._config.reader_ttl_ms)
            box.groups_made = True
        box.next_beat = now + self._beat_every_ms / 1000
