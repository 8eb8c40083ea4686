"""Stateless OpenAI clients keep their conversation.

Most chat front-ends send the whole conversation with every request and name no session. The
messages before the new one then say which session it continues: the one whose conversation, as
this caller last saw it, has the same digest. Found, the new message continues it; else a new
session starts, seeded with those messages as the client supplied them. Once the turn has
answered, the session's digest is that of the conversation the client now holds (what it sent,
and the answer as it was shown), so the next request finds it again.

Only user and assistant messages with text make the conversation (system, developer and tool
messages do not: Ember has its own system prompt and tools); whitespace is not part of it, since
clients trim answers and rewrite line ends. A client that edits an earlier message, regenerates an
answer, or sends the same history twice at once branches into a new session: the digest a
request continues is taken from its session until the turn has answered, so two requests never
continue one conversation twice. A turn that failed leaves its session without a digest: sent
again, the conversation starts a new session seeded with it. The digest is the caller's: one
identity's history never continues another's session.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ember.channels.gateway.schemas import ChatMessage
from ember.channels.gateway.turns import namespace, session_key
from ember.core.errors import StoreError
from ember.core.messages import Message, Role
from ember.store.protocols import ConversationIndex

log = logging.getLogger(__name__)

_KEPT = {"user": Role.USER, "assistant": Role.ASSISTANT}


def conversation(messages: Sequence[ChatMessage]) -> tuple[Message, ...]:
    """The request's messages as the session keeps them: user and assistant text."""
    kept = []
    for message in messages:
        role, text = _KEPT.get(message.role), message.text()
        if role is not None and text.strip():
            kept.append(Message(role=role, content=text, name=message.name if role is Role.USER else None))
    return tuple(kept)


def digest(owner: str, messages: Sequence[Message]) -> str:
    said = [[m.role.value, m.name or "", " ".join(m.content.split())] for m in messages]
    return hashlib.sha256(json.dumps([owner, said], ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Thread:
    """Where a request's conversation goes: the session `key`, and the messages it is seeded
    with when it starts there (none when it continues one)."""

    key: str
    earlier: tuple[Message, ...]
    seed: tuple[Message, ...]


class Conversations:
    """Finds the session a stateless request continues, and advances it once answered."""

    def __init__(self, index: ConversationIndex) -> None:
        self._index = index

    async def thread(self, identity: str, earlier: tuple[Message, ...]) -> Thread:
        if earlier:
            found = await self._index.take(identity, digest(identity, earlier))
            prefix = namespace(identity)
            if found is not None and found.startswith(prefix):
                return Thread(found.removeprefix(prefix), earlier, ())
        return Thread(uuid.uuid4().hex, earlier, earlier)

    async def answered(self, identity: str, thread: Thread, question: Message, shown: str) -> None:
        """The turn answered `question` with `shown` (as the client saw it): the conversation the
        client holds now leads to the session. A store that fails here loses no turn: the next
        request starts a new session, seeded with the whole conversation."""
        held = (*thread.earlier, question, Message.assistant(shown))
        try:
            await self._index.put(identity, session_key(identity, thread.key), digest(identity, held))
        except StoreError:
            log.warning("could not record the conversation of session %s; its next request starts another",
                        thread.key, exc_info=True)
