"""Skills the agent learns and the person controls: a tool-heavy turn's review
proposes, the admission gate refuses or classes, a person approves or rejects,
every change is a version that can be rolled back, and one identity's learned
skills never reach another.

The turns run on a scripted model; the reviews on a scripted background model
that answers the review's instruction with the JSON it asks for.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ember.app.database import open_database
from ember.app.runtime import build_runtime
from ember.app.services import skill_library
from ember.config.settings import Settings
from ember.core.errors import SkillError, SkillNotFound
from ember.core.events import InboundEvent, OutboundKind
from ember.core.messages import Message, Role, ToolCall
from ember.core.skills import SHARED, NewVersion, ProposalStatus, SkillOrigin, SkillRisk, SkillStatus
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.skills.format import SkillFormatError, parse_skill_md, read_folder, render_skill_md
from ember.skills.gate import MAX_PROPOSAL_CHARS, assess
from ember.skills.library import SkillLibrary
from ember.skills.review import REVIEW_INSTRUCTION, parse_answer
from ember.store.engine import Database
from ember.tools.workspace import Workspaces
from tests.conftest import IDENTITY, Harness, job_counts, of_kind, running_harness, session_key
from tests.pgserver import ENGINES, RUNTIMES, engine_database, engine_settings

WEEKLY = {"action": "create", "name": "weekly-report", "description": "Write the weekly status report.",
          "body": "1. Search memory for this week's work.\n2. Group it by project.\n3. Keep it under 200 words.",
          "reason": "the user asks for this every Friday"}


def is_skill_review(messages: list[Message]) -> bool:
    return messages[0].content.startswith(REVIEW_INSTRUCTION[:60])


def searching_turns(messages: list[Message], tools: Any) -> ModelReply:
    """Three memory searches, then an answer; a turn that asks to use a skill reads it and quotes it."""
    last_user = max(i for i, m in enumerate(messages) if m.role is Role.USER)
    results = [m for m in messages[last_user:] if m.role is Role.TOOL]
    request = messages[last_user].content
    if request.startswith("use "):
        if not results:
            name = request.removeprefix("use ")
            return ModelReply(tool_calls=(ToolCall("v1", "skill_view", json.dumps({"name": name})),))
        return ModelReply(text=f"Following it: {results[0].content}")
    if len(results) < 3:
        return ModelReply(tool_calls=(ToolCall(f"s{len(results)}", "memory_search",
                                               json.dumps({"query": "this week"})),))
    return ModelReply(text="Here is your report.")


class Reviews:
    """The background model: answers skill reviews with `answers` in turn (then "none"), memory reviews NONE."""

    def __init__(self, *answers: dict[str, Any] | str | Exception) -> None:
        self.answers = list(answers)
        self.skill_reviews: list[list[Message]] = []
        self.gate: asyncio.Event | None = None  # set: the skill review waits for it
        self.started = asyncio.Event()

    async def __call__(self, messages: list[Message], tools: Any) -> ModelReply:
        if not is_skill_review(messages):
            return ModelReply(text="NONE")  # the memory review, and the consolidation
        self.skill_reviews.append(messages)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.pop(0) if self.answers else {"action": "none"}
        if isinstance(answer, Exception):
            raise answer
        text = answer if isinstance(answer, str) else json.dumps(answer)
        return ModelReply(text=text, input_tokens=321, output_tokens=45)


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    """The skill store on SQLite and on PostgreSQL."""
    database = await engine_database(request.param, request, tmp_path)
    yield database  # type: ignore[misc]
    await database.close()


@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """The runtime's store, skills and proposals among it, on SQLite, on PostgreSQL, and on
    PostgreSQL with the Redis bus."""
    return engine_settings(settings, request.param, request)


@pytest.fixture
def skills_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"job_max_attempts": 2})


@asynccontextmanager
async def agent(settings: Settings, reviews: Reviews,
                turns: Callable[..., ModelReply] = searching_turns) -> AsyncIterator[Harness]:
    """The built-in tools (skill_view among them), turns on `turns`, reviews on `reviews`."""
    runtime = await build_runtime(settings, FunctionModel(turns), background_model=FunctionModel(reviews))
    async with running_harness(runtime) as harness:
        yield harness


async def tool_heavy_turn(h: Harness, text: str = "make my weekly report", chat: str = "c1") -> None:
    final = await h.turn(text, chat=chat)
    assert final.kind is OutboundKind.FINAL, final.text
    await h.runtime.runner.wait_idle()


def system_prompt(model: FunctionModel) -> str:
    return model.requests[-1][0].content


async def test_a_reviewed_proposal_waits_and_once_approved_is_in_the_index_and_readable(
        skills_settings: Settings) -> None:
    reviews = Reviews(WEEKLY)
    async with agent(skills_settings, reviews) as h:
        await tool_heavy_turn(h)
        library = h.runtime.skills
        [proposal] = await library.proposals(IDENTITY)
        assert proposal.status is ProposalStatus.PENDING  # the default policy admits nothing by itself
        assert proposal.name == "weekly-report" and proposal.action == "create"
        assert "+1. Search memory for this week's work." in proposal.diff
        assert (proposal.input_tokens, proposal.output_tokens) == (321, 45)  # what the review cost
        assert "weekly-report" not in [s.name for s in await library.skills(IDENTITY)]
        with pytest.raises(SkillNotFound):
            await library.view(IDENTITY, "weekly-report")

        decided = await library.decide(proposal.id, True, "tester", identity=IDENTITY)
        assert decided.status is ProposalStatus.ADMITTED and decided.version == 1
        final = await h.turn("use weekly-report")
        turn_model = h.runtime.models.turns.inner
        index = next(r[0].content for r in turn_model.requests if r[-1].content == "use weekly-report")
        assert "- weekly-report: Write the weekly status report." in index
        assert final.text.startswith("Following it: # Skill weekly-report (version 1)")
        assert "Group it by project." in final.text
        [skill] = [s for s in await library.skills(IDENTITY) if s.name == "weekly-report"]
        assert (skill.scope, skill.use_count, skill.origin.value) == ("learned", 1, "learned")
        with pytest.raises(SkillError, match="already admitted"):
            await library.decide(proposal.id, False, "tester")


async def test_a_rejected_proposal_changes_nothing(skills_settings: Settings) -> None:
    reviews = Reviews(WEEKLY)
    async with agent(skills_settings, reviews) as h:
        before = [s.to_json_dict() for s in await h.runtime.skills.skills(None)]
        await tool_heavy_turn(h)
        [proposal] = await h.runtime.skills.proposals(None)
        rejected = await h.runtime.skills.decide(proposal.id, False, "local")
        assert rejected.status is ProposalStatus.REJECTED and rejected.version is None
        assert [s.to_json_dict() for s in await h.runtime.skills.skills(None)] == before
        assert await h.runtime.skills.proposals(None) == []
        await h.turn("hello again")
        assert "weekly-report" not in system_prompt(h.runtime.models.turns.inner)


REFUSALS = [
    ({**WEEKLY, "body": "Log in with api_key=sk-abcdefghijklmnopqrstuvwx then fetch."}, "looks like a secret"),
    ({**WEEKLY, "name": "../../etc/passwd"}, "invalid skill name"),
    ({**WEEKLY, "body": "step. " * (MAX_PROPOSAL_CHARS // 6 + 10)}, f"at most {MAX_PROPOSAL_CHARS}"),
    ({"action": "create", "name": "broken", "skill_md": "---\nname: broken\ndescription: [unclosed\n---\nbody",
      "reason": "x"}, "not valid YAML"),
    ({"action": "create", "name": "twice",
      "skill_md": "---\nname: twice\nname: twice\ndescription: d\n---\nbody", "reason": "x"}, "'name' twice"),
    ({"action": "create", "name": "extra", "skill_md": "---\nname: extra\ndescription: d\nrun: rm -rf /\n---\nbody",
      "reason": "x"}, "unknown front-matter key 'run'"),
]


# The gate's reasons are its own, whatever the engine: PostgreSQL stores one refusal.
@pytest.mark.parametrize(("settings", "answer", "why"),
                         [*(("sqlite", *refusal) for refusal in REFUSALS), ("postgresql", *REFUSALS[0])],
                         indirect=["settings"])
async def test_the_gate_refuses_with_a_reason_and_the_review_still_ends(skills_settings: Settings,
                                                                        answer: dict[str, Any], why: str) -> None:
    async with agent(skills_settings, Reviews(answer)) as h:
        await tool_heavy_turn(h)
        [refused] = await h.runtime.skills.proposals(None, None)
        counts = of_kind(await job_counts(h.runtime.db), "review_skills")
        skills = [s.name for s in await h.runtime.skills.skills(None)]
    assert refused.status is ProposalStatus.REFUSED
    assert why in refused.reason and refused.reason.startswith("refused: ")
    assert "sk-abcdefghijklmnopqrstuvwx" not in refused.text  # the secret is not kept either
    assert counts == {"done": 1}
    assert skills == ["reminders", "web-research", "write-a-skill"]


async def test_a_failing_review_is_retried_and_reads_the_turns_it_missed(skills_settings: Settings) -> None:
    reviews = Reviews(RuntimeError("review model down"), RuntimeError("still down"), WEEKLY)
    async with agent(skills_settings, reviews) as h:
        await tool_heavy_turn(h, "first job: the invoices")
        assert of_kind(await job_counts(h.runtime.db), "review_skills") == {"failed": 1}
        assert await h.runtime.skills.store.review_mark(session_key()) == 0  # not cleared by a failure
        await tool_heavy_turn(h, "second job: the report")
        [proposal] = await h.runtime.skills.proposals(None)
    work = reviews.skill_reviews[-1][1].content
    assert "first job: the invoices" in work and "second job: the report" in work
    assert proposal.name == "weekly-report"


# SQLite only: it is about the background runner beside the turns, not what either stores.
@pytest.mark.parametrize("settings", ["sqlite"], indirect=True)
async def test_a_slow_or_failing_review_never_holds_up_the_turn(skills_settings: Settings) -> None:
    reviews = Reviews(RuntimeError("boom"))
    reviews.gate = asyncio.Event()
    async with agent(skills_settings, reviews) as h:
        final = await h.turn("make my weekly report")
        await asyncio.wait_for(reviews.started.wait(), 10)
        # The answer was delivered while the review is still waiting on its model.
        assert final.kind is OutboundKind.FINAL and final.text == "Here is your report."
        assert not reviews.gate.is_set()
        second = await h.turn("and again")
        assert second.kind is OutboundKind.FINAL
        reviews.gate.set()
        await h.runtime.runner.wait_idle()
        assert not h.chats["c1"].of(OutboundKind.ERROR)


async def test_low_risk_proposals_can_be_admitted_by_policy_and_risky_ones_still_wait(
        skills_settings: Settings) -> None:
    risky = {**WEEKLY, "name": "deploy", "description": "Deploy the site.",
             "body": "Run this with the shell tool:\n```bash\n./deploy.sh\n```"}
    config = skills_settings.model_copy(update={"skills_auto_admit": "low-risk"})
    async with agent(config, Reviews(WEEKLY, risky)) as h:
        await tool_heavy_turn(h)
        await tool_heavy_turn(h, "deploy it")
        proposals = {p.name: p for p in await h.runtime.skills.proposals(None, None)}
        names = [s.name for s in await h.runtime.skills.skills(IDENTITY)]
    assert proposals["weekly-report"].status is ProposalStatus.ADMITTED
    assert proposals["weekly-report"].decided_by == "policy"
    assert proposals["deploy"].status is ProposalStatus.PENDING
    assert proposals["deploy"].risk is SkillRisk.HIGH and "runs commands" in proposals["deploy"].risk_reasons[0]
    assert "weekly-report" in names and "deploy" not in names


async def test_a_near_copy_of_a_skill_is_proposed_as_its_new_version(skills_settings: Settings) -> None:
    copy = {**WEEKLY, "name": "friday-report", "body": WEEKLY["body"] + "\n4. Send it."}
    async with agent(skills_settings, Reviews(WEEKLY, copy)) as h:
        await tool_heavy_turn(h)
        [first] = await h.runtime.skills.proposals(IDENTITY)
        await h.runtime.skills.decide(first.id, True, "tester")
        await tool_heavy_turn(h, "the friday report")
        [second] = await h.runtime.skills.proposals(IDENTITY)
        admitted = await h.runtime.skills.decide(second.id, True, "tester")
        names = [s.name for s in await h.runtime.skills.skills(IDENTITY)]
    assert (second.name, second.action, second.base_version) == ("weekly-report", "patch", 1)
    assert "friday-report" in second.reason and "merged into it" in second.reason
    assert "+4. Send it." in second.diff
    assert admitted.version == 2 and "friday-report" not in names


async def test_learned_skills_and_proposals_stay_with_their_identity(skills_settings: Settings) -> None:
    config = skills_settings.model_copy(update={"identities": {"alice": ["test:alice"], "bob": ["test:bob"]}})
    async with agent(config, Reviews(WEEKLY, {**WEEKLY, "name": "bobs-way", "description": "Bob's own way."})) as h:
        await h.runtime.bus.publish_inbound(InboundEvent(channel="test", chat_id="a", sender_id="alice",
                                                         text="make my weekly report", message_id="m-a"))
        await h.next_closing("a")
        await h.runtime.runner.wait_idle()
        library = h.runtime.skills
        [alices] = await library.proposals("alice")
        assert await library.proposals("bob") == []
        with pytest.raises(SkillNotFound):
            await library.proposal(alices.id, "bob")
        with pytest.raises(SkillNotFound):
            await library.decide(alices.id, True, "bob", identity="bob")
        await library.decide(alices.id, True, "alice", identity="alice")
        assert "weekly-report" in [s.name for s in await library.skills("alice")]
        assert "weekly-report" not in [s.name for s in await library.skills("bob")]
        assert "weekly-report" not in await library.index("bob")
        with pytest.raises(SkillNotFound):
            await library.view("bob", "weekly-report")
        await h.runtime.bus.publish_inbound(InboundEvent(channel="test", chat_id="b", sender_id="bob",
                                                         text="use weekly-report", message_id="m-b"))
        answer = await h.next_closing("b")
    assert "no skill 'weekly-report'" in answer.text


async def test_a_learned_version_of_a_shared_skill_is_the_learners_only(tmp_path: Path, db: Any) -> None:
    library = SkillLibrary(skill_library(Settings(home=tmp_path), db).store)
    await library.store.add_version(NewVersion(SHARED, "tidy", "Tidy up.", render_skill_md("tidy", "Tidy up.", "Old."),
                                               "test", "local", origin=SkillOrigin.IMPORTED))
    await library.store.add_version(NewVersion("alice", "tidy", "Tidy up.", render_skill_md("tidy", "Tidy up.", "New."),
                                               "test", "alice", origin=SkillOrigin.LEARNED))
    assert "New." in await library.view("alice", "tidy")
    assert "Old." in await library.view("bob", "tidy")
    assert [s.identity for s in await library.skills("alice")] == ["alice"]


def write_skill(folder: Path, name: str, body: str, files: dict[str, str] | None = None,
                description: str = "A skill for tests.") -> Path:
    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "SKILL.md").write_text(render_skill_md(name, description, body))
    for relative, text in (files or {}).items():
        target = path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return path


async def test_import_rollback_and_history_keep_every_version(tmp_path: Path, db: Any) -> None:
    library = skill_library(Settings(home=tmp_path / "home"), db)
    source = tmp_path / "src"
    write_skill(source, "csv-clean", "Version one text.", {"scripts/clean.py": "print('v1')\n"})
    first = await library.import_folder(source / "csv-clean", "local")
    original = first.text
    write_skill(source, "csv-clean", "Version two text.", {"scripts/clean.py": "print('v2')\n"})
    second = await library.import_folder(source / "csv-clean", "local")
    assert (first.version, second.version) == (1, 2)
    assert "-Version one text." in await library.diff(None, "csv-clean")
    restored = await library.rollback(None, "csv-clean", 1, "local")
    skill, current, history = await library.show(None, "csv-clean")
    assert restored.version == 3 and skill.version == 3
    assert current.text == original  # the exact text, byte for byte
    assert current.files == {"scripts/clean.py": "print('v1')\n"}
    assert [(v.version, v.source) for v in history] == [
        (1, f"imported from {source / 'csv-clean'}"), (2, f"imported from {source / 'csv-clean'}"),
        (3, "rollback to version 1")]
    assert [v.text for v in history][:2] == [original, second.text]  # nothing was overwritten
    with pytest.raises(SkillNotFound, match="no version 9"):
        await library.rollback(None, "csv-clean", 9, "local")


async def test_skill_folders_load_despite_a_bad_one_and_edits_become_versions(tmp_path: Path, db: Any) -> None:
    settings = Settings(home=tmp_path / "home")
    folder = settings.skills_path
    write_skill(folder, "good-one", "Do the good thing.")
    bad = folder / "bad-one"
    bad.mkdir(parents=True)
    (bad / "SKILL.md").write_text("no front matter here")
    (folder / "Not_A_Name").mkdir()
    library = skill_library(settings, db)
    await library.sync()
    names = [s.name for s in await library.skills(None)]
    assert "good-one" in names and "reminders" in names and "bad-one" not in names
    assert "must start with YAML front matter" in library.load_errors[str(bad)]
    assert "invalid skill name 'Not_A_Name'" in library.load_errors[str(folder / "Not_A_Name")]
    write_skill(folder, "good-one", "Do the better thing.")
    await library.sync(force=True)
    _, current, history = await library.show(None, "good-one")
    assert [v.version for v in history] == [1, 2] and "better" in current.text
    await library.sync(force=True)  # read again, unchanged: no new version
    assert len((await library.show(None, "good-one"))[2]) == 2


async def test_skill_view_reads_files_and_puts_scripts_in_the_workspace(tmp_path: Path, db: Any) -> None:
    settings = Settings(home=tmp_path / "home")
    write_skill(settings.skills_path, "with-files", "See references/notes.md; run scripts/go.py.",
                {"references/notes.md": "Some notes.", "scripts/go.py": "print('go')\n"})
    library = skill_library(settings, db)
    await library.sync()
    body = await library.view("someone", "with-files")
    assert "references/notes.md, scripts/go.py" in body
    assert await library.view("someone", "with-files", "references/notes.md") == "Some notes."
    script = await library.view("someone", "with-files", "scripts/go.py",
                               workspace=Workspaces(settings.workspace_dir).for_identity("someone"))
    assert "run it with the shell tool" in script
    assert (settings.workspace_dir / ".skills/with-files/scripts/go.py").read_text() == "print('go')\n"
    with pytest.raises(SkillNotFound, match=re.escape("has no file '../../etc/passwd'")):
        await library.view("someone", "with-files", "../../etc/passwd")
    with pytest.raises(SkillNotFound, match="come close: with-files"):
        await library.view("someone", "with-file")


async def test_the_index_stays_within_its_budget_in_a_stable_order(tmp_path: Path, db: Any) -> None:
    settings = Settings(home=tmp_path / "home", skills_index_chars=2_000)
    library = skill_library(settings, db)
    await library.sync()
    for n in range(300):
        name = f"skill-{n:04d}"
        await library.store.add_version(NewVersion(SHARED, name, f"Does task number {n} " + "well " * 30,
                                                   render_skill_md(name, f"Does task {n}.", "Body."), "test",
                                                   "local", origin=SkillOrigin.IMPORTED))
    index = await library.index("anyone")
    assert len(index) <= 2_000
    lines = index.splitlines()
    listed = [line[2:].split(":")[0] for line in lines if line.startswith("- ")]
    assert listed == sorted(listed) and listed[0] == "reminders"
    assert "more skills are not listed" in lines[-1]
    assert index == await library.index("someone else")  # the same prefix for every turn, cacheable


async def test_the_curator_archives_unused_skills_and_keeps_them(tmp_path: Path, db: Any) -> None:
    now = [1_000_000_000.0]
    library = skill_library(Settings(home=tmp_path / "home", skills_archive_after_days=30), db)
    library._clock = lambda: now[0]
    await library.sync()
    now[0] = 4_000_000_000.0
    await library.view("anyone", "reminders")  # used just now: stays
    archived = await library.curate()
    assert {s.name for s in archived} == {"web-research", "write-a-skill"}
    active = [s.name for s in await library.skills(None)]
    everything = {s.name: s.status for s in await library.skills(None, include_archived=True)}
    assert active == ["reminders"]
    assert everything["web-research"] is SkillStatus.ARCHIVED
    assert "web-research" not in await library.index("anyone")
    await library.rollback(None, "web-research", 1, "local")  # a person brings it back
    assert "web-research" in await library.index("anyone")


def test_front_matter_is_parsed_strictly() -> None:
    good = parse_skill_md("---\nname: a-b\ndescription: Does a.\nallowed-tools: shell web_fetch\n"
                          "metadata:\n  author: me\n---\n# A\nSteps.")
    assert good.allowed_tools == ("shell", "web_fetch") and good.metadata == {"author": "me"}
    assert assess(good).risk is SkillRisk.HIGH
    for text, why in [
        ("name: x\n", "must start with YAML front matter"),
        ("---\n- a\n---\nbody", "must be a mapping"),
        ("---\nname: x\n---\nbody", "needs a 'description'"),
        ("---\nname: X\ndescription: d\n---\nbody", "invalid skill name"),
        ("---\nname: x\ndescription: d\n---\n", "no instructions"),
        ("---\nname: x\ndescription: d\nmetadata: [1]\n---\nbody", "'metadata' must map"),
    ]:
        with pytest.raises(SkillFormatError, match=why):
            parse_skill_md(text)
    with pytest.raises(SkillFormatError, match="but its folder is 'y'"):
        parse_skill_md("---\nname: x\ndescription: d\n---\nbody", expected_name="y")
    assert assess(parse_skill_md("---\nname: x\ndescription: d\n---\nRead the notes.")).risk is SkillRisk.LOW


def test_a_review_answer_must_be_the_structure_asked_for() -> None:
    assert parse_answer('```json\n{"action": "none"}\n```').action == "none"
    assert parse_answer("NONE.").action == "none"  # what a model says when told there may be nothing
    assert parse_answer('<think>hm</think>Sure: {"action": "create", "name": "x"}').name == "x"
    with pytest.raises(ValueError, match="not the JSON asked for"):
        parse_answer("I think a skill would help.")
    with pytest.raises(ValueError, match="not the JSON asked for"):
        parse_answer('{"action": "delete-everything"}')


async def test_a_folder_with_a_link_out_or_a_binary_file_is_refused(tmp_path: Path) -> None:
    linked = write_skill(tmp_path, "linked", "Body.")
    (linked / "references").mkdir()
    (linked / "references" / "secret").symlink_to("/etc/hostname")
    with pytest.raises(SkillFormatError, match="links outside"):
        read_folder(linked)
    binary = write_skill(tmp_path, "binary", "Body.")
    (binary / "assets").mkdir()
    (binary / "assets" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(SkillFormatError, match="not UTF-8 text"):
        read_folder(binary)


async def test_skills_survive_a_restart(skills_settings: Settings) -> None:
    async with agent(skills_settings, Reviews(WEEKLY)) as h:
        await tool_heavy_turn(h)
    async with open_database(skills_settings) as db:
        library = skill_library(skills_settings, db)
        [pending] = await library.proposals(None)
        await library.decide(pending.id, True, "local")
    async with agent(skills_settings, Reviews()) as h:
        final = await h.turn("use weekly-report")
    assert "Group it by project." in final.text


# SQLite only: it is about the library looking at its folders in the background; the versions a
# folder becomes are stored on both engines in test_skill_folders_load_despite_a_bad_one_and_edits_become_versions.
@pytest.mark.parametrize("settings", ["sqlite"], indirect=True)
async def test_a_folder_added_while_running_reaches_a_later_turn(skills_settings: Settings) -> None:
    async with agent(skills_settings, Reviews()) as h:
        await h.turn("hello")
        write_skill(skills_settings.skills_path, "fresh-one", "Brand new steps.")

        async def listed() -> None:
            while "- fresh-one:" not in await h.runtime.skills.index(IDENTITY):
                await asyncio.sleep(0.2)  # read in the background, never by the turn itself

        await asyncio.wait_for(listed(), 20)
        final = await h.turn("use fresh-one")
    assert "Brand new steps." in final.text
