"""The scale-out bus: Redis Streams shared by gateway and worker processes.

Inbound (channel -> agent loop). A message goes to the stream
`{ns}:inbound:{shard}`, its shard a stable hash (CRC-32) of its session key,
so one session's messages keep their order in one stream. Every process reads
the shards in one consumer group, `workers`, under its own consumer name
(`process`): each entry goes to one worker. An entry stays pending until
`ack_inbound` (XACK, then XDEL: the stream holds only what is not done yet),
which the agent loop calls once the work the message started is durable: its
turn's answer or failure committed, or the message recognized as already
handled. A worker keeps the entries it holds fresh (XCLAIM JUSTID resets their
idle time) every third of `claim_idle_ms`, from a task of its own, so even while
its turns fill every slot and it reads nothing; and when it reads, it takes
over, with XAUTOCLAIM, entries idle longer than that: those of a consumer that
died or hung. The bus is therefore at-least-once; the store's inbox turns
that into one turn per message (a redelivered message is recognized by its
receipt), and the outbox into one delivery per answer (`delivery_id`). Within one worker a shard's
entries arrive in order; two workers may each take one of two messages of a
session sent back to back, and a message waits while an earlier one of its
session is not acknowledged (`earlier_in_session`, bus/redis_order.py): even
when the first one's worker died, the second is answered after it.
A worker takes one entry at a time, when it has room for a turn: the others
stay in Redis for whichever worker is free.
All processes must agree on the number of shards: it is recorded in Redis, and
a process configured otherwise refuses to start.

Outbound (agent loop -> channels) is addressed to the process that holds the
client's connection. Publishing an inbound message with a `message_id` records
the route `{ns}:route:{channel}:{message_id}` -> this process (with a TTL).
An outbound event whose `reply_to` has a route goes to that process's stream
`{ns}:outbound:to:{process}:{channel}`, if the process is reading that channel:
a reader keeps its stream alive with a TTL of `reader_ttl_ms`, renewed while
it reads, and the event is added with NOMKSTREAM (one Lua script, so the check
and the add are one step). Every other event, with no route (a scheduled task,
a webhook's outbound target) or whose route's process is gone, goes to
`{ns}:outbound:any:{channel}`, which the readers of the channel share in the
group `gateways`: one process delivers it, so a push channel (Telegram, a
webhook target) served by several processes sends it once. A gateway's request
waits in the process that published its message, so the events answering it
reach that process and no other. Outbound entries are read with NOACK: what
must arrive is in the outbox, which delivers it again. Both streams are trimmed
to about `outbound_maxlen` entries.

Redis down or restarted. Publishing retries for `publish_timeout_s`, then raises
`BusUnavailable`. Consumers (`next_inbound`, `next_outbound`) never give up:
they log the outage once, retry with backoff, and re-create their consumer
groups (MKSTREAM, from the stream's start) when Redis lost them. A Redis that
restarts without persistence loses the entries it held: those not yet read
(their messages were never run: a channel that recorded them has them
published again by the inbox's recovery, the others were refused with
`BusUnavailable` to their sender or are lost with Redis, so run Redis with
`appendonly yes` where that matters), the pending entries (their worker still
holds them and finishes them; the ack then finds nothing), routes (events fall
back to the shared stream) and outbound events not yet read (committed answers
are in the outbox). Messages published after the restart are delivered.

Stop requests (a person's Stop, taken by a gateway, for a turn a worker runs)
are published on `{ns}:stops`, which every process subscribes to: one sent
while a process is away from Redis is not sent again, and the person may
press Stop once more.

Logging: event text is user content and is never logged; the Redis URL is
logged without its password.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from ember.bus.codec import decode_inbound, encode_inbound
from ember.bus.redis_order import SessionOrder, message_of
from ember.bus.redis_outbound import OutboundStreams
from ember.bus.redis_support import (
    REDIS_DOWN,
    Backoff,
    RedisBusConfig,
    create_group,
    end_if_cancelled,
    lost_group,
    redacted_url,
    retrying,
    route_key,
    shard_of,
)
from ember.core.errors import BusUnavailable, ConfigError
from ember.core.events import InboundEvent, OutboundEvent

log = logging.getLogger(__name__)

WORKERS = "workers"  # the consumer group of the inbound shards

# KEYS: the inbound shards, in the order to try them. ARGV: the group, the consumer. The first new
# entry of the first shard that has one, as {the shard's place in KEYS, the shard, the id, its
# fields as a flat list}; false when all are empty.
_FIRST_NEW = """
for i, key in ipairs(KEYS) do
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', key, '>')
  if reply then
    local entry = reply[1][2][1]
    return {i - 1, key, entry[1], entry[2]}
  end
