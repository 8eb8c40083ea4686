"""What embedding costs and where it runs: a turn's query never waits behind the
background, each text is embedded once and bounded, and an OpenAI-compatible
embedding endpoint (a server of the tests' own, over real HTTP) is batched,
retried and typed like a model."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from ember.app.services import embedding_endpoint
from ember.config.settings import isolated_settings
from ember.core.errors import ConfigError, ModelBadRequest, ModelUnavailable
from ember.core.language import language_of
from ember.core.messages import Message
from ember.memory.embeddings import HashingEmbedder, hashed_vectors, load_embedder
from ember.memory.encoder import PASSAGE_CHARS, QUERY_HEAD_CHARS, QUERY_TAIL_CHARS, Encoder
from ember.memory.prompt import RecallBudget
from ember.memory.provider_embeddings import BATCH, ProviderEmbedder
from ember.memory.service import MemoryService
from ember.store.memories import SqlMemoryStore
from ember.store.sessions import SqlSessionStore
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tx import Statement
from tests.embeddingserver import DIMENSIONS, EmbeddingServer, embedding_server

KEY = "sk-test-embedding-key-1234"
WITHOUT_PROFILE = RecallBudget(profile_facts=0)


class CountingEmbedder(HashingEmbedder):
    """Records every text it is asked to embed, by kind, and the scheduling priority it ran at."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[str] = []
        self.passages: list[str] = []
        self.passage_nice: set[int] = set()
        self.release = threading.Event()
        self.release.set()

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        self.queries += texts
        return hashed_vectors(texts, self.dimensions)

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        self.passage_nice.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.release.wait(timeout=30)
        self.passages += texts
        return hashed_vectors(texts, self.dimensions)


@pytest.fixture
def server() -> Iterator[EmbeddingServer]:
    with embedding_server() as found:
        yield found


async def test_a_query_is_embedded_while_the_background_is_stuck_in_a_batch() -> None:
    embedder = CountingEmbedder()
    encoder = Encoder(embedder)
    embedder.release.clear()
    batch = asyncio.create_task(encoder.passages(["a long document the background is embedding"]))
    await asyncio.sleep(0.05)
    vector = await asyncio.wait_for(encoder.query("what did I say about the document?"), 10)
    assert vector.shape == (embedder.dimensions,) and not batch.done()
    embedder.release.set()
    await batch
    encoder.close()


async def test_the_background_embeds_at_the_lowest_priority() -> None:
    embedder = CountingEmbedder()
    encoder = Encoder(embedder)
    await encoder.passages(["one"])
    await encoder.query("two")
    assert embedder.passage_nice == {19}
    encoder.close()


async def test_a_huge_message_is_embedded_by_its_head_and_tail(db: SqliteDatabase) -> None:
    embedder = CountingEmbedder()
    memory = MemoryService(SqlMemoryStore(db), embedder)
    pasted = "START " + "filler words here " * 60_000 + " FINISH"  # about a megabyte
    await memory.for_prompt("alice", pasted, budget=WITHOUT_PROFILE)
    [query] = embedder.queries
    assert len(query) <= QUERY_HEAD_CHARS + QUERY_TAIL_CHARS + 3
    assert query.startswith("START") and query.endswith("FINISH")
    await memory.remember("alice", pasted[:7_000])
    await memory.flush_embeddings()
    assert max(map(len, embedder.passages)) <= PASSAGE_CHARS
    await memory.close()


async def test_each_message_is_embedded_once_and_the_one_recalled_for_not_again(db: SqliteDatabase) -> None:
    """Turn after turn, the background embeds only the answers: the person's message was
    embedded to recall for it, and windows are made of vectors already made."""
    embedder = CountingEmbedder()
    memory = MemoryService(SqlMemoryStore(db), embedder)
    sessions = SqlSessionStore(db)
    said = [(f"question {n}: what about the {word}?", f"answer {n}: the {word} is fine")
            for n, word in enumerate(["garden", "boat", "violin", "kettle", "mountain", "letter"])]
    for question, answer in said:
        await memory.for_prompt("local", question, budget=WITHOUT_PROFILE)
        session = await sessions.load("cli:work")
        await sessions.append(session, [Message.user(question), Message.assistant(answer)])
        await memory.archive_session("cli:work")
        await memory.flush_embeddings()
    assert sorted(embedder.queries) == sorted(question for question, _ in said)
    assert sorted(embedder.passages) == sorted(answer for _, answer in said)
    found = {hit.record.content for hit in (await memory.search("local", "violin"))[:2]}
    assert found == set(said[2])
    await memory.close()


