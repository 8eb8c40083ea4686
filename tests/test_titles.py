"""Session titles from the background model: what is kept of its answer, and a person's name winning."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.core.messages import Message, Session
from ember.models.base import ModelReply
from ember.models.scripted import ScriptedModel
from ember.runtime.titles import SessionTitler, clean_title
from ember.store.sessions import SqlSessionStore
from tests.pgserver import ENGINES, engine_database


@pytest.mark.parametrize(("answer", "title"), [
    ("Planning the spring garden", "Planning the spring garden"),
    ('Title: "Planning the spring garden."', "Planning the spring garden"),
    ("<think>the user asks about plants</think>\n\n  **Spring   garden**  \nmore text", "Spring garden"),
    ("「春天的花园」。", "春天的花园"),
    ("", None),
    ("NONE", None),
    ('""', None),
])
def test_the_title_is_the_first_line_of_the_answer_without_decoration(answer: str, title: str | None) -> None:
    assert clean_title(answer) == title


def test_a_long_title_is_cut_with_an_ellipsis() -> None:
    title = clean_title("word " * 40)
    assert title is not None and len(title) == 60 and title.endswith("…")


@pytest.fixture(params=ENGINES)
async def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> SqlSessionStore:
    """The session store, where titles are kept, on SQLite and on PostgreSQL."""
    db = await engine_database(request.param, request, tmp_path)
    store = SqlSessionStore(db)
    session = Session(key="http:alice:s1")
    await store.append(session, [Message.user("what should I plant?", turn_id="t1"),
                                 Message.assistant("Peas.", turn_id="t1")])
    yield store
    await db.close()


async def test_a_title_is_written_only_where_the_session_has_none(sessions: SqlSessionStore) -> None:
    titler = SessionTitler(sessions, ScriptedModel([ModelReply(text="Spring planting")]))
    assert await titler.title("http:alice:s1") == "Spring planting"
    [row] = await sessions.list_sessions("http:alice:")
    assert row.title == "Spring planting"
    # A person's name is never replaced, nor an earlier title.
    assert await sessions.label("http:alice:s1", title="My garden")
    again = SessionTitler(sessions, ScriptedModel([ModelReply(text="Something else")]))
    assert await again.title("http:alice:s1") is None
    [row] = await sessions.list_sessions("http:alice:")
    assert row.title == "My garden"


async def test_an_unanswered_session_or_an_unusable_answer_leaves_the_first_words(
        sessions: SqlSessionStore) -> None:
    empty = Session(key="http:alice:s2")
    await sessions.append(empty, [Message.user("hello?", turn_id="t2")])
    assert await SessionTitler(sessions, ScriptedModel([])).title("http:alice:s2") is None  # no model call
    assert await SessionTitler(sessions, ScriptedModel([ModelReply(text="   ")])).title("http:alice:s1") is None
    titles = {row.key: row.title for row in await sessions.list_sessions("http:alice:")}
    assert titles == {"http:alice:s1": "what should I plant?", "http:alice:s2": "hello?"}
