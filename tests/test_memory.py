"""Long-term memory through its service, on a real store (SQLite and PostgreSQL): writing,
supersession, recall (Chinese and English), per-person scope, forgetting."""

from __future__ import annotations

import datetime as dt
import functools
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

from ember.core.errors import MemoryInputError, MemoryNotFound
from ember.core.language import estimated_tokens
from ember.core.memory import MAX_CONTENT_CHARS, MemoryKind, MemoryStatus, NewMemory, SourceRank
from ember.core.messages import Message, Session
from ember.memory.embeddings import E5Embedder, Embedder, HashingEmbedder
from ember.memory.forgetting import DAY_S
from ember.memory.prompt import RecallBudget, recalled_text
from ember.memory.reconcile import FactReconciler
from ember.memory.service import MemoryService
from ember.memory.vectors import THREAD_ROWS
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store import archive_rows, memories, schema
from ember.store.engine import Database
from ember.store.memories import SqlMemoryStore
from ember.store.postgres import PostgresDatabase
from ember.store.sessions import SqlSessionStore
from ember.store.tx import Statement
from tests.pgserver import ENGINES, PgServer, engine_database


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@functools.cache
def e5() -> Embedder:
    return E5Embedder()


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    """Every test of the memory store runs on SQLite and on PostgreSQL."""
    database = await engine_database(request.param, request, tmp_path)
    yield database  # type: ignore[misc]
    await database.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def memory(db: Database, clock: Clock) -> MemoryService:
    service = MemoryService(SqlMemoryStore(db), HashingEmbedder(), clock=clock)
    await service.open()
    return service


@pytest.fixture
async def e5_memory(db: Database, clock: Clock) -> MemoryService:
    service = MemoryService(SqlMemoryStore(db), e5(), clock=clock)
    await service.open()
    return service


# Facts a person might tell an agent, and questions that ask for them in other words,
# in Chinese and English, some across the two languages.
FACTS = [
    "My cat is called Mochi.",
    "I work as a nurse at the Royal Infirmary.",
    "My daughter Emma turns seven in March.",
    "I am allergic to penicillin.",
    "I drive a blue Toyota Corolla.",
    "我喜欢吃花生。",
    "我住在上海浦东。",
    "我的生日是十月三号。",
    "我老板叫王强。",
    "I play the cello in a community orchestra on Thursdays.",
]
QUESTIONS = [
    ("what's my pet called?", "My cat is called Mochi."),
    ("where is my job?", "I work as a nurse at the Royal Infirmary."),
    ("how old will my kid be?", "My daughter Emma turns seven in March."),
    ("which medicine must I avoid?", "I am allergic to penicillin."),
    ("what car do I have?", "I drive a blue Toyota Corolla."),
    ("花生", "我喜欢吃花生。"),
    ("我住在哪里？", "我住在上海浦东。"),
    ("生日", "我的生日是十月三号。"),
    ("老板", "我老板叫王强。"),
    ("what instrument do I play?", "I play the cello in a community orchestra on Thursdays."),
    ("我的猫叫什么名字？", "My cat is called Mochi."),
    ("what snack do I like?", "我喜欢吃花生。"),
    ("which city do I live in?", "我住在上海浦东。"),
]


async def test_paraphrased_and_cross_language_questions_find_their_fact(e5_memory: MemoryService) -> None:
    for fact in FACTS:
        await e5_memory.remember("alice", fact)
    assert await e5_memory.flush_embeddings() == len(FACTS)
    missed = []
    for question, expected in QUESTIONS:
        top = [hit.record.content for hit in await e5_memory.search("alice", question, limit=3)]
        if expected not in top:
            missed.append((question, top))
    assert not missed


async def test_two_character_chinese_words_are_found_before_any_vector_exists(memory: MemoryService) -> None:
    await memory.remember("alice", "我喜欢吃花生酱三明治")
    await memory.remember("alice", "今天下雨了")
    for query in ("花生", "三明治", "下雨"):
        hits = await memory.search("alice", query)
        assert hits, query
        assert query in hits[0].record.content
    assert not await memory.search("alice", "咖啡")


