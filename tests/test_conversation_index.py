"""The conversation index (store/conversations.py) on SQLite and PostgreSQL: which session holds a
conversation, for the OpenAI route's clients that name no session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ember.core.messages import Message, Session
from ember.store.conversations import SqlConversationIndex
from ember.store.engine import Database
from ember.store.sessions import SqlSessionStore
from tests.pgserver import ENGINES, engine_database


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    database = await engine_database(request.param, request, tmp_path)
    yield database  # type: ignore[misc]
    await database.close()


async def started(db: Database, key: str) -> str:
    await SqlSessionStore(db).append(Session(key=key), [Message.user("hi")])
    return key


async def test_a_digest_leads_to_its_session_once_until_it_is_put_back(db: Database) -> None:
    index = SqlConversationIndex(db)
    key = await started(db, "http:alice:s1")
    await index.put("alice", key, "d1")
    assert await index.take("alice", "d1") == key
    assert await index.take("alice", "d1") is None  # taken: a twin request starts its own session
    await index.put("alice", key, "d2")
    assert await index.take("alice", "d1") is None  # the session holds the longer conversation now
    assert await index.take("alice", "d2") == key


async def test_a_digest_is_its_owners_only(db: Database) -> None:
    index = SqlConversationIndex(db)
    await index.put("alice", await started(db, "http:alice:s1"), "same")
    assert await index.take("bob", "same") is None
    assert await index.take("alice", "same") == "http:alice:s1"


async def test_the_newest_of_two_sessions_with_one_digest_is_continued(db: Database) -> None:
    index = SqlConversationIndex(db)
    await index.put("alice", await started(db, "http:alice:old"), "same")
    await index.put("alice", await started(db, "http:alice:new"), "same")
    assert await index.take("alice", "same") == "http:alice:new"
    assert await index.take("alice", "same") == "http:alice:old"


async def test_a_digest_without_its_session_leads_nowhere(db: Database) -> None:
    index = SqlConversationIndex(db)
    await index.put("alice", "http:alice:never-written", "d")
    assert await index.take("alice", "d") is None
