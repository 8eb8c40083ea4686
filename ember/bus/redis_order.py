"""A session's messages answered in the order they were sent, whichever workers take them.

Two workers may each take one of two messages of a session sent back to back; if the first's
worker dies, the second would be answered before the first is taken over. So every inbound
entry's id is also appended, in the same step as the entry (one Lua script), to its session's
list `{ns}:order:{session_key}`, and acknowledging the entry removes it. A message is next when
its entry heads that list. An id left at the head by an entry that is gone (deleted by a process
that did not keep the list) is dropped by the first worker that finds it, so a session is never
held up by a message nobody holds.
"""

from __future__ import annotations

from redis.asyncio import Redis

# A list whose entries nobody acknowledges (written while a process that does not keep it ran) ends.
ORDER_TTL_S = 7 * 86_400

# KEYS: the inbound stream, the session's order list, the route. ARGV: the payload, the session key,
# the list's TTL, "1" when the route is to be set, this process, the route's TTL.
_PUBLISH_INBOUND = """
local id = redis.call('XADD', KEYS[1], '*', 'event', ARGV[1], 'session', ARGV[2])
redis.call('RPUSH', KEYS[2], id)
redis.call('EXPIRE', KEYS[2], ARGV[3])
if ARGV[4] == '1' then redis.call('SET', KEYS[3], ARGV[5], 'EX', ARGV[6]) end
return id
"""


class SessionOrder:
    """The order lists of one namespace."""

    def __init__(self, client: Redis, namespace: str) -> None:
        self._client = client
        self._ns = namespace
        self._publish = client.register_script(_PUBLISH_INBOUND)

    def key(self, session_key: str) -> str:
        return f"{self._ns}:order:{session_key}"

    async def publish(self, stream: str, payload: str, session_key: str, *, route: str, process: str | None,
                      route_ttl_s: int) -> None:
        """Add the entry and its place in the session's order; set `route` -> `process` if one is given."""
        await self._publish(keys=[stream, self.key(session_key), route],
                            args=[payload, session_key, ORDER_TTL_S, int(process is not None), process or "",
                                  route_ttl_s])

    async def earlier(self, stream: str, session_key: str, entry_id: str) -> bool:
        """Whether an entry of the session added before `entry_id` is not acknowledged yet."""
        key = self.key(session_key)
        while True:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.lindex(key, 0)
                pipe.lpos(key, entry_id)
                head, mine = await pipe.execute()
            # Not in the list at all: added by a process that did not keep it, so it waits for nothing.
            if head is None or mine is None or head == entry_id:
                return False
            if await self._client.xrange(stream, head, head, count=1):
                return True
            await self._client.lrem(key, 1, head)