async def test_the_same_subject_and_key_supersedes_and_keeps_the_history(memory: MemoryService) -> None:
    first = await memory.remember("alice", "I live in Paris.", subject="user", key="home_city")
    second = await memory.remember("alice", "I moved to Berlin.", subject="User", key="Home City")
    assert second.superseded == (first.record.id,)
    active = await memory.search("alice", "where do I live Paris Berlin")
    assert [hit.record.content for hit in active] == ["I moved to Berlin."]
    everything = {hit.record.content: hit.record.status for hit in
                  await memory.search("alice", "live Paris Berlin moved", include_inactive=True)}
    assert everything == {"I live in Paris.": MemoryStatus.SUPERSEDED, "I moved to Berlin.": MemoryStatus.ACTIVE}
    chain = await memory.store.history("alice", first.record.id)
    assert [r.content for r in chain] == ["I live in Paris.", "I moved to Berlin."]
    assert chain[0].superseded_by == second.record.id and chain[0].invalid_at is not None


async def test_an_inferred_fact_never_overrides_what_the_person_stated(memory: MemoryService) -> None:
    stated = await memory.remember("alice", "My favourite colour is green.", subject="user", key="colour")
    guessed = await memory.remember("alice", "The user's favourite colour is red.", subject="user", key="colour",
                                    source_rank=SourceRank.INFERRED)
    assert guessed.record.status is MemoryStatus.PENDING and not guessed.superseded
    assert (await memory.store.get("alice", stated.record.id)).status is MemoryStatus.ACTIVE
    assert [h.record.content for h in await memory.search("alice", "favourite colour")] == [
        "My favourite colour is green."]


async def test_the_same_content_is_remembered_once(memory: MemoryService) -> None:
    first = await memory.remember("alice", "My cat is called Mochi.")
    again = await memory.remember("alice", "  my cat is called MOCHI ")
    assert not again.created and again.record.id == first.record.id
    assert len(await memory.store.list("alice")) == 1
    # Another person may say the same thing: that is their own memory.
    assert (await memory.remember("bob", "My cat is called Mochi.")).created


async def test_one_persons_memory_never_reaches_another(memory: MemoryService) -> None:
    secret = await memory.remember("alice", "Alice's bank PIN hint is the lighthouse.")
    await memory.remember("bob", "Bob likes lighthouses.")
    assert [h.record.identity for h in await memory.search("bob", "lighthouse PIN hint", include_inactive=True)] \
        == ["bob"]
    assert all(r.identity == "bob" for r in await memory.store.list("bob", include_inactive=True))
    for attempt in (memory.store.get("bob", secret.record.id), memory.forget("bob", secret.record.id),
                    memory.store.history("bob", secret.record.id), memory.store.purge("bob", secret.record.id),
                    memory.store.get("Alice", secret.record.id)):
        with pytest.raises(MemoryNotFound):
            await attempt
    assert (await memory.store.get("alice", secret.record.id)).status is MemoryStatus.ACTIVE


async def test_vectors_of_one_person_never_rank_for_another(e5_memory: MemoryService) -> None:
    await e5_memory.remember("alice", "My cat is called Mochi.")
    await e5_memory.remember("bob", "I have no pets at all.")
    await e5_memory.flush_embeddings()
    hits = await e5_memory.search("bob", "what's my pet called?")
    assert [h.record.identity for h in hits] == ["bob"]


async def test_bad_input_gets_a_clear_error_and_stores_nothing(memory: MemoryService) -> None:
    for content, says in (("", "empty"), ("   \n", "empty"), ("x" * (MAX_CONTENT_CHARS + 1), "at most")):
        with pytest.raises(MemoryInputError, match=says):
            await memory.remember("alice", content)
    for query in ("", "?!…", "   "):
        with pytest.raises(MemoryInputError, match="no words"):
            await memory.search("alice", query)
    with pytest.raises(MemoryInputError, match="limit"):
        await memory.search("alice", "cat", limit=0)
    with pytest.raises(MemoryNotFound):
        await memory.forget("alice", "no-such-id")
    assert await memory.store.list("alice", include_inactive=True) == []


