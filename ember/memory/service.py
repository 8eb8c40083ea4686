"""What the agent remembers about a session, as the prompt sees it."""

from __future__ import annotations

import asyncio

from ember.memory.embeddings import Embedder
from ember.store.memories import SqlMemoryStore

EPISODES_IN_SNAPSHOT = 5
FACTS_IN_SNAPSHOT = 20
EMBED_BATCH = 64


class MemoryService:
    """Caches each session's memory snapshot until something new is learned.

    The snapshot is cleared when consolidation or a review for that session
    completes, so the next ContextStage rebuilds it from the store.
    """

    def __init__(self, memories: SqlMemoryStore, embedder: Embedder) -> None:
        self._memories = memories
        self._embedder = embedder
        self._snapshots: dict[str, str] = {}
        self._embeddings_pending = False

    async def open(self) -> None:
        self._embeddings_pending = await self._memories.count_without_embedding() > 0

    async def snapshot(self, session_key: str) -> str:
        cached = self._snapshots.get(session_key)
        if cached is None:
            cached = self._snapshots[session_key] = await self._build(session_key)
        return cached

    def clear_snapshot(self, session_key: str) -> None:
        self._snapshots.pop(session_key, None)

    def has_snapshot(self, session_key: str) -> bool:
        return session_key in self._snapshots

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

    async def remember(self, kind: str, content: str, *, session_key: str | None) -> None:
        await self._memories.add(kind, content, session_key=session_key)
        self.note_new_memory(session_key)

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
