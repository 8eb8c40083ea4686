"""Which gateway session holds a conversation, for clients that send the whole of it each time
and name no session: one digest per session, of its conversation as the client last saw it.

A digest is taken when a request continues its session, so a second request with the same
history (sent twice at once, or a regenerated answer) finds none and starts a session of its
own; it is put back, advanced, once the turn has answered.
"""

from __future__ import annotations

import time

from sqlalchemy import bindparam, delete, select

from ember.store import schema
from ember.store.engine import Database
from ember.store.tx import Statement, Tx, upsert_row

_d, _s = schema.conversation_digests, schema.sessions
_HOLDER = Statement(select(_d.c.session_key).select_from(_d.join(_s, _s.c.key == _d.c.session_key))
                    .where(_d.c.owner == bindparam("owner"), _d.c.digest == bindparam("digest"))
                    .order_by(_d.c.updated_at.desc()).limit(1))
_TAKE = Statement(delete(_d).where(_d.c.session_key == bindparam("key")))
_PUT = upsert_row(_d, ["session_key"])


class SqlConversationIndex:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def take(self, owner: str, digest: str) -> str | None:
        """The session of `owner` whose conversation has `digest`, its digest taken away (until
        `put` gives it a new one); None when there is none."""
        def write(tx: Tx) -> str | None:
            row = tx.execute(_HOLDER, {"owner": owner, "digest": digest}).fetchone()
            if row is None:
                return None
            tx.execute(_TAKE, {"key": row[0]})
            return str(row[0])

        return await self._db.run_write(write)

    async def put(self, owner: str, session_key: str, digest: str) -> None:
        """Record that `owner`'s session `session_key` now holds the conversation `digest`."""
        row = {"session_key": session_key, "owner": owner, "digest": digest, "updated_at": time.time()}

        def write(tx: Tx) -> None:
            tx.execute(_PUT, row)

        await self._db.run_write(write)