async def test_forget_archives_and_only_purge_deletes(memory: MemoryService) -> None:
    kept = await memory.remember("alice", "My cat is called Mochi.")
    await memory.flush_embeddings()
    await memory.forget("alice", kept.record.id)
    assert not await memory.search("alice", "cat Mochi")
    assert [h.record.status for h in await memory.search("alice", "cat Mochi", include_inactive=True)] == [
        MemoryStatus.ARCHIVED]
    await memory.store.purge("alice", kept.record.id)
    assert not await memory.search("alice", "cat Mochi", include_inactive=True)
    counts = await memory.store.consistency()
    assert counts["rows"] == counts["text_rows"] == 0 and counts["orphan_vectors"] == 0


async def test_the_vector_count_searches_check_is_kept_by_the_database(memory: MemoryService, db: Database) -> None:
    model = HashingEmbedder.name
    written = [await memory.remember("alice", text) for text in ("I sail.", "I knit.", "I bake bread.")]
    await memory.remember("bob", "I run.")
    await memory.flush_embeddings()
    (count, rev), rows = await memory.store.vectors_since("alice", model, 0)
    assert count == len(rows) == 3 and rev > 0 and (await memory.store.vectors_since("bob", model, 0))[0][0] == 1
    assert (await memory.store.vectors_since("alice", model, rev)) == ((3, rev), [])  # nothing new since
    await memory.store.purge("alice", written[0].record.id)
    assert (await memory.store.vectors_since("alice", model, rev))[0] == (2, rev)  # a search sees the purge: it reloads
    await db.run_write(lambda tx: tx.execute(
        Statement("UPDATE memory_vector_heads SET rows = 9 WHERE identity = 'bob'")))
    assert (await memory.store.consistency())["miscounted_vectors"] == 1  # `ember doctor` reports it
    await memory.store.reindex_text()
    assert (await memory.store.consistency())["miscounted_vectors"] == 0
    assert (await memory.store.vectors_since("bob", model, 0))[0][0] == 1


async def test_memories_fade_unless_recalled_and_stated_facts_last_longest(memory: MemoryService,
                                                                           clock: Clock) -> None:
    stated = await memory.remember("alice", "My cat is called Mochi.", created_at=clock.now)
    guessed = await memory.remember("alice", "The user seems to like jazz.", source_rank=SourceRank.INFERRED,
                                    created_at=clock.now)
    recalled = await memory.remember("alice", "The user plays chess on Sundays.", source_rank=SourceRank.INFERRED,
                                     created_at=clock.now)
    budget = RecallBudget(profile_facts=0)
    # Recalled twice within the month: each recall doubles its half-life from then on.
    for days in (10, 25):
        clock.now += (days - (clock.now - 1_800_000_000.0) / DAY_S) * DAY_S
        prompt = await memory.for_prompt("alice", "what about chess on sundays?", budget=budget)
        assert recalled.record.id in [r.id for r in prompt.recalled]
        await memory.upkeep()
    clock.now = 1_800_000_000.0 + 120 * DAY_S  # four half-lives of an inferred fact
    assert await memory.upkeep() == (0, 1)
    status = {r.id: r.status for r in await memory.store.list("alice", include_inactive=True)}
    assert status[guessed.record.id] is MemoryStatus.ARCHIVED
    assert status[recalled.record.id] is MemoryStatus.ACTIVE
    assert status[stated.record.id] is MemoryStatus.ACTIVE
    # Archived: no longer recalled into a prompt, still found with --all.
    prompt = await memory.for_prompt("alice", "does the user like jazz?", budget=budget)
    assert guessed.record.id not in [r.id for r in prompt.recalled]
    assert (await memory.search("alice", "jazz", include_inactive=True))[0].record.id == guessed.record.id
    record = await memory.store.get("alice", recalled.record.id)
    assert record.recall_count == 2 and record.last_recalled_at == pytest.approx(1_800_000_000.0 + 25 * DAY_S)
    clock.now = 1_800_000_000.0 + 4 * 365 * DAY_S
    await memory.upkeep()
    assert (await memory.store.get("alice", stated.record.id)).status is MemoryStatus.ARCHIVED


