"""A model-based test of the SQLite session store (I1, I3, I4, I5).

A hypothesis state machine drives the real store through commits, crashes,
restarts, interrupted tool steps, consolidations and stale writers, keeping its
own list of what was committed; after every step the store must agree with it.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule, run_state_machine_as_test
from sqlalchemy import func, select

from ember.core.errors import StoreConflict
from ember.core.memory import MemoryKind
from ember.core.messages import Message, Role, Session, ToolCall, encode_tool_calls
from ember.memory.consolidation import plan_chunk
from ember.store import schema
from ember.store.postgres import PostgresDatabase
from ember.store.sessions import INTERRUPTED_RESULT, SqlSessionStore
from ember.store.sqlite.database import SqliteDatabase
from tests.pgserver import ENGINES, PgServer
from tests.test_store import assert_protocol_valid, insert_raw

T = TypeVar("T")
KEYS = ("a", "b")

# What the model compares: a message as a model would read it back.
Shape = tuple[Role, str, tuple[ToolCall, ...], str | None]

# No "<" in the alphabet, so the only tags are the ones `assistant_text` places.
VISIBLE = st.text(alphabet="ab c", max_size=6)
USER_TEXT = st.one_of(VISIBLE, st.just("<think>quoted by the user</think> stays"))


@st.composite
def assistant_text(draw: st.DrawFn) -> tuple[str, str]:
    """(what the model wrote, what the store must keep): reasoning blocks, an
    unclosed block and stray closing tags go, in any letter case, and so does
    the leading whitespace they leave."""
    before, secret, after = draw(VISIBLE), draw(VISIBLE), draw(VISIBLE)
    tag = draw(st.sampled_from(["think", "THINK", "Thought", "thinking"]))
    written, kept = draw(st.sampled_from([
        (before, before),
        (f"{before}<{tag}>{secret}</{tag}>{after}", before + after),
        (f"{before}<{tag}>{secret}", before),
        (f"{before}</{tag}>{after}", before + after),
    ]))
    return written, kept.lstrip()


def shape(message: Message) -> Shape:
    return (message.role, message.content, message.tool_calls, message.tool_call_id)


def calls(ids: list[str]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(id=call_id, name="read_file", arguments="{}") for call_id in ids)


# Ids restart at call_0 on every step, as the OpenAI client's fallback does, and
# a provider may repeat one within a step; results may come back in any order.
STEP = st.lists(st.sampled_from(["call_0", "call_1", "call_2"]), min_size=1, max_size=3).flatmap(
    lambda ids: st.tuples(st.just(calls(ids)), st.permutations(range(len(ids)))))


async def fingerprint(db: SqliteDatabase, key: str) -> tuple[Any, ...]:
    """Everything a load could write for `key`: row counts and the session head."""
    m, q, s = schema.messages, schema.quarantine, schema.sessions
    head_columns = (s.c.next_seq, s.c.last_consolidated, s.c.updated_at)
    query = select(
        select(func.count()).where(m.c.session_key == key).scalar_subquery(),
        select(func.count()).where(q.c.session_key == key).scalar_subquery(),
        *(select(column).where(s.c.key == key).scalar_subquery() for column in head_columns),
    )
    async with db.read() as conn:
        return tuple((await conn.execute(query)).one())


async def memory_count(db: SqliteDatabase, key: str) -> int:
    """The episodic summaries of `key`, whoever's memory they joined."""
    mem = schema.memory_items
    async with db.read() as conn:
        return (await conn.execute(select(func.count()).where(
            mem.c.session_key == key, mem.c.kind == MemoryKind.EPISODIC.value))).scalar_one()


