"""The model and tool loop of one turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.config.settings import Settings
from ember.core.events import OutboundKind
from ember.core.jobs import JobKind
from ember.core.memory import MemoryKind
from ember.core.messages import Role, ToolCall
from ember.memory.review import REVIEW_INSTRUCTION
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel, ScriptedModel
from ember.pipeline.context import PROFILE_HEADING
from ember.pipeline.inference import TRUNCATED_NOTE, iteration_cap_text
from ember.skills.review import REVIEW_INSTRUCTION as SKILL_REVIEW_INSTRUCTION
from ember.tools.workspace import Workspaces
from tests.conftest import EPISODES_HEADING, IDENTITY, job_counts, of_kind, session_key, tool_run
from tests.pgserver import RUNTIMES, engine_settings


@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """Turns' tool steps, jobs and memory on SQLite, on PostgreSQL, and on PostgreSQL with the Redis bus."""
    return engine_settings(settings, request.param, request)


def read(path: str, call_id: str = "c1") -> ToolCall:
    return ToolCall(id=call_id, name="read_file", arguments=json.dumps({"path": path}))


async def test_tool_step_is_committed_with_its_results_and_streamed(start, settings) -> None:  # type: ignore[no-untyped-def]
    own = Workspaces(settings.workspace_dir, settings.workspaces_dir).for_identity(IDENTITY)
    (own.root / "a.txt").write_text("alpha\n")
    (own.root / "b.txt").write_text("beta\n")
    model = ScriptedModel([
        ModelReply(text="<think>which files?</think>Reading both.",
                   tool_calls=(read("a.txt", "c1"), read("b.txt", "c2"))),
        ModelReply(text="a says alpha, b says beta"),
    ])
    async with start(model) as h:
        final = await h.turn("read a and b", stream=True)
        history = await h.runtime.sessions.history(session_key())
        events = h.chats["c1"].events
    assert final.text == "a says alpha, b says beta"
    assert [m.role for m in history] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL, Role.ASSISTANT]
    assert history[1].content == "Reading both."  # the intermediate message is stripped too (I4)
    assert [(m.tool_call_id, m.content) for m in history[2:4]] == [("c1", "alpha\n"), ("c2", "beta\n")]
    assert [e.text for e in events if e.kind is OutboundKind.TOOL_RESULT] == ["alpha\n", "beta\n"]
    assert "which files" not in "".join(e.text for e in events)
    # The second model call saw the results in call order.
    assert [m.content for m in model.requests[1][-2:]] == ["alpha\n", "beta\n"]
    model.assert_complete()


async def test_bad_tool_input_goes_back_to_the_model_as_a_result(start) -> None:  # type: ignore[no-untyped-def]
    model = ScriptedModel([
        ModelReply(tool_calls=(
            ToolCall(id="c1", name="read_file", arguments="{not json"),
            ToolCall(id="c2", name="read_file", arguments='{"start_line": 0}'),
            ToolCall(id="c3", name="no_such_tool", arguments="{}"),
            read("/etc/passwd", "c4"),
            read("missing.txt", "c5"),
        )),
        ModelReply(text="I could not read anything."),
    ])
    async with start(model) as h:
        final = await h.turn("try things")
        results = [m.content for m in await h.runtime.sessions.history(session_key()) if m.role is Role.TOOL]
    assert final.kind is OutboundKind.FINAL
    assert all(r.startswith("Error:") for r in results)
    assert "not valid JSON" in results[0]
    assert "path" in results[1] and "start_line" in results[1]
    assert "no tool named 'no_such_tool'" in results[2]
    assert "absolute" in results[3]
    assert "no such file" in results[4]


async def test_iteration_cap_ends_the_turn_with_a_clear_answer(start, settings) -> None:  # type: ignore[no-untyped-def]
    looping = FunctionModel(
        lambda m, t: ModelReply(tool_calls=(ToolCall(id=f"c{len(m)}", name="list_dir", arguments="{}"),))
    )
    # No reviews: their model calls would be counted with the turn's.
    config = settings.model_copy(update={"max_tool_iterations": 3, "review_tool_call_threshold": 100})
    async with start(looping, config=config) as h:
        final = await h.turn("loop forever")
        history = await h.runtime.sessions.history(session_key())
    assert final.text == iteration_cap_text(3)
    assert len(looping.requests) == 3
    assert [m.role for m in history].count(Role.TOOL) == 3


