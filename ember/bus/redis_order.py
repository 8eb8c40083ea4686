"""A session's messages answered in the order they were sent, whichever workers take them.

Two workers may each take one of two messages of a session sent back to back; if the first's
worker dies, the second would be answered before the first is taken over. So every inbound
entry also takes its place, in the same step as the entry (one Lua script), in its session's list
`{ns}:order:{session_key}`, as "<entry id> <message>", and acknowledging the entry removes it. A
message waits while an entry of another message is before it in that list.

The order is by message, not by entry: a message can have several entries (a client's retry,
start-up recovery publishing again what a dead process held). A copy takes the place of the
message's first entry, so it never waits behind itself, and once the message is handled every
entry of it leaves the list. An entry found in the list but gone from the stream (deleted by a
process that did not keep the list, or by hand) is dropped, so that nobody waits for it; an entry
missing from the list (written by such a process) waits for nothing.
"""

from __future__ import annotations

from redis.asyncio import Redis

# A list whose entries nobody acknowledges (written while a process that does not keep it ran) ends.
ORDER_TTL_S = 7 * 86_400

# KEYS: the inbound stream, the session's order list, the route. ARGV: the payload, the session key,
# the message, the list's TTL, "1" when the route is to be set, this process, the route's TTL.
_PUBLISH = """
local id = redis.call('XADD', KEYS[1], '*', 'event', ARGV[1], 'session', ARGV[2], 'message', ARGV[3])
redis.call('RPUSH', KEYS[2], id .. ' ' .. ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
if ARGV[5] == '1' then redis.call('SET', KEYS[3], ARGV[6], 'EX', ARGV[7]) end
return id
"""

# Splits a list item into its entry id and its message.
_PARTS = """
local function parts(item)
  local sep = string.find(item, ' ', 1, true)
  if not sep then return item, '' end
  return string.sub(item, 1, sep - 1), string.sub(item, sep + 1)
end
"""

# KEYS: the stream, the order list. ARGV: the entry, its message. 1 when an entry still in the stream
# is before the message's first entry; entries found gone on the way are dropped from the list.
_EARLIER = _PARTS + """
local items = redis.call('LRANGE', KEYS[2], 0, -1)
local mine, place = false, nil
for i, item in ipairs(items) do
  local id, message = parts(item)
  if id == ARGV[1] then mine = true end
  if not place and (id == ARGV[1] or (ARGV[2] ~= '' and message == ARGV[2])) then place = i end
end
if not mine then return 0 end
for i = 1, place - 1 do
  local id = parts(items[i])
  if #redis.call('XRANGE', KEYS[1], id, id) > 0 then return 1 end
  redis.call('LREM', KEYS[2], 1, items[i])
end
return 0
"""

# KEYS: the stream, the order list. ARGV: the consumer group, the entry, its message. The entry
# acknowledged and deleted; it and every other entry of its message leave the list.
_DONE = _PARTS + """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
for _, item in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  local id, message = parts(item)
  if id == ARGV[2] or (ARGV[3] ~= '' and message == ARGV[3]) then redis.call('LREM', KEYS[2], 1, item) end
end
return 1
"""


def message_of(channel: str, chat_id: str, message_id: str | None) -> str:
    """What makes two entries the same message, as the inbox's receipts see it; "" without an id."""
    return "" if message_id is None else f"{channel}\x1f{chat_id}\x1f{message_id}"


class SessionOrder:
    """The order lists of one namespace."""

    def __init__(self, client: Redis, namespace: str) -> None:
        self._ns = namespace
        self._publish = client.register_script(_PUBLISH)
        self._earlier = client.register_script(_EARLIER)
        self._done = client.register_script(_DONE)

    def key(self, session_key: str) -> str:
        return f"{self._ns}:order:{session_key}"

    async def publish(self, stream: str, payload: str, session_key: str, message: str, *, route: str,
                      process: str | None, route_ttl_s: int) -> None:
        """Add the entry and its place in the session's order; set `route` -> `process` if one is given."""
        await self._publish(keys=[stream, self.key(session_key), route],
                            args=[payload, session_key, message, ORDER_TTL_S, int(process is not None),
                                  process or "", route_ttl_s])

    async def earlier(self, stream: str, session_key: str, entry_id: str, message: str) -> bool:
        """Whether an entry of another message of the session, added before `entry_id`, is not done yet."""
        return bool(await self._earlier(keys=[stream, self.key(session_key)], args=[entry_id, message]))

    async def done(self, stream: str, group: str, session_key: str, entry_id: str, message: str) -> None:
        """Acknowledge and delete the entry; its message leaves the session's order."""
        await self._done(keys=[stream, self.key(session_key)], args=[group, entry_id, message])