class StoreMachine(RuleBasedStateMachine):
    """One or two sessions; `expected` is every committed message, in order."""

    snapshots = Bundle("snapshots")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="ember-model-"))
        self.db = self.database()
        self.run(self.db.open())
        self.store = SqlSessionStore(self.db)
        self.expected: dict[str, list[Shape]] = {key: [] for key in KEYS}
        self.boundary = {key: 0 for key in KEYS}
        self.live = {key: self.run(self.store.load(key)) for key in KEYS}
        self.touched: tuple[str, ...] = KEYS  # the sessions the invariant checks

    def database(self) -> SqliteDatabase:
        """A new handle on the store this example runs on, the same one each time (not opened yet)."""
        return SqliteDatabase(self.dir / "ember.db")

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.db.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def commit(self, key: str, messages: list[Message], expected: list[Shape]) -> None:
        self.touched = (key,)
        self.run(self.store.append(self.live[key], messages))
        self.expected[key] += expected

    def reload(self, key: str) -> Session:
        """A load, checked to be final: a second load right after it writes nothing."""
        first = self.run(self.store.load(key))
        written = self.run(fingerprint(self.db, key))
        second = self.run(self.store.load(key))
        assert self.run(fingerprint(self.db, key)) == written, "a repair was not written back"
        assert second == first
        return second

    # Turns, committed the way the pipeline commits them.

    @rule(key=st.sampled_from(KEYS), text=USER_TEXT)
    def user_message(self, key: str, text: str) -> None:
        self.commit(key, [Message.user(text)], [(Role.USER, text, (), None)])

    @rule(key=st.sampled_from(KEYS), text=assistant_text(), step_and_order=STEP)
    def tool_step(
        self, key: str, text: tuple[str, str], step_and_order: tuple[tuple[ToolCall, ...], list[int]]
    ) -> None:
        step, order = step_and_order
        results = [Message.tool_result(step[k].id, f"output {k}") for k in order]
        self.commit(key, [Message.assistant(text[0], tool_calls=step), *results],
                    [(Role.ASSISTANT, text[1], step, None), *map(shape, results)])

    @rule(key=st.sampled_from(KEYS), text=assistant_text())
    def final_answer(self, key: str, text: tuple[str, str]) -> None:
        self.commit(key, [Message.assistant(text[0])], [(Role.ASSISTANT, text[1], (), None)])

    # Crashes and restarts.

    @rule(key=st.sampled_from(KEYS), restart=st.booleans())
    def crash(self, key: str, restart: bool) -> None:
        """The session's in-memory object is gone; a restart loses every one
        and reopens the database."""
        self.touched = (key,)
        if restart:
            self.run(self.db.close())
            self.db = self.database()
            self.run(self.db.open())
            self.store = SqlSessionStore(self.db)
            self.touched = KEYS
        for lost in self.touched:
            self.live[lost] = self.reload(lost)

    @rule(key=st.sampled_from(KEYS), data=st.data())
    def crash_mid_tool_step(self, key: str, data: st.DataObject) -> None:
        """A non-atomic writer died after the tool call and some of its results;
        the reload must close the call with interrupted results, in call order."""
        if not self.expected[key]:
            return  # a tool step follows a committed user message
        step = calls([f"call_{k}" for k in range(data.draw(st.integers(1, 3), label="calls"))])
        answered = data.draw(st.integers(0, len(step) - 1), label="answered")
        self.touched = (key,)
        seq = len(self.expected[key])
        self.run(insert_raw(self.db, key, seq, content="cut off", tool_calls=encode_tool_calls(step)))
        for k in range(answered):
            self.run(insert_raw(self.db, key, seq + 1 + k, role="tool", content=f"output {k}",
                                tool_call_id=step[k].id))
        self.live[key] = self.reload(key)
        self.expected[key] += [
            (Role.ASSISTANT, "cut off", step, None),
            *((Role.TOOL, f"output {k}", (), call.id) for k, call in enumerate(step[:answered])),
            *((Role.TOOL, INTERRUPTED_RESULT, (), call.id) for call in step[answered:]),
        ]

    # Consolidation.

    @rule(key=st.sampled_from(KEYS), keep_recent=st.integers(0, 6), reload=st.booleans(),
          skew=st.sampled_from([0, 0, -1, 1, 3]))
    def consolidate(self, key: str, keep_recent: int, reload: bool, skew: int) -> None:
        """Plan on a fresh load (as the worker does) or on the turn's own,
        possibly outdated, session; `skew` makes `expected` stale on purpose."""
        self.touched = (key,)
        session = self.run(self.store.load(key)) if reload else self.live[key]
        chunk = plan_chunk(session, keep_recent)
        if chunk is None:
            return
        expected = chunk.start + skew
        memories = self.run(memory_count(self.db, key))
        moved = self.run(self.store.advance_boundary(key, expected=expected, new=chunk.end, summary="s"))
        assert moved == (expected == self.boundary[key] and chunk.end > expected)
        assert self.run(memory_count(self.db, key)) == memories + moved
        if moved:
            assert [shape(m) for m in chunk.messages] == self.expected[key][chunk.start:chunk.end]
            self.boundary[key] = chunk.end

    # Stale writers.

    @rule(target=snapshots, key=st.sampled_from(KEYS))
    def take_snapshot(self, key: str) -> tuple[str, Session, int]:
        self.touched = (key,)
        return key, self.run(self.store.load(key)), len(self.expected[key])

    @rule(snapshot=consumes(snapshots), text=USER_TEXT)
    def append_through_snapshot(self, snapshot: tuple[str, Session, int], text: str) -> None:
        """A session object loaded earlier may write only if nothing was committed since."""
        key, session, committed = snapshot
        self.touched = (key,)
        if committed != len(self.expected[key]):
            try:
                self.run(self.store.append(session, [Message.user(text)]))
            except StoreConflict:
                return
            raise AssertionError("a stale session object overwrote newer commits")
        self.run(self.store.append(session, [Message.user(text)]))
        self.expected[key].append((Role.USER, text, (), None))
        self.live[key] = session  # the other in-memory copy is now the outdated one

    # Invariants, checked against the store after every step.

    @invariant()
    def store_agrees_with_the_model(self) -> None:
        # A read costs milliseconds, so only the sessions the step touched are
        # read; a write leaking into the other session shows when it is next touched.
        for key in self.touched:
            self.check_history(key)
            self.check_window(key)

    def check_history(self, key: str) -> None:
        """I1: every commit, once, in order; I4: no reasoning in assistant content."""
        history = self.run(self.store.history(key))
        assert [shape(m) for m in history] == self.expected[key]
        # Seqs are gapless here because nothing is ever quarantined.
        assert [m.seq for m in history] == list(range(len(history)))
        for message in history:
            lowered = message.content.lower()
            assert message.role is not Role.ASSISTANT or ("<think" not in lowered and "<thought" not in lowered)

    def check_window(self, key: str) -> None:
        """I3 and I5 on what a turn loads. The model's boundary only moves
        forward, so matching it means `last_consolidated` never went back."""
        session = self.run(self.store.load(key))
        expected, boundary = self.expected[key], self.boundary[key]
        assert session.last_consolidated == boundary <= session.next_seq == len(expected)
        assert boundary == len(expected) or expected[boundary][0] is not Role.TOOL
        assert [shape(m) for m in session.messages] == expected[boundary:]
        assert not session.messages or session.messages[0].seq == boundary
        assert_protocol_valid(session.messages)


def on_postgresql(server: PgServer, schema: str) -> type[StoreMachine]:
    """The same machine with each example in a PostgreSQL database of its own."""

    class PostgresStoreMachine(StoreMachine):
        url: str | None = None

        def database(self) -> SqliteDatabase:
            if self.url is None:
                self.url = server.fresh_database(template=schema)
            return PostgresDatabase(self.url)  # type: ignore[return-value]

        def teardown(self) -> None:
            super().teardown()
            if self.url is not None:
                server.drop_database(self.url)

    return PostgresStoreMachine


@pytest.mark.parametrize("engine", ENGINES)
def test_store_matches_its_model(engine: str, request: pytest.FixtureRequest) -> None:
    machine = (StoreMachine if engine == "sqlite"
               else on_postgresql(request.getfixturevalue("pg_server"), request.getfixturevalue("pg_schema")))
    # On PostgreSQL each example makes a database of its own: half the examples, the same steps each.
    run_state_machine_as_test(machine, settings=settings(max_examples=60 if engine == "sqlite" else 30,
                                                         stateful_step_count=30, deadline=None))
