"""The derived indexes a person with many memories is searched through (tantivy for
text, faiss IVF for vectors), checked against the store's own full-text search (FTS5
on SQLite, tsvector on PostgreSQL) and full scan, on both engines."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from ember.core.memory import MemoryKind, MemoryStatus, NewMemory, remembered_in
from ember.core.messages import Message, Session
from ember.memory.embeddings import E5Embedder, Embedder, HashingEmbedder
from ember.memory.service import MemoryService
from ember.memory.text_index import TextIndex
from ember.memory.vectors import DenseScores, VectorIndex
from ember.store.engine import Database
from ember.store.memories import SqlMemoryStore
from ember.store.segment import query_terms
from ember.store.sessions import SqlSessionStore
from ember.store.tx import Statement
from tests.pgserver import ENGINES, engine_database
from tests.test_memory import FACTS, QUESTIONS

MIN_ROWS = 60
ROWS = 6_000  # a vector test's: several times the exact sample (vectors.SAMPLE_ROWS)
EXACT = 10**9  # never reached: FTS5 and a scan of every vector
_TOPICS = ["the weather in", "a recipe from", "the train to", "a film set in", "the museum of", "a song about",
           "the market in", "a book on", "the river near", "a hotel by"]
_PLACES = ["Oslo", "Lima", "Perth", "Quito", "Riga", "Turin", "Accra", "Hanoi", "Leeds", "Porto", "Cusco", "Bergen"]


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    database = await engine_database(request.param, request, tmp_path)
    yield database  # type: ignore[misc]
    await database.close()


def filler(count: int, seed: int = 0) -> list[str]:
    """Memories about other things, so the facts are a few among many."""
    rng = random.Random(seed)
    return [f"We talked about {rng.choice(_TOPICS)} {rng.choice(_PLACES)} on day {i}." for i in range(count)]


@functools.cache
def e5() -> Embedder:
    return E5Embedder()


async def person(db: Database, embedder: Embedder, identity: str = "alice", extra: int = 240) -> None:
    store = SqlMemoryStore(db)
    await store.write_many([NewMemory(identity=identity, content=text) for text in [*FACTS, *filler(extra)]])
    await MemoryService(store, embedder).flush_embeddings()


# SQLite only: E5 embedding 250 memories is most of its time, which PostgreSQL would double; there the
# same questions find their facts in test_memory.py, and the indexes read the store as the tests below do.
@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
async def test_questions_find_their_fact_through_the_derived_indexes_as_through_fts5(db: Database) -> None:
    await person(db, e5())
    derived = MemoryService(SqlMemoryStore(db), e5(), index_min_rows=MIN_ROWS)
    exact = MemoryService(SqlMemoryStore(db), e5(), index_min_rows=EXACT)
    await derived.prepare("alice")
    assert await derived._text.lexical("alice", ["mochi"], 5) is not None  # the derived index answers
    missed = []
    for question, expected in QUESTIONS:
        for name, service in (("derived", derived), ("exact", exact)):
            top = [hit.record.content for hit in await service.search("alice", question, limit=3)]
            if expected not in top:
                missed.append((name, question, top))
    assert not missed
    await derived.close()


async def test_a_memory_written_after_the_build_is_found_at_once_and_a_purge_is_not(db: Database) -> None:
    await person(db, HashingEmbedder())
    memory = MemoryService(SqlMemoryStore(db), HashingEmbedder(), index_min_rows=MIN_ROWS)
    await memory.prepare("alice")
    written = await memory.remember("alice", "The spare key is under the blue flowerpot.")
    found = await memory._text.lexical("alice", query_terms("where is the spare key?"), 5)
    assert found is not None and (await memory.store.by_nums("alice", [found[0][0]]))[found[0][0]].id == (
        written.record.id)
    await memory.flush_embeddings()
    assert (await memory.search("alice", "spare key flowerpot", limit=3))[0].record.id == written.record.id
    await memory.forget("alice", written.record.id)
    assert written.record.id not in [h.record.id for h in await memory.search("alice", "spare key flowerpot")]
    await memory.store.purge("alice", written.record.id)
    assert not [h for h in await memory.search("alice", "spare key flowerpot", include_inactive=True)
                if h.record.id == written.record.id]
    await memory.close()


async def test_a_sessions_memories_are_purged_with_it_and_no_other(db: Database) -> None:
    """What the demo's sessions left (a fact kept there with the remember tool, a summary made of
    one) is deleted for real, for every identity; a fact kept in another session stays."""
    await person(db, HashingEmbedder())
    memory = MemoryService(SqlMemoryStore(db), HashingEmbedder(), index_min_rows=MIN_ROWS)
    await memory.prepare("alice")
    kept = await memory.remember("alice", "The spare key is under the blue flowerpot.",
                                 source=remembered_in("cli:demo"))
    summary = await memory.remember("bob", "We talked about the spare key and the flowerpot.",
                                    kind=MemoryKind.EPISODIC, session_key="http:bob:demo")
    other = await memory.remember("alice", "The spare key of the shed is in the drawer.",
                                  source=remembered_in("cli:work"))
    assert await memory.store.purge_sessions(["cli:demo", "http:bob:demo"]) == 2
    assert await memory.store.purge_sessions(["cli:demo", "http:bob:demo"]) == 0
    await memory.flush_embeddings()
    found = [h.record.id for h in await memory.search("alice", "spare key flowerpot", include_inactive=True)]
    assert kept.record.id not in found and other.record.id in found
    assert not await memory.search("bob", "spare key flowerpot", include_inactive=True)
    assert summary.record.id not in [r.id for r in await memory.store.list("bob", include_inactive=True)]
    await memory.close()


async def test_one_persons_derived_index_never_holds_anothers_memories(db: Database) -> None:
    await person(db, HashingEmbedder(), "alice")
    store = SqlMemoryStore(db)
    await store.write_many([NewMemory(identity="bob", content=f"Bob's secret number {i} is with the otter.")
                            for i in range(MIN_ROWS)])
    memory = MemoryService(store, HashingEmbedder(), index_min_rows=MIN_ROWS)
    await memory.flush_embeddings()
    for identity in ("alice", "bob"):
        await memory.prepare(identity)
    assert not await memory.search("alice", "secret number otter", limit=20)
    assert {h.record.identity for h in await memory.search("bob", "secret number otter", limit=20)} == {"bob"}
    assert {h.record.identity for h in await memory.search("bob", "what cat is called Mochi", limit=20)} <= {"bob"}
    await memory.close()


async def test_a_backlog_is_read_in_the_background_while_fts5_answers(db: Database) -> None:
    await person(db, HashingEmbedder())
    store = SqlMemoryStore(db)
    index = TextIndex(store, min_rows=MIN_ROWS, inline_rows=10)
    assert await index.lexical("alice", ["mochi"], 5) is None  # the build has only started
    await index.prepare("alice")
    assert await index.lexical("alice", ["mochi"], 5)
    await store.write_many([NewMemory(identity="alice", content=f"An imported note {i} about kayaks.")
                            for i in range(30)])
    assert await index.lexical("alice", ["kayaks"], 50) is None  # more than inline_rows: caught up apart
    await index.prepare("alice")
    assert len(await index.lexical("alice", ["kayaks"], 50) or []) == 30
    await index.close()


async def test_an_archived_message_is_found_by_the_neighbour_that_came_later(db: Database) -> None:
    store = SqlMemoryStore(db)
    await store.write_many([NewMemory(identity="alice", content=text) for text in filler(MIN_ROWS)])
    memory = MemoryService(store, None, index_min_rows=MIN_ROWS)
    await memory.prepare("alice")
    sessions = SqlSessionStore(db)
    session = Session(key="cli:trip", metadata={"identity": "alice"})
    await sessions.append(session, [Message.user("Guess where I am going next month?")])
    await memory.archive_session(session.key)
    await sessions.append(await sessions.load(session.key), [Message.assistant("Tell me!"),
                                                             Message.user("Patagonia, to walk the glaciers.")])
    await memory.archive_session(session.key)
    # The question's own words say nothing of Patagonia; its text row was written again with its neighbours.
    hits = await memory.search("alice", "Patagonia", limit=5, kinds=(MemoryKind.ARCHIVAL,))
    assert "Guess where I am going next month?" in [hit.record.content for hit in hits]
    await memory.close()


# SQLite only: what it checks is faiss's index; its 6,000 memories, a round trip per statement, take
# some 40 s to write on PostgreSQL, whose vectors the index reads as the tests above do.
@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
async def test_the_nearest_vectors_are_proposed_and_scored_exactly(db: Database) -> None:
    store = SqlMemoryStore(db)
    rng = np.random.default_rng(7)
    centres = rng.standard_normal((20, 64)).astype(np.float32)
    vectors = centres[rng.integers(0, 20, ROWS)] + 0.3 * rng.standard_normal((ROWS, 64)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    await store.write_many([NewMemory(identity="alice", content=f"memory {i}") for i in range(ROWS)])
    pending = await store.unembedded(ROWS)
    await store.set_vectors("test-64", [(item, vector.tobytes(), None) for item, vector in zip(pending, vectors)])
    nums = [item.num for item in pending]
    index = VectorIndex(store, "test-64", 64, ann_min_rows=ROWS // 2)
    full = await index.scores("alice", vectors[0])  # every vector, while the index is built
    assert full is not None and len(full.nums) == ROWS
    await index.prepare("alice")
    query = vectors[123]
    dense = await index.scores("alice", query, also=[nums[5]])
    assert dense is not None and len(dense.nums) < ROWS // 2
    exact_top = set(np.argsort(-(vectors @ query))[:10].tolist())
    assert exact_top <= {nums.index(int(n)) for n in dense.nums}  # the query's own neighbours, all of them
    assert nums[5] in dense.rows  # and the rows asked for by number
    assert np.allclose(dense.own[dense.rows[nums[123]]], 1.0, atol=1e-5)  # exact, not the 8-bit codes
    # A vector written again moves in the index too.
    moved = -vectors[123]
    await db.run_write(lambda tx: tx.execute(
        Statement("UPDATE memory_items SET embedding_model = NULL WHERE num = :num"), {"num": nums[123]}))
    await store.set_vectors("test-64", [(pending[123], moved.astype(np.float32).tobytes(), None)])
    after = await index.scores("alice", moved)
    assert after is not None and np.isclose(after.own[after.rows[nums[123]]], 1.0, atol=1e-5)
    await index.close()


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
async def test_a_matrix_grown_search_by_search_scores_as_one_loaded_at_once(db: Database) -> None:
    """Each search adds the rows written since to the matrices in room kept for them (past
    vectors.MIN_ROOM, and past each doubling): every memory's scores are those of a matrix read
    whole, also after a vector is written again."""
    store = SqlMemoryStore(db)
    rng = np.random.default_rng(11)
    grown = VectorIndex(store, "test-16", 16, ann_min_rows=EXACT)
    query = rng.standard_normal(16).astype(np.float32)
    written = 0
    for batch in (1, 2, 3, 250, 7, 300, 1, 500):
        await store.write_many([NewMemory(identity="alice", content=f"memory {written + i}") for i in range(batch)])
        pending = await store.unembedded(batch)
        vectors = rng.standard_normal((batch, 16)).astype(np.float32)
        await store.set_vectors("test-16", [(item, vector.tobytes(), None) for item, vector in zip(pending, vectors)])
        written += batch
        assert (found := await grown.scores("alice", query)) is not None and len(found.nums) == written
    again = pending[0]
    await db.run_write(lambda tx: tx.execute(
        Statement("UPDATE memory_items SET embedding_model = NULL WHERE num = :num"), {"num": again.num}))
    await store.set_vectors("test-16", [(again, np.ones(16, dtype=np.float32).tobytes(), None)])
    mine, whole = await grown.scores("alice", query), await VectorIndex(
        store, "test-16", 16, ann_min_rows=EXACT).scores("alice", query)
    assert mine is not None and whole is not None
    def by_num(dense: DenseScores) -> dict[int, tuple[float, float]]:
        return {int(num): (float(dense.own[row]), float(dense.window[row])) for num, row in dense.rows.items()}

    assert by_num(mine) == by_num(whole) and len(by_num(mine)) == written  # a fresh load orders by revision
    assert np.isclose(mine.own[mine.rows[again.num]], query.sum())
    await grown.close()


async def test_searches_during_a_build_lose_nothing(db: Database) -> None:
    await person(db, HashingEmbedder(), extra=400)
    memory = MemoryService(SqlMemoryStore(db), HashingEmbedder(), index_min_rows=MIN_ROWS)
    results = await asyncio.gather(*(memory.search("alice", "what is my cat called Mochi", limit=3)
                                     for _ in range(20)))
    assert all(hits and hits[0].record.content == "My cat is called Mochi." for hits in results)
    await memory.prepare("alice")
    hits = await memory.search("alice", "what is my cat called Mochi", limit=3)
    assert hits[0].record.content == "My cat is called Mochi." and hits[0].record.status is MemoryStatus.ACTIVE
    await memory.close()


@pytest.mark.parametrize("threshold", [MIN_ROWS, EXACT])
async def test_a_restart_rebuilds_from_the_store(db: Database, threshold: int) -> None:
    await person(db, HashingEmbedder())
    first = MemoryService(SqlMemoryStore(db), HashingEmbedder(), index_min_rows=threshold)
    await first.prepare("alice")
    await first.remember("alice", "The boat is moored at pier nine.")
    await first.flush_embeddings()
    await first.close()
    again = MemoryService(SqlMemoryStore(db), HashingEmbedder(), index_min_rows=threshold)
    await again.prepare("alice")
    assert (await again.search("alice", "where is the boat moored", limit=1))[0].record.content == (
        "The boat is moored at pier nine.")
    await again.close()
