"""I4 on the way into memory and skills: whichever path writes a memory or a learned skill, no
`<think>` block is kept, closed or cut off mid-thought. The store's write path leaves it out,
so each test below drives one path as it is used (a tool call, a review, a consolidation, an
archived message, the CLI, the skill reviewer) and reads what was kept. The HTTP API's path is
tested with its other routes in test_gateway_memory.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select, text

from ember.config.settings import Settings
from ember.core.events import OutboundKind
from ember.core.messages import Message, Role, ToolCall
from ember.core.skills import NewVersion, Proposal, ProposalStatus, SkillOrigin, SkillRisk
from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.memory.review import REVIEW_INSTRUCTION as MEMORY_REVIEW
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store import schema
from ember.store.engine import Database
from ember.store.skills import SqlSkillStore
from tests.conftest import IDENTITY, Harness
from tests.gatewayproc import EMBER_SOURCE
from tests.pgserver import ENGINES, engine_database, engine_settings
from tests.test_skills import WEEKLY, Reviews, agent, tool_heavy_turn

EMBER = str(Path(sys.executable).with_name("ember"))
THOUGHT = "the user seems to like tea, maybe note it"
CLOSED = f"<think>{THOUGHT}</think>I like jasmine tea."
UNCLOSED = f"I like jasmine tea.<thinking>{THOUGHT}"  # a reply cut off mid-thought
KEPT = "I like jasmine tea."


async def kept_texts(db: Database) -> str:
    """Every memory row, its text index row, skill, version and proposal, as one text."""
    tables = [schema.memory_items, schema.skills, schema.skill_versions, schema.skill_proposals]
    async with db.read() as conn:
        dumps = [repr((await conn.execute(select(table))).all()) for table in tables]
        dumps.append(repr((await conn.execute(text("SELECT body, before, after, far FROM memory_fts"))).all()))
    return "\n".join(dumps)


def assert_no_thinking(dump: str) -> None:
    for trace in (THOUGHT, "<think", "</think", "<thinking"):
        assert trace not in dump


async def contents(h: Harness) -> list[str]:
    return [record.content for record in await h.runtime.memory.store.list(IDENTITY, include_inactive=True)]


@pytest.fixture(params=ENGINES)
def config(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    return engine_settings(settings, request.param, request)


def remembering(content: str):  # type: ignore[no-untyped-def]
    def model(messages: list[Message], tools: object) -> ModelReply:
        if messages[-1].role is Role.USER:
            return ModelReply(tool_calls=(ToolCall("r1", "remember", json.dumps({"content": content})),))
        return ModelReply(text=f"Done: {messages[-1].content}")

    return model


@pytest.mark.parametrize("content", [CLOSED, UNCLOSED], ids=["closed", "unclosed"])
async def test_remember_keeps_the_fact_and_not_the_thinking_in_its_arguments(start, config: Settings,
                                                                             content: str) -> None:  # type: ignore[no-untyped-def]
    async with start(FunctionModel(remembering(content)), config=config) as h:
        answer = await h.turn("note what I drink")
        await h.runtime.runner.wait_idle()
        assert answer.kind is OutboundKind.FINAL and "Remembered as" in answer.text
        assert KEPT in await contents(h)
        assert_no_thinking(await kept_texts(h.runtime.db))


async def test_remember_of_nothing_but_thinking_is_a_failure_the_model_reads(start, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    async with start(FunctionModel(remembering(f"<think>{THOUGHT}</think>")), config=settings) as h:
        answer = await h.turn("note what I drink")
        await h.runtime.runner.wait_idle()
        assert "it was empty but for thinking" in answer.text
        assert_no_thinking(await kept_texts(h.runtime.db))


def reviewing(messages: list[Message], tools: object) -> ModelReply:
    """Turns that call a tool (so the memory review runs); reviews and summaries that think aloud."""
    system = messages[0].content if messages[0].role is Role.SYSTEM else ""
    if MEMORY_REVIEW in system:
        return ModelReply(text=f"- {CLOSED}\n- I drink it at four.<think>{THOUGHT}")
    if SUMMARY_INSTRUCTION in system:
        return ModelReply(text=json.dumps({"summary": f"<think>{THOUGHT}</think>They talked about tea.", "facts": [
            {"subject": "user", "key": "drink", "content": f"<thought>{THOUGHT}</thought>The user drinks tea."}]}))
    if messages[-1].role is Role.USER:
        return ModelReply(tool_calls=(ToolCall("s1", "memory_search", json.dumps({"query": "tea"})),))
    return ModelReply(text="Noted.")


async def test_the_memory_review_keeps_facts_without_thinking(start, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    config = settings.model_copy(update={"review_tool_call_threshold": 1})
    async with start(FunctionModel(reviewing), config=config) as h:
        await h.turn("what do I drink?")
        await h.runtime.runner.wait_idle()
        kept = await contents(h)
        assert KEPT in kept and "I drink it at four." in kept
        assert_no_thinking(await kept_texts(h.runtime.db))


async def test_a_consolidation_keeps_its_summary_and_facts_without_thinking(start, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    config = settings.model_copy(update={"consolidation_threshold": 4, "consolidation_keep_recent": 0})
    async with start(FunctionModel(reviewing), config=config) as h:
        await h.turn("what do I drink?")
        await h.turn("and when?")
        await h.runtime.runner.wait_idle()
        kept = await contents(h)
        assert "They talked about tea." in kept and "The user drinks tea." in kept
        assert_no_thinking(await kept_texts(h.runtime.db))


async def test_an_archived_message_and_its_neighbours_keep_no_thinking(start, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    """A person may paste a model's raw output: its thinking is not kept in the archive either."""
    answer = FunctionModel(lambda messages, tools: ModelReply(text="Thanks for sharing."))
    async with start(answer, config=settings) as h:
        await h.turn(f"My other assistant said: {CLOSED}")
        await h.turn("and that is all")
        await h.runtime.runner.wait_idle()
        assert f"My other assistant said: {KEPT}" in await contents(h)
        assert_no_thinking(await kept_texts(h.runtime.db))