async def test_the_prompt_gets_stable_profile_facts_then_what_the_message_recalls(memory: MemoryService) -> None:
    await memory.remember("alice", "The user's name is Alice.", subject="user", key="name")
    await memory.remember("alice", "The user is vegetarian.", subject="user", key="diet")
    await memory.remember("alice", "Last spring the user hiked the Dolomites.")
    # A profile of two: the facts that name an attribute come first; the third is left to recall.
    budget = RecallBudget(profile_facts=2)
    first = await memory.for_prompt("alice", "plan a hiking trip", budget=budget)
    again = await memory.for_prompt("alice", "something else about hiking", budget=budget)
    assert [r.content for r in first.profile] == ["The user is vegetarian.", "The user's name is Alice."]
    assert first.profile == again.profile  # the cacheable prefix does not move
    assert [r.content for r in first.recalled] == ["Last spring the user hiked the Dolomites."]
    tiny = await memory.for_prompt("alice", "hiking", budget=RecallBudget(profile_facts=2, recalled_tokens=2))
    assert tiny.recalled == ()


async def test_the_prompt_carries_what_fits_its_tokens_each_line_once_and_no_nods(memory: MemoryService) -> None:
    async def said(content: str, session: str) -> None:
        await memory.remember("alice", content, kind=MemoryKind.ARCHIVAL, session_key=session)

    for n in range(12):
        await said(f"On hike {n} we climbed the ridge above the lake and watched the sunrise.", "cli:hikes")
    await said("We climbed the ridge above the lake again.", "cli:hikes")
    await said("We climbed the ridge above the lake again.", "cli:later")
    await said("ok", "cli:hikes")
    budget = RecallBudget(profile_facts=0, recalled_tokens=120)
    prompt = await memory.for_prompt("alice", "the ridge above the lake", budget=budget)
    recalled = [r.content for r in prompt.recalled]
    # Each line costs its tokens and its "- " (16 or 10), the day's date 8: seven fit in 120, not twelve.
    assert 6 <= len(recalled) <= 8
    assert estimated_tokens(recalled_text(prompt.recalled)) <= 120
    assert recalled.count("We climbed the ridge above the lake again.") == 1
    assert "ok" not in recalled


async def test_recalled_lines_are_shown_by_day_in_the_order_they_were_said(memory: MemoryService,
                                                                           clock: Clock) -> None:
    start = clock.now
    for at, line in [(2.1, "The Lisbon flat has a balcony."), (0, "I am looking at flats in Lisbon."),
                     (2, "We moved to Lisbon in the spring."), (1, "Lisbon rents are high this year.")]:
        await memory.remember("alice", line, kind=MemoryKind.ARCHIVAL, session_key="cli:moving",
                              created_at=start + at * DAY_S)
    prompt = await memory.for_prompt("alice", "Lisbon flat", budget=RecallBudget(profile_facts=0))
    assert len(prompt.recalled) == 4
    shown = recalled_text(prompt.recalled).splitlines()
    days = [dt.datetime.fromtimestamp(start + n * DAY_S, dt.UTC).strftime("%Y-%m-%d") for n in range(3)]
    assert shown == [f"[{days[0]}]", "- I am looking at flats in Lisbon.",
                     f"[{days[1]}]", "- Lisbon rents are high this year.",
                     f"[{days[2]}]", "- We moved to Lisbon in the spring.", "- The Lisbon flat has a balcony."]


async def test_chinese_lines_are_counted_in_tokens_not_in_characters(memory: MemoryService) -> None:
    line = "我们昨天在湖边的山脊上看日出，风景非常美丽，大家都拍了很多照片。"
    for n in range(10):
        await memory.remember("alice", f"{line}第{n}次", kind=MemoryKind.ARCHIVAL, session_key="cli:trips")
    budget = RecallBudget(profile_facts=0, recalled_tokens=200)
    recalled = (await memory.for_prompt("alice", "湖边的山脊 日出", budget=budget)).recalled
    # A line of 35 characters is about as many tokens, not 9 as characters / 4 would have it.
    assert estimated_tokens(line) >= 30
    assert 1 <= len(recalled) <= (200 - 8) // (estimated_tokens(line) + 1)  # a day heading, "- " a line


def test_tokens_are_estimated_as_a_subword_tokenizer_counts_them() -> None:
    assert estimated_tokens("Hello, world!") == 4
    assert estimated_tokens("internationalization") == 4  # long words are several pieces
    assert estimated_tokens("我今天去了北京") == 7
    assert estimated_tokens("") == 0