async def test_an_answer_cut_at_the_output_limit_says_so(start) -> None:  # type: ignore[no-untyped-def]
    async with start(ScriptedModel([ModelReply(text="The first half of", truncated=True)])) as h:
        final = await h.turn("tell me everything")
    assert final.text == f"The first half of\n\n{TRUNCATED_NOTE}"


async def test_reasoning_is_replayed_only_within_its_own_turn(start) -> None:  # type: ignore[no-untyped-def]
    model = ScriptedModel([
        ModelReply(reasoning="private chain", reasoning_blocks='[{"type": "thinking", "signature": "s"}]',
                   tool_calls=(ToolCall(id="c1", name="list_dir", arguments="{}"),)),
        ModelReply(text="done"),
        ModelReply(text="second turn"),
    ])
    async with start(model) as h:
        await h.turn("first")
        await h.turn("second")
        stored = await h.runtime.sessions.history(session_key())
    within = [m for m in model.requests[1] if m.has_tool_calls]
    later = [m for m in model.requests[2] if m.has_tool_calls]
    assert within[0].reasoning == "private chain" and within[0].reasoning_blocks is not None
    assert later[0].reasoning is None and later[0].reasoning_blocks is None
    assert all("private chain" not in m.content for m in stored)


async def test_review_signals_follow_the_tool_call_threshold(start, settings) -> None:  # type: ignore[no-untyped-def]
    calls = tuple(ToolCall(id=f"c{i}", name="list_dir", arguments="{}") for i in range(2))
    model = FunctionModel(lambda m, t: ModelReply(text="NONE") if m[0].content.startswith(
                          (REVIEW_INSTRUCTION, SKILL_REVIEW_INSTRUCTION))
                          else ModelReply(tool_calls=calls) if m[-1].role is Role.USER and m[-1].content == "busy turn"
                          else ModelReply(text="ok"))
    config = settings.model_copy(update={"review_tool_call_threshold": 2})
    async with start(model, config=config) as h:
        await h.turn("busy turn")
        await h.runtime.runner.wait_idle()
        counts = await job_counts(h.runtime.db)
        facts = await h.runtime.memory.store.list(IDENTITY, kinds=(MemoryKind.FACT,))
        proposals = await h.runtime.skills.proposals(None, None)
        asked = len(model.requests)
        await h.turn("and now?")  # the next prompt shows what memory holds for the person
        prompt = model.requests[asked]
    # One skill review, one memory review, and nothing failed.
    assert of_kind(counts, JobKind.REVIEW_SKILLS) == {"done": 1}
    assert of_kind(counts, JobKind.REVIEW_MEMORY) == {"done": 1}
    assert {status for _, status in counts} == {"done"}
    assert facts == [] and proposals == []  # the model found no facts and nothing worth a skill
    # The next prompt carries no memory at all.
    assert PROFILE_HEADING not in prompt[0].content and EPISODES_HEADING not in prompt[0].content
    assert [m.role for m in prompt].count(Role.SYSTEM) == 1


async def test_workspace_tools_see_only_the_workspace(tmp_path: Path) -> None:
    from ember.tools.base import ToolRegistry
    from ember.tools.files import file_tools

    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "x.txt").write_text("1\n2\n3\n4\n")
    (tmp_path / "secret.txt").write_text("top secret")
    (root / "escape").symlink_to(tmp_path / "secret.txt")
    tools = ToolRegistry(file_tools(Workspaces(root)))

    async def run(name: str, **args: object) -> str:
        return await tools.call(ToolCall(id="c", name=name, arguments=json.dumps(args)), tool_run())

    assert await run("read_file", path="sub/x.txt", start_line=2, end_line=3) == "2\n3\n"
    assert (await run("list_dir", path=".")).splitlines()[1:] == ["escape", "sub/"]
    for attempt in ("../secret.txt", "escape", str(tmp_path / "secret.txt"), "sub/../../secret.txt", "a\x00b"):
        result = await run("read_file", path=attempt)
        assert result.startswith("Error:") and "top secret" not in result, attempt
    assert (await run("read_file", path="sub")).startswith("Error:")