def ember(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The `ember` command of this checkout."""
    env = {**os.environ, "EMBER_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([EMBER_SOURCE, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([EMBER, *args], env=env, input=stdin, capture_output=True, text=True, timeout=120)


def listed(home: Path) -> list[str]:
    done = ember(home, "memory", "list", "--all", "--json")
    assert done.returncode == 0, done.stderr
    return [record["content"] for record in json.loads(done.stdout)]


def test_memory_add_keeps_no_thinking(tmp_path: Path) -> None:
    for content in (CLOSED, UNCLOSED.replace("jasmine", "green")):
        done = ember(tmp_path, "memory", "add", content)
        assert done.returncode == 0, done.stderr
    assert sorted(listed(tmp_path)) == ["I like green tea.", KEPT]
    refused = ember(tmp_path, "memory", "add", f"<think>{THOUGHT}</think>")
    assert refused.returncode != 0 and "empty but for thinking" in refused.stderr + refused.stdout
    assert THOUGHT not in (tmp_path / "ember.db").read_bytes().decode(errors="replace")


def test_memory_import_keeps_no_thinking_and_reports_a_line_of_only_thinking(tmp_path: Path) -> None:
    lines = [json.dumps({"content": CLOSED}), json.dumps({"content": UNCLOSED.replace("jasmine", "green")}),
             json.dumps({"content": f"<think>{THOUGHT}</think>"})]
    done = ember(tmp_path, "memory", "import", "-", stdin="\n".join(lines) + "\n")
    assert done.returncode == 0, done.stderr
    assert "imported 2 new, 0 already known, 1 bad line(s) skipped" in done.stdout
    assert "line 3: a memory needs some content; it was empty but for thinking" in done.stderr
    assert sorted(listed(tmp_path)) == ["I like green tea.", KEPT]
    assert THOUGHT not in (tmp_path / "ember.db").read_bytes().decode(errors="replace")


THINKING_SKILL = {**WEEKLY, "body": f"<think>{THOUGHT}</think>{WEEKLY['body']}",
                  "reason": f"{WEEKLY['reason']}<think>{THOUGHT}</think>"}


async def test_the_skill_reviewer_proposes_and_admits_no_thinking(settings: Settings) -> None:
    config = settings.model_copy(update={"skills_auto_admit": "low-risk"})
    async with agent(config, Reviews(THINKING_SKILL)) as h:
        await tool_heavy_turn(h)
        [proposal] = await h.runtime.skills.proposals(None, None)
        assert proposal.status is ProposalStatus.ADMITTED
        assert "Group it by project." in proposal.text and proposal.reason == WEEKLY["reason"]
        assert_no_thinking(await kept_texts(h.runtime.db))


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    database = await engine_database(request.param, request, tmp_path)
    yield database
    await database.close()


async def test_the_skill_store_keeps_no_thinking_in_a_proposal_or_a_learned_version(db: Database) -> None:
    """Whatever admits a learned skill or records a proposal, the store leaves the thinking out;
    a person's own skill is kept as they wrote it."""
    store = SqlSkillStore(db)
    proposal = Proposal(id="sp_think", identity=IDENTITY, name="tea", action="create", text=f"# Tea\n{CLOSED}",
                        risk=SkillRisk.LOW, risk_reasons=(), status=ProposalStatus.PENDING, reason=UNCLOSED,
                        created_at=1.0, session_key="test:c1", job_id="job-think")
    recorded = await store.finish_review("test:c1", 3, proposal)
    assert recorded is not None and (recorded.text, recorded.reason) == (f"# Tea\n{KEPT}", KEPT)
    learned = await store.add_version(NewVersion(IDENTITY, "tea", f"Tea.<think>{THOUGHT}", f"# Tea\n{UNCLOSED}",
                                                 source="review", admitted_by="tester", origin=SkillOrigin.LEARNED))
    assert learned.text == f"# Tea\n{KEPT}"
    assert_no_thinking(await kept_texts(db))
    own = await store.add_version(NewVersion(IDENTITY, "notes", "About think tags.", f"Write {CLOSED}",
                                             source="import", admitted_by="tester", origin=SkillOrigin.IMPORTED))
    assert own.text == f"Write {CLOSED}"