async def test_a_fact_outranks_a_chat_line_that_says_the_same(memory: MemoryService, clock: Clock) -> None:
    line = await memory.remember("alice", "I am allergic to peanuts.", kind=MemoryKind.ARCHIVAL,
                                 session_key="cli:lunch", created_at=clock.now)
    clock.now += DAY_S
    kept = await memory.remember("alice", "I am allergic to peanuts.", created_at=clock.now)
    other = await memory.remember("alice", "Peanuts are legumes, not nuts.", kind=MemoryKind.ARCHIVAL,
                                  session_key="cli:lunch", created_at=clock.now)
    await memory.flush_embeddings()
    clock.now += 30 * DAY_S  # the fact has faded a little; the line never does
    hits = await memory.search("alice", "am I allergic to peanuts?")
    assert [hit.record.id for hit in hits][:2] == [kept.record.id, line.record.id]
    assert other.record.id in [hit.record.id for hit in hits]


async def test_a_fact_the_person_stated_is_in_the_profile_without_a_subject_or_key(memory: MemoryService) -> None:
    await memory.remember("alice", "The user likes jazz.", subject="user", key="music",
                          source_rank=SourceRank.INFERRED)
    await memory.remember("alice", "I am allergic to peanuts.")
    await memory.remember("alice", "My sister lives in Lyon.")
    prompt = await memory.for_prompt("alice", "what do you know about me?", budget=RecallBudget())
    # Stated first, in the order they were said; then what was inferred. Each once: not recalled again.
    assert [r.content for r in prompt.profile] == ["I am allergic to peanuts.", "My sister lives in Lyon.",
                                                  "The user likes jazz."]
    assert not {r.id for r in prompt.recalled} & {r.id for r in prompt.profile}
    assert prompt.profile == (await memory.for_prompt("alice", "and now?", budget=RecallBudget())).profile
    assert (await memory.for_prompt("bob", "what do you know about me?", budget=RecallBudget())).profile == ()


# Vectors an engine cannot read, and how to make one of a memory (`:id`): on SQLite, a blob its processes
# decode (NaN, torn); on PostgreSQL, which scores vectors itself, pgvector's vector (none, another size).
UNREADABLE = {
    "sqlite": ("UPDATE memory_vectors SET vector = :garbled",
               [np.full(HashingEmbedder().dimensions, np.nan, dtype=np.float32).tobytes(), b"\x00\xff"]),
    "postgresql": ("UPDATE memory_vectors SET embedding = CAST(CAST(:garbled AS text) AS vector)", [None, "[1,2]"]),
}


async def garble(db: Database, memory_id: str | None, kind: int) -> None:
    """Make the vector of memory `memory_id` (None: every memory's) unreadable, the `kind`th way."""
    sql, values = UNREADABLE[db.dialect]
    where = " WHERE num = (SELECT num FROM memory_items WHERE id = :id)" if memory_id else ""
    await db.run_write(lambda tx: tx.execute(Statement(sql + where), {"garbled": values[kind], "id": memory_id}))


async def test_an_unreadable_vector_is_set_aside_and_embedded_again(memory: MemoryService, db: Database) -> None:
    kept = await memory.remember("alice", "My cat is called Mochi.")
    await memory.flush_embeddings()
    await garble(db, None, 1)
    hits = await memory.search("alice", "cat")
    assert [h.record.id for h in hits] == [kept.record.id]  # found by its words meanwhile
    assert (await memory.store.consistency())["unembedded"] == 1
    assert await memory.flush_embeddings() == 1
    blob = await db.run_read(lambda tx: tx.execute(Statement(select(schema.memory_vectors.c.vector))).fetchone()[0])
    assert np.frombuffer(blob, dtype=np.float32).shape == (HashingEmbedder().dimensions,)


async def test_a_whole_matrix_read_at_once_sets_its_unreadable_vectors_aside_too(db: Database) -> None:
    # Enough memories that the first search decodes them on a thread (vectors.THREAD_ROWS).
    memory = MemoryService(SqlMemoryStore(db), HashingEmbedder())
    await memory.open()
    outcomes = await memory.remember_many([NewMemory(identity="alice", content=f"note {i} about the garden shed")
                                           for i in range(THREAD_ROWS + 100)])
    mochi = await memory.remember("alice", "My cat is called Mochi.")
    await memory.flush_embeddings()
    for kind, outcome in enumerate(outcomes[:2]):
        await garble(db, outcome.record.id, kind)
    hits = await MemoryService(SqlMemoryStore(db), HashingEmbedder()).search("alice", "cat called Mochi")
    assert hits[0].record.id == mochi.record.id
    assert (await memory.store.consistency())["unembedded"] == 2


