"""The memory service: write, search, recall for the prompt, forget.

Search is hybrid: the identity's full-text matches (BM25) and the similarity
of its vectors are fused by score (memory/retrieval.py), then weighed by
strength. A person with many memories is searched through derived indexes
(text_index.py, ann.py) that propose the candidates; below that, FTS5 and a
scan of every vector. No model is asked at query time. While vectors are
pending (the embedding job has not run yet) search is lexical, and nothing is
lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Unpack

import numpy as np

from ember.core.errors import MemoryInputError, ModelError
from ember.core.memory import (
    LexicalHits,
    MemoryFields,
    MemoryKind,
    MemoryRecord,
    MemoryStatus,
    NewMemory,
    Recalled,
    WriteOutcome,
    memory_identity,
    session_identity,
    shared_identity,
)
from ember.core.messages import Session
from ember.memory.embeddings import Embedder
from ember.memory.encoder import Encoder, bounded_query, vector_blob, window_vector
from ember.memory.forgetting import FADING_KINDS, ForgettingPolicy
from ember.memory.identity import Identities
from ember.memory.prompt import PromptMemory, RecallBudget, chosen
from ember.memory.retrieval import FACT_BONUS, NAMED_SUBJECT_BONUS, STRENGTH_WEIGHT, Reranker, fuse, named_subject
from ember.memory.text_index import INDEX_MIN_ROWS, TextIndex
from ember.memory.vectors import DatabaseVectors, DenseIndex, VectorIndex
from ember.store.memory_rows import Unembedded
from ember.store.protocols import MemoryStore
from ember.store.segment import match_expression, query_terms

log = logging.getLogger(__name__)

# Memories embedded per step: the background yields to the store and the loop between steps.
EMBED_BATCH = 8
# The longest a turn waits for its query's vector before recalling by words alone.
QUERY_WAIT_S = 3.0
# The recall counts are written every turn; the sweep for what faded, once in this many seconds.
DECAY_EVERY_S = 3_600.0
MAX_LIMIT = 100
# Matches read from the text index (the vectors add their own nearest: vectors.py).
LEXICAL_DEPTH = 200
CANDIDATES = 50


# Skills reach the prompt through their own index, not as recalled memories.
RECALLED_KINDS = (MemoryKind.FACT, MemoryKind.EPISODIC, MemoryKind.ARCHIVAL)


class MemoryService:
    def __init__(self, store: MemoryStore, embedder: Embedder | None, *, identities: Identities | None = None,
                 forgetting: ForgettingPolicy | None = None, reranker: Reranker | None = None,
                 index_min_rows: int = INDEX_MIN_ROWS, clock: Callable[[], float] = time.time) -> None:
        """`index_min_rows`: from how many memories a person's search goes through the derived
        indexes (text_index.py, ann.py) rather than FTS5 and a scan of every vector."""
        self._store = store
        self._text = TextIndex(store, min_rows=index_min_rows)
        self._embedder = embedder
        self._encoder = Encoder(embedder) if embedder is not None else None
        self._identities = identities or Identities()
        self._forgetting = forgetting or ForgettingPolicy()
        self._reranker = reranker
        self._clock = clock
        self._vectors: DenseIndex | None = None
        if embedder is not None:
            dense = DatabaseVectors if store.scores_vectors else VectorIndex
            self._vectors = dense(store, embedder.name, embedder.dimensions, ann_min_rows=index_min_rows)
        # Recalls not yet written: (identity, id) -> (times, last time). The upkeep job writes them,
        # off the commit path; a crash loses only these counts.
        self._recalls: dict[tuple[str, str], tuple[int, float]] = {}
        # Two embedding jobs (one queued while another ran) would embed the same rows twice.
        self._embedding = asyncio.Lock()
        self._upkeep = asyncio.Lock()
        self._decayed_at = -DECAY_EVERY_S

    @property
    def _relevance_floor(self) -> float:
        return self._embedder.relevance_floor if self._embedder is not None else 0.0

    @property
    def store(self) -> MemoryStore:
        return self._store

    async def open(self) -> None:
        """A change of embedding model queues every memory for a new vector. The embedder gets ready
        in the background."""
        if self._encoder is not None:
            self._encoder.prepare()
        if self._embedder is not None:
            requeued = await self._store.forget_other_models(self._embedder.name)
            if requeued:
                log.info("embedding model is now %s: %d memories queued for new vectors", self._embedder.name,
                         requeued)

    async def prepare(self, identity: str) -> None:
        """Build the identity's derived indexes now (a search otherwise starts them in the background)."""
        await self._text.prepare(identity)
        if self._vectors is not None:
            await self._vectors.prepare(identity)

    async def close(self) -> None:
        """Stop building the derived indexes."""
        await self._text.close()
        if self._vectors is not None:
            await self._vectors.close()
        if self._encoder is not None:
            self._encoder.close()

    # -- writing -------------------------------------------------------------------

    async def remember(self, identity: str, content: str, **fields: Unpack[MemoryFields]) -> WriteOutcome:
        """A fact the person states, unless `fields` say otherwise (NewMemory's defaults)."""
        return await self._store.write(NewMemory(identity=identity, content=content, **fields))

    async def remember_many(self, memories: Sequence[NewMemory]) -> list[WriteOutcome]:
        return await self._store.write_many(memories)

    async def forget(self, identity: str, memory_id: str) -> MemoryRecord:
        """Archive: never injected again, still found with --all. Only purge deletes."""
        return await self._store.set_status(identity, memory_id, MemoryStatus.ARCHIVED)

    # -- searching -----------------------------------------------------------------

    async def search(self, identity: str, query: str, *, limit: int = 10, include_inactive: bool = False,
                     kinds: Sequence[MemoryKind] = (), relevant_only: bool = True) -> list[Recalled]:
        """The identity's memories best matching `query`, best first.

        `relevant_only` leaves out memories that share no word with the query
        and are not close to it in meaning either; without it every memory is
        ranked (a retrieval benchmark measures the ranking).
        """
        if not 1 <= limit <= MAX_LIMIT:
            raise MemoryInputError(f"limit must be between 1 and {MAX_LIMIT}; it was {limit}")
        query = bounded_query(query)
        terms = query_terms(query)
        if not terms:
            raise MemoryInputError("the query has no words to search for")
        # Deeper than the page: some candidates may be of another kind or no longer active.
        depth = 3 * limit + CANDIDATES
        # The text index is read, with the records of its best hits, while the query is embedded;
        # the vectors then add what is near it, whose records are read if the words missed them.
        lexical, vector = await asyncio.gather(self._lexical(identity, terms, depth), self._embed_query(query))
        dense = None
        if vector is not None and self._vectors is not None:
            dense = await self._vectors.scores(identity, vector, also=[num for num, _ in lexical.scores])
        candidates = fuse(lexical.scores, dense, depth=depth)
        records = dict(lexical.records)
        missing = [c.num for c in candidates if c.num not in records]
        if missing:
            records.update(await self._store.by_nums(identity, missing))
        floor, now = self._relevance_floor, self._clock()
        named = named_subject(query, {record.subject for record in records.values()})
        hits = []
        for candidate in candidates:
            record = records.get(candidate.num)
            if record is None or (kinds and record.kind not in kinds):
                continue
            if not include_inactive and record.status is not MemoryStatus.ACTIVE:
                continue
            if relevant_only and not candidate.matched_words and candidate.similarity < floor:
                continue
            score = (candidate.score + (NAMED_SUBJECT_BONUS if named and record.subject == named else 0.0)
                     + (FACT_BONUS if record.kind is MemoryKind.FACT else 0.0))
            weight = 1.0 - STRENGTH_WEIGHT + STRENGTH_WEIGHT * self._forgetting.strength(record, now)
            hits.append(Recalled(record, score * weight, candidate.matched_words, candidate.similarity))
        hits.sort(key=lambda hit: (-hit.score, -hit.record.created_at))
        if self._reranker is not None:
            hits = self._reranker.rerank(query, hits)
        return hits[:limit]

    async def _lexical(self, identity: str, terms: list[str], records: int) -> LexicalHits:
        found = await self._text.lexical(identity, terms, LEXICAL_DEPTH)
        if found is not None:
            return LexicalHits(found)
        return await self._store.lexical(identity, terms, LEXICAL_DEPTH, records=records)

    async def _embed_query(self, query: str) -> np.ndarray | None:
        if self._encoder is None:
            return None
        try:
            return await asyncio.wait_for(self._encoder.query(query), QUERY_WAIT_S)
        except (TimeoutError, ModelError) as exc:
            log.warning("recall by words alone: the query's vector %s", "took too long" if isinstance(
                exc, TimeoutError) else f"failed ({exc})")
            return None

    async def for_prompt(self, identity: str, message: str, *, budget: RecallBudget, session_key: str = "",
                         episodes: int = 0, exclude: Callable[[MemoryRecord], bool] = lambda _: False) -> PromptMemory:
        """Profile facts (stable order, so the prompt prefix stays cacheable), the session's latest
        `episodes` summaries, then the memories the message recalls, within the budget. Each
        recall is counted."""
        message = bounded_query(message)
        # The profile is read while the message searches: neither waits for the other.
        (profile, summaries), hits = await asyncio.gather(
            self._profile_and_episodes(identity, budget.profile_facts, session_key, episodes),
            self._recall(identity, message, budget))
        recalled, used_ids = chosen(hits, budget, self._relevance_floor, {record.id for record in profile}, exclude)
        self._note_recalled(identity, used_ids)
        return PromptMemory(tuple(profile), tuple(recalled), tuple(summaries))

    async def _recall(self, identity: str, message: str, budget: RecallBudget) -> list[Recalled]:
        if match_expression(message) is None:
            return []
        return await self.search(identity, message, limit=budget.search_limit, kinds=RECALLED_KINDS)

    async def episodes(self, identity: str, session_key: str, limit: int) -> list[MemoryRecord]:
        """The session's latest consolidation summaries, oldest first: the person's
        own, or the group's when the session is shared (its members saw it all)."""
        return (await self._profile_and_episodes(identity, 0, session_key, limit))[1]

    async def _profile_and_episodes(self, identity: str, facts: int, session_key: str,
                                    limit: int) -> tuple[list[MemoryRecord], list[MemoryRecord]]:
        if not facts and not (session_key and limit):
            return [], []
        owners = (identity, shared_identity(session_key)) if session_key and limit else ()
        profile, found = await self._store.prompt_records(identity, facts, owners, session_key, limit)
        return profile, sorted(found, key=lambda record: record.created_at)[-limit:] if limit else []

    def _note_recalled(self, identity: str, ids: Sequence[str]) -> None:
        now = self._clock()
        for id_ in ids:
            times, _ = self._recalls.get((identity, id_), (0, now))
            self._recalls[(identity, id_)] = (times + 1, now)

    @property
    def recalls_pending(self) -> bool:
        return bool(self._recalls)

    # -- background jobs -------------------------------------------------------------

    async def archive_session(self, session_key: str) -> int:
        """Copy the session's new messages into the archival tier (the searchable
        history), each into the memory of the person whose turn it was."""
        # Embedded here, before the archive's job completes (a crash re-runs it, and this finds
        # them still waiting): a job of their own would cost a claim, reads and a completion a turn.
        # The first batch to embed is read in the archive's own transaction.
        inline = self._encoder is not None
        archived = await self._store.archive_session(session_key, self._identities.resolve, queue_embedding=not inline,
                                                     pending=EMBED_BATCH if inline else 0)
        if archived.pending:
            try:
                await self.flush_embeddings(first=archived.pending)
            except ModelError as exc:  # the archive holds; the embedding job retries with its backoff
                log.warning("archived %d messages; embedding them later: %s", archived.count, exc)
                await self._store.queue_embedding()
        return archived.count

    async def turn_owners(self, session: Session) -> dict[str, str]:
        """turn id -> the identity of the person who sent that turn's message."""
        return {turn: memory_identity(self._identities.resolve(channel, sender), session.metadata)
                for turn, (channel, sender) in (await self._store.senders(session.key)).items()}

    async def turn_owner(self, session: Session, turn_id: str | None) -> str:
        """The identity of the person who sent a turn's message."""
        found = (await self.turn_owners(session)).get(turn_id or "")
        return found or memory_identity(session_identity(session.key, session.metadata), session.metadata)

    async def owner(self, session: Session) -> str:
        """Whose memory a session's summary joins: its one participant's, or, when
        several people wrote in it (a group chat), the session's own shared
        identity, so no member's personal memory takes in another's words."""
        people = set((await self.turn_owners(session)).values())
        if len(people) > 1:
            return memory_identity(shared_identity(session.key), session.metadata)
        return people.pop() if people else memory_identity(session_identity(session.key, session.metadata),
                                                            session.metadata)

    async def workspace_owner(self, session_key: str, identity: str) -> str:
        """Whose workspace a turn of `identity` works in: theirs, or, once someone else
        wrote in the session too (a group chat), the group's shared identity, the
        one `owner` gives its summaries."""
        senders = (await self._store.senders(session_key)).values()
        if any(self._identities.resolve(channel, sender) != identity for channel, sender in senders):
            return shared_identity(session_key)
        return identity

    async def flush_embeddings(self, progress: Callable[[int], None] | None = None, *,
                               first: Sequence[Unembedded] = ()) -> int:
        """Embed every memory still without a vector, in batches, beginning with `first` (read by
        the caller); returns how many."""
        if self._encoder is None:
            return 0
        async with self._embedding:
            return await self._embed_pending(self._encoder, progress, list(first))

    async def _embed_pending(self, encoder: Encoder, progress: Callable[[int], None] | None,
                             first: list[Unembedded]) -> int:
        """Each memory's own text is embedded once; its window vector is made of its own and its
        neighbours' vectors (which are memories of their own, embedded once too)."""
        done, more = 0, True
        while more and (batch := first or await self._store.unembedded(EMBED_BATCH)):
            first = []
            contexts = [item.context for item in batch]
            vectors = await encoder.passages([text for item, context in zip(batch, contexts) for text in (
                item.content, *(context.adjacent + context.far if context is not None else ()))])
            rows = []
            for item, context in zip(batch, contexts):
                own = vectors[item.content]
                window = None if context is None else window_vector(
                    own, [vectors[t] for t in context.adjacent], [vectors[t] for t in context.far])
                rows.append((item, vector_blob(own), vector_blob(window) if window is not None else None))
            stored = await self._store.set_vectors(encoder.embedder.name, rows)
            done += stored
            # A short batch was the last, unless a row's neighbours changed meanwhile and it waits again.
            more = len(batch) == EMBED_BATCH or stored < len(batch)
            if progress is not None:
                progress(done)
        return done

    async def upkeep(self) -> tuple[int, int]:
        """Write the recalls counted since the last run (each strengthens its memory), then, at
        most once in DECAY_EVERY_S, archive what faded below the threshold. Returns (recalls, archived).

        One at a time: a sweep must see the recalls written before it."""
        async with self._upkeep:
            written = await self._write_recalls()
            now = self._clock()
            if now - self._decayed_at < DECAY_EVERY_S:
                return written, 0
            self._decayed_at = now
            candidates = await self._store.decay_candidates(FADING_KINDS)
            # Recalled since the recalls were taken: not faded, whatever the stored record says.
            faded = [r.id for r in candidates
                     if self._forgetting.fades_out(r, now) and (r.identity, r.id) not in self._recalls]
            await self._store.set_strengths({r.id: round(self._forgetting.strength(r, now), 4) for r in candidates},
                                            faded)
            return written, len(faded)

    async def _write_recalls(self) -> int:
        recalls, self._recalls = self._recalls, {}
        try:
            if recalls:
                await self._store.note_recalls(recalls)
        except BaseException:
            for key, (times, last) in recalls.items():  # counted again by the next run
                earlier, _ = self._recalls.get(key, (0, last))
                self._recalls[key] = (earlier + times, last)
            raise
        return len(recalls)