async def test_memories_are_found_through_an_embedding_endpoint(db: SqliteDatabase, server: EmbeddingServer) -> None:
    embedder = ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY)
    memory = MemoryService(SqlMemoryStore(db), embedder)
    await memory.open()
    for fact in ("My cat is called Mochi.", "I play the cello on Thursdays.", "My sister lives in Lyon."):
        await memory.remember("alice", fact)
    assert await memory.flush_embeddings() == 3
    assert embedder.name == "openai:mock-embed" and embedder.dimensions == DIMENSIONS
    prompt = await memory.for_prompt("alice", "when is the cello?", budget=WITHOUT_PROFILE)
    assert prompt.recalled[0].content == "I play the cello on Thursdays."
    assert {r["authorization"] for r in server.requests} == {f"Bearer {KEY}"}
    assert {r["model"] for r in server.requests} == {"mock-embed"}
    vectors = await db.run_read(lambda tx: tx.execute(Statement("SELECT model, vector FROM memory_vectors")).fetchall())
    assert {model for model, _ in vectors} == {"openai:mock-embed"}
    for _, blob in vectors:  # normalised, as the similarity scores assume
        assert np.isclose(np.linalg.norm(np.frombuffer(blob, dtype=np.float32)), 1.0, atol=1e-5)
    await memory.close()


def test_many_texts_go_in_batches_and_come_back_in_their_order(server: EmbeddingServer) -> None:
    embedder = ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY)
    texts = [f"text number {n} about item{n}" for n in range(BATCH * 2 + 5)]
    vectors = embedder.embed_passages(texts)
    assert [len(r["input"]) for r in server.requests] == [BATCH, BATCH, 5]
    again = ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY).embed_passages([texts[70]])
    assert np.allclose(vectors[70], again[0])


def test_a_rate_limit_is_waited_out_and_a_down_endpoint_retried(server: EmbeddingServer) -> None:
    embedder = ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY, attempts=3)
    server.fail(429, retry_after="0.2")
    server.fail(503)
    assert embedder.embed_queries(["hello"]).shape == (1, DIMENSIONS)
    assert len(server.requests) == 3


def test_an_endpoint_that_stays_down_fails_typed_without_the_key(server: EmbeddingServer) -> None:
    embedder = ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY, attempts=2)
    server.fail(500, times=5)
    with pytest.raises(ModelUnavailable, match="after 2 attempts") as failed:
        embedder.embed_passages(["hello"])
    assert KEY not in str(failed.value) and server.base_url in str(failed.value)
    server.failures.clear()
    server.fail(400)
    before = len(server.requests)
    with pytest.raises(ModelBadRequest):
        embedder.embed_passages(["hello"])
    assert len(server.requests) == before + 1  # a bad request is not retried


async def test_while_the_endpoint_is_down_recall_goes_on_by_words(db: SqliteDatabase, server: EmbeddingServer,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    embedder = ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY, attempts=1)
    memory = MemoryService(SqlMemoryStore(db), embedder)
    await memory.remember("alice", "The spare key is under the blue flowerpot.")
    server.fail(503, times=10)
    with pytest.raises(ModelUnavailable):
        await memory.flush_embeddings()  # the job fails, and is retried later with backoff
    with caplog.at_level(logging.WARNING):
        prompt = await memory.for_prompt("alice", "where is the spare key?", budget=WITHOUT_PROFILE)
    assert [r.content for r in prompt.recalled] == ["The spare key is under the blue flowerpot."]
    assert "recall by words alone" in caplog.text and KEY not in caplog.text
    server.failures.clear()
    assert await memory.flush_embeddings() == 1
    await memory.close()