# 120 vectors scored by the database; 2,400, past the index's threshold: the process's index on both engines.
@pytest.mark.parametrize(("index_from", "days"), [(10_000, 5), (100, 100)])
async def test_postgresql_scores_vectors_as_sqlites_processes_do(request: pytest.FixtureRequest, tmp_path: Path,
                                                                index_from: int, days: int) -> None:
    """PostgreSQL scores a person's vectors itself, so no process holds them: the scores are those of
    SQLite's in-process matrices, for chat lines' windows too. A person with many memories is served by
    a process's nearest-vector index on both."""
    notes = [f"note {i}: the {word} was left by the {place} on day {day}" for i, (word, place, day) in enumerate(
        (w, p, d) for w in ("key", "cup", "map", "pen", "hat", "box") for p in ("door", "shed", "lake", "desk")
        for d in range(days))]
    queries = HashingEmbedder().embed_queries(["where is the key", "the map by the lake", "a hat"])
    found: dict[str, list[dict[int, tuple[float, float]]]] = {}
    for engine in ("sqlite", "postgresql"):
        db = await engine_database(engine, request, tmp_path)
        try:
            memory = MemoryService(SqlMemoryStore(db), HashingEmbedder(), index_min_rows=index_from)
            # Half as chat lines, whose window vectors read them between their neighbours; half as facts.
            await SqlSessionStore(db).append(Session(key="group:notes", metadata={"identity": "alice"}),
                                             [Message.user(note, name="Sam") for note in notes[::2]])
            await memory.archive_session("group:notes")
            await memory.remember_many([NewMemory(identity="alice", content=note) for note in notes[1::2]])
            await memory.remember("bob", "the key was left by the door")  # another's: never scored for alice
            await memory.flush_embeddings()
            dense = memory._vectors
            assert dense is not None
            await dense.prepare("alice")
            found[engine] = []
            for query in queries:
                scores = await dense.scores("alice", query)
                assert scores is not None
                found[engine].append({int(num): (float(scores.own[i]), float(scores.window[i]))
                                      for i, num in enumerate(scores.nums)})
        finally:
            await db.close()
    for sqlite, postgresql in zip(found["sqlite"], found["postgresql"], strict=True):
        if index_from > len(notes):
            assert sqlite.keys() == postgresql.keys() and len(postgresql) == len(notes)
        for side in (0, 1):  # the best five by each vector score alike (their order among ties aside)
            best = [sorted((scores[side] for scores in by_num.values()), reverse=True)[:5]
                    for by_num in (sqlite, postgresql)]
            assert best[0] == pytest.approx(best[1], abs=1e-5)
        for num in sqlite.keys() & postgresql.keys():
            assert postgresql[num] == pytest.approx(sqlite[num], abs=1e-5)


async def test_a_new_embedding_model_re_embeds_everything(db: Database, memory: MemoryService) -> None:
    await memory.remember("alice", "My cat is called Mochi.")
    await memory.flush_embeddings()

    class Other(HashingEmbedder):
        name = "other-model"

    replaced = MemoryService(SqlMemoryStore(db), Other(64))
    await replaced.open()
    assert (await replaced.store.consistency())["unembedded"] == 1
    assert await replaced.flush_embeddings() == 1
    models = await db.run_read(lambda tx: tx.execute(Statement("SELECT DISTINCT model FROM memory_vectors")).fetchall())
    assert models == [("other-model",)]


async def test_an_import_batch_is_one_transaction_with_every_text_row(memory: MemoryService) -> None:
    outcomes = await memory.remember_many([
        NewMemory(identity="alice", content=f"fact number {i}", created_at=1_700_000_000.0 + i) for i in range(50)])
    assert all(o.created for o in outcomes)
    counts = await memory.store.consistency()
    assert counts["rows"] == counts["text_rows"] == 50 and counts["rows_without_text"] == 0
    newest = await memory.store.list("alice", limit=1)
    assert newest[0].content == "fact number 49" and newest[0].kind is MemoryKind.FACT


