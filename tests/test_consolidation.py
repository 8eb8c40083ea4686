"""Consolidation (I5): the boundary moves forward only, never splits a tool
chain, and racing turns lose nothing."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import select

from ember.app.runtime import build_runtime
from ember.config.settings import Settings
from ember.core.events import OutboundKind
from ember.core.jobs import JobKind
from ember.core.memory import MemoryKind
from ember.core.messages import Message, Role, Session, ToolCall
from ember.memory.consolidation import SUMMARY_INSTRUCTION, plan_chunk, should_consolidate
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store import schema
from tests.conftest import EPISODES_HEADING, IDENTITY, Harness, job_counts, of_kind, session_key
from tests.pgserver import RUNTIMES, engine_settings


def numbered(messages: list[Message], start: int = 0) -> Session:
    stored = [Message(role=m.role, content=m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id,
                      seq=start + i) for i, m in enumerate(messages)]
    return Session(key="s", messages=stored, last_consolidated=start, next_seq=start + len(messages))


def chain(call_id: str, results: int = 1) -> list[Message]:
    calls = tuple(ToolCall(id=f"{call_id}-{k}", name="read_file", arguments="{}") for k in range(results))
    return [Message.assistant("", tool_calls=calls)] + [Message.tool_result(c.id, "r") for c in calls]


U, A = Message.user("u"), Message.assistant("a")


def test_threshold_counts_unconsolidated_messages() -> None:
    session = numbered([U, A] * 5, start=10)
    assert session.unconsolidated_count == 10
    assert should_consolidate(session.unconsolidated_count, 10)
    assert not should_consolidate(session.unconsolidated_count, 11)


def test_plain_history_keeps_the_recent_messages() -> None:
    chunk = plan_chunk(numbered([U, A, U, A, U, A]), keep_recent=2)
    assert chunk is not None and (chunk.start, chunk.end) == (0, 4)
    assert len(chunk.messages) == 4


def test_boundary_moves_back_past_a_trailing_chain() -> None:
    history = [U, A, U, *chain("x", results=2), A]
    # keep_recent=1 would cut after the second tool result; the chain stays whole.
    chunk = plan_chunk(numbered(history), keep_recent=1)
    assert chunk is not None and chunk.end == 3
    assert chunk.messages[-1].role is Role.USER


def test_boundary_never_lands_between_results() -> None:
    history = [U, *chain("x", results=3), A]
    chunk = plan_chunk(numbered(history), keep_recent=2)  # end would fall after the 2nd result
    assert chunk is not None and chunk.end == 1


def test_nothing_to_do() -> None:
    assert plan_chunk(numbered([U, A]), keep_recent=2) is None
    assert plan_chunk(numbered([*chain("x"), *chain("y")]), keep_recent=0) is None
    assert plan_chunk(numbered([]), keep_recent=0) is None


def test_boundary_is_a_seq_even_with_gaps() -> None:
    session = numbered([U, A, U, A], start=20)
    session.messages[3] = Message(role=Role.ASSISTANT, content="a", seq=40)  # a quarantined row left a gap
    session.next_seq = 41
    chunk = plan_chunk(session, keep_recent=1)
    assert chunk is not None and (chunk.start, chunk.end) == (20, 40)
    whole = plan_chunk(session, keep_recent=0)
    assert whole is not None and whole.end == 41


histories = st.lists(
    st.one_of(st.just([U]), st.just([A]), st.integers(1, 3).map(lambda n: chain("c", n))), max_size=15
).map(lambda parts: [m for part in parts for m in part])


@given(histories, st.integers(0, 6))
def test_any_history_any_keep_never_splits_a_chain(history: list[Message], keep: int) -> None:
    session = numbered(history)
    chunk = plan_chunk(session, keep)
    if chunk is None:
        return
    kept = [m for m in session.messages if (m.seq or 0) >= chunk.end]
    assert chunk.end > chunk.start
    assert not kept or kept[0].role is not Role.TOOL
    assert not chunk.messages[-1].has_tool_calls and chunk.messages[-1].role is not Role.TOOL
    assert len(kept) >= keep


# Racing consolidation against live turns, with real stores and leases.

@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """Sessions, their boundary, leases and jobs on SQLite, on PostgreSQL, and on PostgreSQL with the
    Redis bus."""
    return engine_settings(settings, request.param, request)


def racing_model(rng: random.Random) -> FunctionModel:
    async def answer(messages: list[Message], tools: object) -> ModelReply:
        if SUMMARY_INSTRUCTION in messages[0].content:
            await asyncio.sleep(rng.uniform(0, 0.02))  # the model call runs outside the lease
            return ModelReply(text=f"summary of {messages[1].content.count(chr(10)) + 1} lines")
        last = messages[-1]
        if last.role is Role.USER and "tool" in last.content:
            return ModelReply(text="", tool_calls=(ToolCall(id=f"t{rng.random()}", name="list_dir", arguments="{}"),))
        await asyncio.sleep(rng.uniform(0, 0.005))
        return ModelReply(text=f"answer to {messages[-1].content if last.role is Role.USER else 'tool'}")

    return FunctionModel(answer)


async def race_once(h: Harness, rng: random.Random, turns: int) -> list[int]:
    key = session_key()
    boundaries: list[int] = []

    async def watch() -> None:
        while True:
            boundaries.append((await h.runtime.sessions.load(key)).last_consolidated)
            await asyncio.sleep(0)

    async def consolidate_often() -> None:
        while True:
            await h.runtime.consolidation.consolidate(key)
            await asyncio.sleep(rng.uniform(0, 0.01))

    helpers = [asyncio.create_task(watch()), asyncio.create_task(consolidate_often()),
               asyncio.create_task(consolidate_often())]
    try:
        for i in range(turns):
            text = f"msg {i} use a tool" if rng.random() < 0.3 else f"msg {i}"
            await h.publish(text)
            if rng.random() < 0.5:  # sometimes let several turns queue up
                assert (await h.next_closing()).kind is OutboundKind.FINAL
        while len(h.chats["c1"].of(OutboundKind.FINAL)) < turns:
            await h.next_closing()
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
    await h.runtime.runner.wait_idle()
    return boundaries


async def episode_ranges(h: Harness) -> list[tuple[int, int]]:
    m = schema.memory_items
    async with h.runtime.db.read() as conn:
        rows = await conn.execute(
            select(m.c.seq_start, m.c.seq_end).where(m.c.kind == MemoryKind.EPISODIC.value).order_by(m.c.seq_start)
        )
        return [(row.seq_start, row.seq_end) for row in rows]


# Twelve races on SQLite; on PostgreSQL (its leases are rows), fewer, to keep the suite's time.
@pytest.mark.parametrize(("settings", "seed"), [*(("sqlite", seed) for seed in range(12)),
                                                *(("postgresql", seed) for seed in range(4)),
                                                *(("postgresql+redis", seed) for seed in range(2))],
                         indirect=["settings"])
async def test_consolidation_racing_turns_loses_nothing(start, settings, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    config = settings.model_copy(update={"consolidation_threshold": 4, "consolidation_keep_recent": rng.randint(0, 3)})
    turns = 15
    async with start(racing_model(rng), config=config) as h:
        boundaries = await race_once(h, rng, turns)
        history = await h.runtime.sessions.history(session_key())
        final = await h.runtime.sessions.load(session_key())
        episodes = await episode_ranges(h)

    assert boundaries == sorted(boundaries), "the boundary moved backwards"
    users = [m.content.split(" use")[0] for m in history if m.role is Role.USER]
    assert users == [f"msg {i}" for i in range(turns)], "a user message was lost or reordered"
    finals = [m for m in history if m.role is Role.ASSISTANT and not m.tool_calls]
    assert len(finals) == turns
    assert [m.seq for m in history] == list(range(len(history)))
    # The boundary never sits on a tool result, i.e. never inside a chain.
    by_seq = {m.seq: m for m in history}
    assert final.last_consolidated == len(history) or by_seq[final.last_consolidated].role is not Role.TOOL
    # Episodes tile the consolidated prefix exactly: no overlap, no gap.
    assert episodes, "consolidation never ran"
    assert episodes[0][0] == 0 and episodes[-1][1] == final.last_consolidated
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(episodes))


async def test_summary_reaches_the_next_prompt(start, settings) -> None:  # type: ignore[no-untyped-def]
    seen_systems: list[str] = []

    def answer(messages: list[Message], tools: object) -> ModelReply:
        if SUMMARY_INSTRUCTION in messages[0].content:
            return ModelReply(text="<think>hmm</think>The user likes tea.")
        seen_systems.append(messages[0].content)
        return ModelReply(text="ok")

    config = settings.model_copy(update={"consolidation_threshold": 4, "consolidation_keep_recent": 0})
    async with start(FunctionModel(answer), config=config) as h:
        await h.turn("one")
        await h.turn("two")  # 4 messages: consolidation is scheduled after this commit
        await h.runtime.runner.wait_idle()
        await h.turn("three")
        session = await h.runtime.sessions.load(session_key())
    assert "The user likes tea." not in seen_systems[1]
    assert f"{EPISODES_HEADING}\n- The user likes tea." in seen_systems[2]  # this session's episodes
    assert "hmm" not in seen_systems[2]  # no reasoning in memory (I4)
    assert session.last_consolidated == 4
    assert [m.content for m in session.messages] == ["three", "ok"]


async def test_pending_consolidation_is_deduplicated_per_session(settings) -> None:  # type: ignore[no-untyped-def]
    config = settings.model_copy(update={"consolidation_threshold": 4})
    runtime = await build_runtime(config, FunctionModel(lambda m, t: ModelReply(text="ok")))
    await runtime.bus.start()
    await runtime.loop.start()  # the background runner is deliberately not started
    h = Harness(runtime)
    try:
        for i in range(6):
            await h.turn(f"a{i}", chat="a")
            await h.turn(f"b{i}", chat="b")
        # One consolidation pending per session, however many turns asked for it.
        assert of_kind(await job_counts(runtime.db), JobKind.CONSOLIDATE) == {"pending": 2}
        # Starting the runner later (e.g. after a restart) runs each exactly once.
        await runtime.runner.start()
        await runtime.runner.wait_idle()
        assert (await runtime.sessions.load(session_key("a"))).last_consolidated > 0
        counts = await job_counts(runtime.db)
        assert of_kind(counts, JobKind.CONSOLIDATE) == {"done": 2}
        assert {status for _, status in counts} == {"done"}
    finally:
        await h.close()
        await runtime.loop.stop()
        await runtime.runner.stop()
        await runtime.bus.close()
        await runtime.db.close()


async def test_two_consolidations_of_one_session_advance_once(start, settings) -> None:  # type: ignore[no-untyped-def]
    gate = asyncio.Event()

    async def answer(messages: list[Message], tools: object) -> ModelReply:
        if SUMMARY_INSTRUCTION in messages[0].content:
            await gate.wait()  # both workers have planned the same chunk before either commits
            return ModelReply(text="summary")
        return ModelReply(text="ok")

    async with start(FunctionModel(answer)) as h:
        for i in range(5):
            await h.turn(f"m{i}")
        first = asyncio.create_task(h.runtime.consolidation.consolidate(session_key()))
        second = asyncio.create_task(h.runtime.consolidation.consolidate(session_key()))
        await asyncio.sleep(0.05)
        gate.set()
        results = sorted(await asyncio.gather(first, second))
        episodes = await h.runtime.memory.episodes(IDENTITY, session_key(), 10)
    assert results == [False, True]
    assert len(episodes) == 1