async def test_archiving_embeds_what_it_archived_and_queues_the_job_only_when_the_endpoint_fails(
        db: SqliteDatabase, server: EmbeddingServer, caplog: pytest.LogCaptureFixture) -> None:
    embedder = ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY, attempts=1)
    memory, sessions = MemoryService(SqlMemoryStore(db), embedder), SqlSessionStore(db)
    jobs = Statement("SELECT kind, status FROM jobs")
    vectors = Statement("SELECT COUNT(*) FROM memory_vectors")

    async def said(question: str, answer: str) -> int:
        await sessions.append(await sessions.load("cli:work"), [Message.user(question), Message.assistant(answer)])
        return await memory.archive_session("cli:work")

    assert await said("Where did I park?", "On level 3, row F.") == 2
    assert await db.run_read(lambda tx: tx.execute(vectors).fetchone()[0]) == 2  # embedded by the archive itself
    assert await db.run_read(lambda tx: tx.execute(jobs).fetchall()) == []  # no embedding job of their own
    server.fail(503, times=10)
    with caplog.at_level(logging.WARNING):
        assert await said("What is the wifi password?", "It is on the fridge.") == 2  # the archive holds
    assert "embedding them later" in caplog.text and KEY not in caplog.text
    assert await db.run_read(lambda tx: tx.execute(jobs).fetchall()) == [("embed", "pending")]
    hits = await memory.search("local", "wifi password")
    assert hits[0].record.content == "What is the wifi password?"  # found by its words meanwhile
    server.failures.clear()
    # The job's run, once the endpoint is back: the two new ones, and the two before them, whose windows reach them.
    assert await memory.flush_embeddings() == 4
    assert await db.run_read(lambda tx: tx.execute(vectors).fetchone()[0]) == 4
    await memory.close()


async def test_a_slow_endpoint_delays_a_turn_only_so_long(db: SqliteDatabase, server: EmbeddingServer) -> None:
    embedder = ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY)
    memory = MemoryService(SqlMemoryStore(db), embedder)
    await memory.remember("alice", "The spare key is under the blue flowerpot.")
    server.delay_s = 30
    prompt = await asyncio.wait_for(memory.for_prompt("alice", "where is the spare key?", budget=WITHOUT_PROFILE),
                                    15)
    assert [r.content for r in prompt.recalled] == ["The spare key is under the blue flowerpot."]
    server.delay_s = 0
    await memory.close()


async def test_another_embedding_model_embeds_every_memory_again(db: SqliteDatabase, server: EmbeddingServer) -> None:
    first = MemoryService(SqlMemoryStore(db), HashingEmbedder())
    await first.remember("alice", "My cat is called Mochi.")
    await first.flush_embeddings()
    second = MemoryService(SqlMemoryStore(db), ProviderEmbedder("mock-embed", base_url=server.base_url, api_key=KEY))
    await second.open()
    assert await second.flush_embeddings() == 1 and server.texts == ["My cat is called Mochi."]
    await first.close()
    await second.close()


def test_the_endpoint_and_key_of_provider_embeddings(tmp_path: Path) -> None:
    own = isolated_settings(home=tmp_path, embedding_model="openai:text-embedding-3-small",
                            embedding_base_url="http://127.0.0.1:9/v1", embedding_api_key="sk-own",
                            model="m", model_base_url="http://127.0.0.1:8/v1", model_api_key="sk-chat")
    assert embedding_endpoint(own) == ("http://127.0.0.1:9/v1", "sk-own")
    # Another endpoint than the chat model's never gets the chat model's key.
    elsewhere = isolated_settings(home=tmp_path, embedding_model="openai:e", embedding_base_url="http://127.0.0.1:9/v1",
                                  model="m", model_base_url="http://127.0.0.1:8/v1", model_api_key="sk-chat")
    assert embedding_endpoint(elsewhere) == ("http://127.0.0.1:9/v1", None)
    chat = isolated_settings(home=tmp_path, embedding_model="openai:e", model="m",
                             model_base_url="http://127.0.0.1:8/v1", model_api_key="sk-chat")
    assert embedding_endpoint(chat) == ("http://127.0.0.1:8/v1", "sk-chat")
    with pytest.raises(ConfigError, match="embedding_base_url"):
        load_embedder("openai:e", base_url=None)
    with pytest.raises(ConfigError, match="unknown embedding model"):
        load_embedder("word2vec")
    with pytest.raises(ValueError, match="embedding_model"):
        isolated_settings(home=tmp_path, embedding_model="openai:")


def test_a_pasted_megabyte_is_read_for_its_language_by_its_opening() -> None:
    assert language_of("请帮我看看这份文件。" * 150 + "lorem ipsum " * 90_000) == "zh"
    assert language_of("Please look at this file. " * 60 + "文件内容" * 250_000) == "en"