def judge(verdicts: dict[str, str]) -> FunctionModel:
    """A model that judges a pair by the first word of the new statement found in `verdicts`."""
    def answer(messages: list[Message], _tools: object) -> ModelReply:
        new = messages[-1].content.split("NEW: ", 1)[1]
        verdict = next((v for word, v in verdicts.items() if word in new), "compatible")
        return ModelReply(text=json.dumps({"verdict": verdict}))

    return FunctionModel(answer)


async def test_a_keyless_fact_that_contradicts_an_older_one_supersedes_it(e5_memory: MemoryService) -> None:
    old = await e5_memory.remember("alice", "The user lives in Paris.", source_rank=SourceRank.CONSOLIDATED)
    unrelated = await e5_memory.remember("alice", "The user has a cat named Mochi.",
                                         source_rank=SourceRank.CONSOLIDATED)
    model = judge({"Berlin": "replaces", "French capital": "same"})
    reconciler = FactReconciler(e5_memory, model)
    assert await reconciler.reconcile() == 0  # nothing older to compare the first facts with
    new = await e5_memory.remember("alice", "The user lives in Berlin now.", source_rank=SourceRank.CONSOLIDATED)
    again = await e5_memory.remember("alice", "The user's home is the French capital.",
                                     source_rank=SourceRank.INFERRED)
    assert await reconciler.reconcile() == 1
    status = {r.id: r.status for r in await e5_memory.store.list("alice", include_inactive=True)}
    assert status[old.record.id] is MemoryStatus.SUPERSEDED and status[new.record.id] is MemoryStatus.ACTIVE
    assert status[unrelated.record.id] is MemoryStatus.ACTIVE
    assert status[again.record.id] is not MemoryStatus.ACTIVE  # a duplicate in other words, or parked
    assert [r.content for r in await e5_memory.store.history("alice", new.record.id)] == [
        "The user lives in Paris.", "The user lives in Berlin now."]
    asked = len(model.requests)
    assert await reconciler.reconcile() == 0 and len(model.requests) == asked  # each fact is checked once


async def test_an_inferred_contradiction_of_a_stated_fact_waits_for_confirmation(e5_memory: MemoryService) -> None:
    stated = await e5_memory.remember("alice", "I am vegetarian.")
    guess = await e5_memory.remember("alice", "The user is not vegetarian any more.", source_rank=SourceRank.INFERRED)
    await FactReconciler(e5_memory, judge({"any more": "replaces"})).reconcile()
    assert (await e5_memory.store.get("alice", stated.record.id)).status is MemoryStatus.ACTIVE
    assert (await e5_memory.store.get("alice", guess.record.id)).status is MemoryStatus.PENDING


async def test_a_question_naming_someone_finds_what_they_said_first(db: Database) -> None:
    # Lexical only: the ranking is the full-text search's (BM25 on SQLite, ts_rank on PostgreSQL) and the
    # bonus, nothing else.
    memory = MemoryService(SqlMemoryStore(db), None)
    await memory.open()
    sessions = SqlSessionStore(db)
    await sessions.append(Session(key="group:garden", metadata={"identity": "alice"}), [
        Message.user("Melanie, what do you grow in your garden this year?", name="Caroline"),
        Message.user("Tomatoes and a few roses by the fence.", name="Melanie"),
        Message.user("I grow herbs in my garden: basil, mint and thyme.", name="Caroline"),
    ])
    await memory.archive_session("group:garden")
    hits = await memory.search("alice", "What does Melanie grow in her garden?", limit=3)
    # Caroline's question shares every word with this one; Melanie's answer is what it asks for.
    assert hits[0].record.content == "Melanie: Tomatoes and a few roses by the fence."
    assert [hit.record.subject for hit in hits] == ["melanie", "caroline", "caroline"]
    both = await memory.search("alice", "What do Melanie and Caroline grow in the garden?", limit=3)
    assert both[0].record.subject == "caroline"  # naming both favours neither


LINES = ["ok", "noted.", "thanks", "I adopted a puppy last week", "We named her Biscuit",
         "She is three months old", "My sister plays the cello", "Which one?", "Got it, the red one."]