end
return false
"""

T = TypeVar("T")

@dataclass(frozen=True, slots=True)
class _Entry:
    stream: str
    entry_id: str
    session: str = ""  # its session's key, "" if written by a process that did not say it
    message: str = ""  # its message (redis_order.message_of)


class RedisBus:
    """The `Bus` on Redis Streams, plus `ack_inbound`. `process` names this process (its consumer
    and its outbound address): unique among the processes sharing the Redis, e.g. host-pid."""

    def __init__(self, url: str, *, process: str, config: RedisBusConfig | None = None) -> None:
        if not process or ":" in process or any(c.isspace() for c in process):
            raise ConfigError("the Redis bus's process name must be non-empty, without ':' or spaces")
        self._where, self._process = redacted_url(url), process
        self._config = config or RedisBusConfig()
        ns = self._config.namespace
        self._ns = ns
        self._shards = [f"{ns}:inbound:{i}" for i in range(self._config.shards)]
        try:
            self._client = Redis.from_url(url, decode_responses=True, retry=Retry(NoBackoff(), 0),
                                         socket_connect_timeout=2.0,
                                         socket_timeout=self._config.block_ms / 1000 + 5.0)
        except ValueError as exc:
            raise ConfigError(f"the Redis URL {self._where} is not valid: {exc}") from None
        self._first_new = self._client.register_script(_FIRST_NEW)
        self._order = SessionOrder(self._client, ns)
        self._outbound = OutboundStreams(self._client, process=process, config=self._config, where=self._where)
        self._ready: deque[tuple[_Entry, InboundEvent]] = deque()
        # id(event) -> (the event, kept so the id is not reused, and the entry it came from)
        self._delivered: dict[int, tuple[InboundEvent, _Entry]] = {}
        self._inbound_lock = asyncio.Lock()
        self._next_upkeep = 0.0
        self._next_shard = 0  # the inbound shard read first next time, so that every shard is served
        self._groups_made = False
        self._stops = f"{ns}:stops"
        self._stop_listener: PubSub | None = None
        self._freshening: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect, check the shard count and create the inbound groups; BusUnavailable if Redis is not there."""
        try:
            shards = await self._retrying("connect", self._claim_shard_count)
            if shards != self._config.shards:
                raise ConfigError(f"the Redis bus at {self._where} has {shards} inbound shards; this process "
                                  f"is configured with {self._config.shards}: every process must use the same")
            await self._retrying("create the inbound groups", self._create_inbound_groups)
        except BaseException:
            await self.close()
            raise
        self._freshening = asyncio.create_task(self._keep_held_fresh(), name="ember-redis-held-entries")
        log.info("Redis bus at %s: process %s, %d inbound shards", self._where, self._process, shards)

    async def close(self) -> None:
        """Disconnect. What this process was handed and did not ack stays pending: another worker takes it over."""
        if self._freshening is not None:
            self._freshening.cancel()
            await asyncio.gather(self._freshening, return_exceptions=True)
        self._ready.clear()
        self._delivered.clear()
        self._outbound.clear()
        await self._drop_stop_listener()
        await self._client.aclose()

    # -- inbound

    async def publish_inbound(self, event: InboundEvent) -> None:
        payload = encode_inbound(event)
        stream = self._shards[shard_of(event.session_key, self._config.shards)]
        routed = event.message_id is not None and event.reply is None
        await self._retrying(f"publish a message of {event.session_key}", lambda: self._order.publish(
            stream, payload, event.session_key, message_of(event.channel, event.chat_id, event.message_id),
            route=route_key(self._ns, event.channel, event.message_id or ""),
            process=self._process if routed else None, route_ttl_s=self._config.route_ttl_s))

    async def next_inbound(self) -> InboundEvent:
        """The next message for this worker: new, or taken over from a dead consumer."""
        async with self._inbound_lock:
            backoff = Backoff(self._where, "inbound")
            while not self._ready:
                end_if_cancelled()
                try:
                    await self._upkeep()
                    await self._read_new()
                except REDIS_DOWN as exc:
                    await backoff.wait(exc)
                except ResponseError as exc:
                    if not lost_group(exc):
                        raise
                    log.warning("Redis bus at %s lost the inbound groups; creating them again", self._where)
                    self._groups_made, self._next_upkeep = False, 0.0
                else:
                    backoff.recovered()
            entry, event = self._ready.popleft()
            self._delivered[id(event)] = (event, entry)
            return event

    async def ack_inbound(self, event: InboundEvent) -> None:
        """The work `event` started is durable: its entry is done. Call it with the object
        `next_inbound` returned. Not raising: an ack lost to an outage costs one redelivery,
        which the inbox recognizes."""
        held = self._delivered.get(id(event))
        if held is None or held[0] is not event:
            log.debug("ack of an inbound event this bus did not hand out (or acked already)")
            return
        del self._delivered[id(event)]
        try:
            await self._retrying("acknowledge a message", lambda: self._ack(held[1]))
        except BusUnavailable as exc:
            log.warning("%s It will be delivered again, and recognized as handled.", exc)

    async def earlier_in_session(self, event: InboundEvent) -> bool:
        """Whether another message of `event`'s session, sent before it, is not acknowledged yet.
        Redis out of reach counts as no: order gives way to answering at all."""
        held = self._delivered.get(id(event))
        if held is None or held[0] is not event or not held[1].session:
            return False
        entry = held[1]
        try:
            return await self._order.earlier(entry.stream, entry.session, entry.entry_id, entry.message)
        except REDIS_DOWN:
            log.warning("Redis bus at %s unreachable: a message of %s runs without looking for earlier ones",
                        self._where, event.session_key)
            return False

    async def release_inbound(self, event: InboundEvent) -> None:
        """Stop holding `event`'s entry (no more keeping it fresh), unacknowledged: if the process
        now running its turn dies too, the entry idles and another worker, this one included, takes
        it over."""
        held = self._delivered.get(id(event))
        if held is not None and held[0] is event:
            del self._delivered[id(event)]

    async def _read_new(self) -> None:
        """Take one new entry, if one comes within the block time. One: this process asks for a
        message when it can run one, and an entry it holds is one no other worker may take (a
        read of several streams with COUNT 1 returns one entry of each). So the shards are tried
        one at a time, from the one after the last served, and only when all are empty does a
        read block on all of them (which returns more than one only if several arrive at once).
        The tries are one script, one round trip (_FIRST_NEW)."""
        count = len(self._shards)
        first = self._next_shard
        found = await self._first_new(keys=[self._shards[(first + step) % count] for step in range(count)],
                                      args=[WORKERS, self._process])
        if found:
            step, stream, entry_id, fields = found
            self._next_shard = (first + int(step) + 1) % count
            await self._take(stream, [(entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))])
            return
        reply = await self._client.xreadgroup(WORKERS, self._process, dict.fromkeys(self._shards, ">"), count=1,
                                              block=min(self._config.block_ms, self._upkeep_every_ms))
        for stream, entries in reply or []:
            await self._take(stream, entries)

    @property
    def _upkeep_every_ms(self) -> int:
        return max(1, self._config.claim_idle_ms // 3)

    async def _keep_held_fresh(self) -> None:
        """Every third of claim_idle_ms, reset the idle time of the entries this process holds,
        so that no other worker takes them over while their turns run."""
        backoff = Backoff(self._where, "held entries")
        while True:
            await asyncio.sleep(self._upkeep_every_ms / 1000)
            held: dict[str, list[str]] = {}
            for entry in self._held():
                held.setdefault(entry.stream, []).append(entry.entry_id)
            try:
                for stream, ids in held.items():
                    await self._client.xclaim(stream, WORKERS, self._process, 0, ids, justid=True)
            except REDIS_DOWN as exc:
                await backoff.wait(exc)
            except ResponseError as exc:  # NOGROUP: the next read makes the groups again
                if not lost_group(exc):
                    log.warning("Redis bus at %s refused to keep held entries fresh: %s", self._where, exc)
            else:
                backoff.recovered()

    async def _upkeep(self) -> None:
        """Take over the entries dead consumers left."""
        now = time.monotonic()
        if now < self._next_upkeep:
            return
        if not self._groups_made:
            await self._create_inbound_groups()
        for stream in self._shards:
            _cursor, entries, _deleted = await self._client.xautoclaim(
                stream, WORKERS, self._process, self._config.claim_idle_ms, "0-0", count=100)
            if entries:
                log.info("took over %d inbound entries of %s idle for over %d ms",
                         len(entries), stream, self._config.claim_idle_ms)
                await self._take(stream, entries)
        self._next_upkeep = now + self._upkeep_every_ms / 1000

    def _held(self) -> set[_Entry]:
        return {entry for entry, _ in self._ready} | {entry for _, entry in self._delivered.values()}

    async def _take(self, stream: str, entries: list[tuple[str, dict[str, str] | None]]) -> None:
        held = self._held()
        for entry_id, fields in entries:
            known = fields or {}
            entry = _Entry(stream, entry_id, known.get("session", ""), known.get("message", ""))
            if entry in held:
                continue
            try:
                event = decode_inbound(known.get("event", ""))
            except ValueError as exc:
                log.warning("skipped the malformed inbound entry %s of %s: %s", entry_id, stream, exc)
                await self._ack(entry)
                continue
            self._ready.append((entry, event))

    async def _ack(self, entry: _Entry) -> None:
        if entry.session:
            await self._order.done(entry.stream, WORKERS, entry.session, entry.entry_id, entry.message)
            return
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.xack(entry.stream, WORKERS, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
            await pipe.execute()

    async def _claim_shard_count(self) -> int:
        key = f"{self._ns}:inbound:shards"
        await self._client.set(key, self._config.shards, nx=True)
        return int(await self._client.get(key) or self._config.shards)

    async def _create_inbound_groups(self) -> None:
        for stream in self._shards:
            await create_group(self._client, stream, WORKERS)
        self._groups_made = True

    # -- outbound

    async def publish_outbound(self, event: OutboundEvent) -> None:
        await self._outbound.publish(event)

    async def next_outbound(self, channel: str) -> OutboundEvent:
        return await self._outbound.next(channel)

    # -- stop requests

    async def publish_stop(self, session_key: str) -> bool:
        await self._retrying(f"ask to stop the turn of {session_key}",
                             lambda: self._client.publish(self._stops, session_key))
        return True

    async def next_stop(self) -> str:
        backoff = Backoff(self._where, "stop requests")
        while True:
            end_if_cancelled()
            try:
                if self._stop_listener is None:
                    self._stop_listener = self._client.pubsub(ignore_subscribe_messages=True)
                    await self._stop_listener.subscribe(self._stops)
                message = await self._stop_listener.get_message(timeout=self._config.block_ms / 1000)
                backoff.recovered()
                if message is not None and message["type"] == "message":
                    return str(message["data"])
            except REDIS_DOWN as exc:
                await self._drop_stop_listener()
                await backoff.wait(exc)

    async def _drop_stop_listener(self) -> None:
        listener, self._stop_listener = self._stop_listener, None
        if listener is not None:
            with contextlib.suppress(*REDIS_DOWN):
                await listener.aclose()

    async def _retrying(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        return await retrying(self._where, self._config.publish_timeout_s, what, op)
