"""Memory through whole turns: what the model is sent (a model server of the
tests' own logs every request), per person, across sessions, in group chats."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from ember.app.models import configured_model
from ember.app.runtime import Runtime, build_runtime, running
from ember.config.settings import Settings
from ember.core.events import InboundEvent, OutboundEvent, OutboundKind
from ember.core.memory import MemoryKind, MemoryStatus, shared_identity
from ember.memory.embeddings import HashingEmbedder, hashed_vectors
from ember.memory.prompt import RecallBudget
from ember.pipeline.context import PROFILE_HEADING, RECALLED_HEADING
from ember.store.tx import Statement
from tests.modelserver import ModelServer, Reply, tool_call
from tests.pgserver import RUNTIMES, engine_settings

CHANNEL = "test"  # a sender of this channel is the identity "test:<sender>" unless bound


@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """Sessions, memory and its indexes on SQLite, on PostgreSQL, and on PostgreSQL with the Redis bus."""
    return engine_settings(settings, request.param, request)


def settings_for(settings: Settings, server: ModelServer, **extra: Any) -> Settings:
    values: dict[str, Any] = {"consolidation_threshold": 1_000, "job_backoff_base_s": 0.01, **extra}
    return settings.model_copy(update={"model": server.model, "model_base_url": server.base_url, **values})


@asynccontextmanager
async def runtime_on(settings: Settings) -> AsyncIterator[Runtime]:
    runtime = await build_runtime(settings, configured_model(settings), embedder=HashingEmbedder())
    async with running(runtime):
        yield runtime


async def say(runtime: Runtime, text: str, *, sender: str, chat: str) -> OutboundEvent:
    """One turn from `sender` in `chat`; the final (or error) it gets back."""
    await runtime.bus.publish_inbound(InboundEvent(channel=CHANNEL, chat_id=chat, sender_id=sender, text=text,
                                                   message_id=uuid.uuid4().hex))
    while True:
        event = await asyncio.wait_for(runtime.bus.next_outbound(CHANNEL), 30)
        if event.chat_id == chat and event.kind in (OutboundKind.FINAL, OutboundKind.ERROR):
            return event


def sent_text(request: dict[str, Any]) -> str:
    """Everything a model request carried, system messages included."""
    return "\n".join(str(m.get("content") or "") for m in request["messages"])


def system_messages(request: dict[str, Any]) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "system"]


async def test_a_memory_from_another_session_of_the_same_person_reaches_the_prompt(
        settings: Settings, model_server: ModelServer) -> None:
    model_server.push(Reply(text="Noted."), Reply(text="Mochi."), Reply(text="I don't know."))
    async with runtime_on(settings_for(settings, model_server)) as runtime:
        await say(runtime, "By the way, my cat is called Mochi.", sender="alice", chat="monday")
        await runtime.runner.wait_idle()  # the message joins the searchable history
        answer = await say(runtime, "What is my cat called?", sender="alice", chat="friday")
        await say(runtime, "What is my cat called?", sender="bob", chat="bobs-chat")
    assert answer.text == "Mochi."
    alice_prompt, bob_prompt = model_server.requests[1], model_server.requests[2]
    recalled = [text for text in system_messages(alice_prompt) if text.startswith(RECALLED_HEADING)]
    assert len(recalled) == 1 and "my cat is called Mochi" in recalled[0]
    # Just before the newest message: the history's prefix stays what it was.
    roles = [m["role"] for m in alice_prompt["messages"]]
    assert roles[-2:] == ["system", "user"]
    assert "Mochi" not in sent_text(bob_prompt)


async def test_bound_principals_share_one_memory(settings: Settings, model_server: ModelServer) -> None:
    model_server.push(Reply(text="Noted."), Reply(text="Lyon."))
    config = settings_for(settings, model_server,
                          identities={"alice": ["test:alice-laptop", "test:alice-phone"]})
    async with runtime_on(config) as runtime:
        await say(runtime, "I was born in Lyon, remember that.", sender="alice-laptop", chat="desk")
        await runtime.runner.wait_idle()
        await say(runtime, "Where was I born?", sender="alice-phone", chat="phone")
        archived = await runtime.memory.store.list("alice", kinds=(MemoryKind.ARCHIVAL,))
    assert "born in Lyon" in sent_text(model_server.requests[1])
    assert {(r.subject, r.content) for r in archived} >= {("user", "I was born in Lyon, remember that."),
                                                         ("assistant", "Noted.")}


async def test_remember_and_forget_through_the_models_tools(settings: Settings, model_server: ModelServer) -> None:
    model_server.push(
        Reply(tool_calls=(tool_call("remember", content="The user's dentist is Dr. Okafor.", subject="user",
                                    key="dentist"),)),
        Reply(text="Saved."),
        Reply(tool_calls=(tool_call("memory_search", query="dentist"),)),
        Reply(text="Dr. Okafor."),
    )
    async with runtime_on(settings_for(settings, model_server)) as runtime:
        await say(runtime, "My dentist is Dr. Okafor.", sender="alice", chat="one")
        await say(runtime, "Who is my dentist?", sender="alice", chat="two")
        facts = await runtime.memory.store.list("test:alice", kinds=(MemoryKind.FACT,))
        assert [(f.content, f.subject, f.key) for f in facts] == [("The user's dentist is Dr. Okafor.", "user",
                                                                   "dentist")]
        # A profile fact (it names an attribute) heads every later prompt of hers, in the system text.
        assert PROFILE_HEADING in model_server.requests[2]["messages"][0]["content"]
        search_result = model_server.requests[3]["messages"][-1]
        assert search_result["role"] == "tool" and facts[0].id in search_result["content"]

        model_server.push(Reply(tool_calls=(tool_call("forget", id=facts[0].id),)), Reply(text="Forgotten."))
        await say(runtime, "Forget my dentist.", sender="alice", chat="three")
        # forget is a write: the policy asks, and the test channel cannot answer, so it is refused.
        assert (await runtime.memory.store.get("test:alice", facts[0].id)).status is MemoryStatus.ACTIVE


async def test_a_group_chats_summary_is_the_groups_not_any_members(settings: Settings,
                                                                   model_server: ModelServer) -> None:
    summary = json.dumps({"summary": "Alice and Bob planned a picnic.",
                          "facts": [{"subject": "user", "key": "food", "content": "The user loves olives."}]})
    model_server.responder = lambda body: Reply(
        text=summary if "Summarise" in body["messages"][0]["content"] else "ok")
    config = settings_for(settings, model_server, consolidation_threshold=6, consolidation_keep_recent=2)
    async with runtime_on(config) as runtime:
        for sender, text in [("alice", "I love olives"), ("bob", "picnic on Sunday?"), ("alice", "yes"),
                             ("bob", "I'll bring bread")]:
            await say(runtime, text, sender=sender, chat="group")
        await runtime.runner.wait_idle()
        group = await runtime.memory.store.list(shared_identity("test:group"), kinds=(MemoryKind.EPISODIC,))
        alice_facts = await runtime.memory.store.list("test:alice", kinds=(MemoryKind.FACT, MemoryKind.EPISODIC))
        bob_facts = await runtime.memory.store.list("test:bob", kinds=(MemoryKind.FACT, MemoryKind.EPISODIC))
        bob_archive = await runtime.memory.store.list("test:bob", kinds=(MemoryKind.ARCHIVAL,))
    assert [e.content for e in group] == ["Alice and Bob planned a picnic."]
    assert alice_facts == [] and bob_facts == []  # no member's memory takes in the group's facts
    assert "I love olives" not in {r.content for r in bob_archive}
    assert "picnic on Sunday?" in {r.content for r in bob_archive}


async def test_consolidation_extracts_facts_into_the_persons_memory(settings: Settings,
                                                                    model_server: ModelServer) -> None:
    summary = json.dumps({"summary": "The user talked about their job.",
                          "facts": [{"subject": "user", "key": "employer", "content": "The user works at Acme."},
                                    {"content": ""}]})  # an invalid fact: the answer is kept as a summary only
    good = json.dumps({"summary": "The user talked about their job.",
                       "facts": [{"subject": "user", "key": "employer", "content": "The user works at Acme."}]})
    replies = iter([summary, good])
    model_server.responder = lambda body: Reply(
        text=next(replies) if "Summarise" in body["messages"][0]["content"] else "ok")
    config = settings_for(settings, model_server, consolidation_threshold=4, consolidation_keep_recent=0)
    async with runtime_on(config) as runtime:
        await say(runtime, "I work at Acme", sender="carol", chat="a")
        await say(runtime, "as an engineer", sender="carol", chat="a")
        await runtime.runner.wait_idle()
        await say(runtime, "and I like it", sender="carol", chat="a")
        await say(runtime, "a lot", sender="carol", chat="a")
        await runtime.runner.wait_idle()
        facts = await runtime.memory.store.list("test:carol", kinds=(MemoryKind.FACT,))
        episodes = await runtime.memory.store.list("test:carol", kinds=(MemoryKind.EPISODIC,))
    assert [f.content for f in facts] == ["The user works at Acme."]
    assert facts[0].source_rank.name == "CONSOLIDATED" and facts[0].session_key == "test:a"
    assert len(episodes) == 2 and all(e.content == "The user talked about their job." for e in episodes)


async def test_an_archived_message_is_found_by_its_neighbours_words(settings: Settings,
                                                                    model_server: ModelServer) -> None:
    model_server.push(Reply(text="Which one?"), Reply(text="Got it, the red one."), Reply(text="ok"))
    async with runtime_on(settings_for(settings, model_server)) as runtime:
        await say(runtime, "I bought a bicycle today", sender="dana", chat="bikes")
        await say(runtime, "the red one", sender="dana", chat="bikes")
        await runtime.runner.wait_idle()
        await say(runtime, "thanks", sender="dana", chat="bikes")
        await runtime.runner.wait_idle()
        hits = await runtime.memory.search("test:dana", "bicycle", limit=2, kinds=(MemoryKind.ARCHIVAL,))
        counts = await runtime.memory.store.consistency()
        windows = await runtime.db.run_read(lambda tx: tx.execute(Statement(
            'SELECT COUNT(*) FROM memory_vectors WHERE "window" IS NOT NULL')).fetchone()[0])
    # "Which one?" says nothing of bicycles; the message before it does.
    assert [h.record.content for h in hits] == ["I bought a bicycle today", "Which one?"]
    assert counts["rows"] == counts["text_rows"] == 6 and counts["unembedded"] == 0
    # Each message that says something has its window vector, refreshed as neighbours arrived;
    # "thanks" and "ok" are nods, with none.
    assert windows == 4


async def test_a_person_s_lines_are_read_beside_each_other_past_the_nods_between(
        settings: Settings, model_server: ModelServer) -> None:
    model_server.push(Reply(text="Noted."), Reply(text="Noted."), Reply(text="Noted."))
    async with runtime_on(settings_for(settings, model_server)) as runtime:
        for text in ("I adopted a puppy last week", "We named her Biscuit", "My sister plays the cello"):
            await say(runtime, text, sender="dana", chat="news")
            await runtime.runner.wait_idle()
        hits = await runtime.memory.search("test:dana", "puppy", limit=5, kinds=(MemoryKind.ARCHIVAL,))
        prompt = await runtime.memory.for_prompt("test:dana", "what is my puppy called?", budget=RecallBudget())
    found = [h.record.content for h in hits]
    # The name is found by the line before it, not through the "Noted." between them.
    assert found[:2] == ["I adopted a puppy last week", "We named her Biscuit"]
    assert "Noted." not in found
    assert "We named her Biscuit" in [r.content for r in prompt.recalled]
    assert "Noted." not in [r.content for r in prompt.recalled]


class HeldEmbedder(HashingEmbedder):
    """Embeds queries at once and passages only once `released`: the background is behind."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return hashed_vectors(texts, self.dimensions)

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        self.released.wait(30)
        return hashed_vectors(texts, self.dimensions)