async def test_lines_archived_as_they_come_have_the_neighbours_of_lines_archived_at_once(db: Database) -> None:
    """Nods between them or not, a session archived a turn or two at a time (as the archive job
    does) ends with each line read beside the same neighbours as one archived in one run."""
    store, sessions = SqlMemoryStore(db), SqlSessionStore(db)
    for seed in range(12):
        draw = random.Random(seed)
        said = [Message.user(draw.choice(LINES)) if i % 2 == 0 else Message.assistant(draw.choice(LINES))
                for i in range(draw.randint(1, 30))]
        live, once = f"cli:live{seed}", f"cli:once{seed}"
        at = 0
        while at < len(said):
            step = draw.randint(1, 3)
            await sessions.append(await sessions.load(live), said[at:at + step])
            await store.archive_session(live, lambda channel, sender: "alice")
            at += step
        await sessions.append(Session(key=once, metadata={"identity": "alice"}), said)
        await store.archive_session(once, lambda channel, sender: "alice")
        assert await _contexts(db, live) == await _contexts(db, once), f"seed {seed}: {[m.content for m in said]}"


async def _contexts(db: Database, key: str) -> list[tuple[int, str | None]]:
    statement = Statement(select(schema.memory_items.c.seq_start, schema.memory_items.c.context_json)
                          .where(schema.memory_items.c.session_key == key).order_by(schema.memory_items.c.seq_start))
    return await db.run_read(lambda tx: [tuple(row) for row in tx.execute(statement).fetchall()])


@pytest.mark.parametrize("after", range(1, 7))  # the archive unit reads 6 statements before it writes
async def test_a_message_committed_while_its_session_is_archived_is_archived_by_the_next_run(
        pg_server: PgServer, pg_store_database: str, monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """On PostgreSQL (READ COMMITTED), the next turn's message commits from another connection
    after the `after`-th statement of the archiving unit: it must not be skipped for good."""
    db = PostgresDatabase(pg_store_database)
    await db.open()
    archive, statements = archive_rows.archive_messages, []

    def with_a_commit_meanwhile(tx: Any, *args: Any, **options: Any) -> int:
        class Meanwhile:
            dialect = tx.dialect

            def execute(self, statement: Any, params: Any = None) -> Any:
                rows = tx.execute(statement, params)
                statements.append(statement)
                if len(statements) == after:
                    pg_server.sql("INSERT INTO messages (session_key, seq, role, content, turn_id, created_at) "
                                  "VALUES ('test:g', 2, 'user', 'committed meanwhile', 't2', 0)",
                                  database=pg_store_database.rsplit("/", 1)[1])
                return rows

            def executemany(self, statement: Any, rows: Any) -> None:
                tx.executemany(statement, rows)

        return archive(Meanwhile(), *args, **options)

    try:
        sessions, store = SqlSessionStore(db), SqlMemoryStore(db)
        await sessions.append(Session(key="test:g", metadata={"identity": "someone"}), [
            Message.user("first", turn_id="t1"), Message.assistant("ok", turn_id="t1")])
        monkeypatch.setattr(memories, "archive_messages", with_a_commit_meanwhile)
        await store.archive_session("test:g", lambda channel, sender: "someone")
        monkeypatch.setattr(memories, "archive_messages", archive)
        await store.archive_session("test:g", lambda channel, sender: "someone")  # the next turn's
        archived = sorted(r.content for r in await store.list("someone", kinds=(MemoryKind.ARCHIVAL,)))
    finally:
        await db.close()
    assert archived == ["committed meanwhile", "first", "ok"]


async def test_a_rare_word_weighs_more_than_a_common_one_on_either_engine(db: Database, clock: Clock) -> None:
    """Without vectors, by words alone: "budget" is in twenty of the person's memories, "quokka" in
    one. A search for both finds the quokka first, as BM25's inverse document frequency would have it."""
    memory = MemoryService(SqlMemoryStore(db), None, clock=clock)
    await memory.open()
    await memory.remember("alice", "A quokka was seen near the harbour today.")  # the oldest: ties go to newer
    for n in range(20):
        await memory.remember("alice", f"The budget for week {n} was approved by finance.")
    top = await memory.search("alice", "budget quokka", limit=3)
    assert top[0].record.content == "A quokka was seen near the harbour today.", [h.record.content for h in top]
