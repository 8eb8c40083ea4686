"""What the agent remembers about a session, as the prompt sees it."""

from __future__ import annotations

import asyncio

from ember.core.messages import Session
from ember.memory.embeddings import Embedder
from ember.store.memories import SqlMemoryStore

EPISODES_IN_SNAPSHOT = 5
FACTS_IN_SNAPSHOT = 20
EMBED_BATCH = 64


class MemoryService:
    """Caches each session's memory snapshot until something new is learned.

    A stable snapshot keeps the system prompt byte-identical across turns
    (providers cache such prefixes). It is rebuilt when consolidation or a
    review in this process clears it, and whenever the session's boundary
    moved, which also catches a consolidation run by another process.
    """

    def __init__(self, memories: SqlMemoryStore, embedder: Embedder) -> None:
        self._memories = memories
        self._embedder = embedder
        self._snapshots: dict[str, tuple[int, str]] = {}
        self._embeddings_pending = False

    async def open(self) -> None:
        self._embeddings_pending = await self._memories.count_without_embedding() > 0

    async def snapshot(self, session: Session) -> str:
        cached = self._snapshots.get(session.key)
        if cached is None or cached[0] != session.last_consolidated:
            cached = self._snapshots[session.key] = (session.last_consolidated, await self._build(session.key))
        return cached[1]

    def clear_snapshot(self, session_key: str) -> None:
        self._snapshots.pop(session_key, None)

    def note_new_memory(self, session_key: str | None) -> None:
        self._embeddings_pending = True
        if session_key is not None:
            self.clear_snapshot(session_key)

    @property
    def embeddings_pending(self) -> bool:
        """New memories arrived since the last flush was scheduled."""
        return self._embeddings_pending

    def embeddings_scheduled(self) -> None:
        self._embeddings_pending = False

    async def remember(self, kind: str, contents: list[str], *, session_key: str) -> int:
        """Store new memories in one transaction, skipping ones already known,
        so a retried review adds nothing twice. Returns how many were new."""
        added = await self._memories.add_new(kind, contents, session_key=session_key)
        if added:
            self.note_new_memory(session_key)
        return added

    async def flush_embeddings(self) -> int:
        """Embed every memory still without a vector; returns how many."""
        done = 0
        while batch := await self._memories.without_embedding(EMBED_BATCH):
            vectors = await asyncio.to_thread(self._embedder.embed, [record.content for record in batch])
            await self._memories.set_embeddings({r.id: v for r, v in zip(batch, vectors)})
            done += len(batch)
        return done

    async def _build(self, session_key: str) -> str:
        episodes = await self._memories.recent(session_key, ("episodic",), EPISODES_IN_SNAPSHOT)
        facts = await self._memories.recent(session_key, ("fact",), FACTS_IN_SNAPSHOT)
        parts = []
        if episodes:
            parts.append("Earlier in this conversation:\n" + "\n".join(f"- {e.content}" for e in reversed(episodes)))
        if facts:
            parts.append("What you know about the user:\n" + "\n".join(f"- {f.content}" for f in reversed(facts)))
        return "\n\n".join(parts)