async def test_what_was_said_a_moment_ago_is_recalled_by_its_words_before_it_is_embedded(
        settings: Settings, model_server: ModelServer) -> None:
    model_server.push(Reply(text="Noted."), Reply(text="It is 4417."))
    embedder, configured = HeldEmbedder(), settings_for(settings, model_server)
    runtime = await build_runtime(configured, configured_model(configured), embedder=embedder)
    async with running(runtime):
        try:
            await say(runtime, "My gym locker code is 4417", sender="dana", chat="gym")
            while not await runtime.memory.store.list("test:dana", kinds=(MemoryKind.ARCHIVAL,)):
                await asyncio.sleep(0.02)  # archived (and in the text index), not embedded
            assert (await runtime.memory.store.consistency())["unembedded"] > 0
            await say(runtime, "what was my locker code again?", sender="dana", chat="other")
            assert "My gym locker code is 4417" in sent_text(model_server.requests[-1])
        finally:
            embedder.released.set()


async def test_an_evaluation_session_leaves_no_memory(settings: Settings, model_server: ModelServer) -> None:
    model_server.push(Reply(text="ok"))
    async with runtime_on(settings_for(settings, model_server)) as runtime:
        await runtime.bus.publish_inbound(InboundEvent(
            channel=CHANNEL, chat_id="eval", sender_id="erin", text="my secret word is tangerine",
            message_id=uuid.uuid4().hex, metadata={"evaluation": "true"}))
        while (await asyncio.wait_for(runtime.bus.next_outbound(CHANNEL), 30)).kind is not OutboundKind.FINAL:
            pass
        await runtime.runner.wait_idle()
        assert await runtime.memory.store.list("test:erin", include_inactive=True) == []
        assert (await runtime.sessions.history("test:eval"))[0].content == "my secret word is tangerine"
