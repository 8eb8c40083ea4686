"""Per-identity workspaces: what one identity's tools can reach of another's files.

Alice and Bob each have EMBER_HOME/workspaces/<identity>/; `local` keeps
`workspace`; workspace_scope = "shared" puts everyone in one folder; a chat
several people wrote in works in the group's own folder. Every call goes
through the real tools, as a turn would make it.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.app.runtime import build_runtime, running
from ember.app.services import skill_library
from ember.app.tools import workspaces
from ember.config.settings import Settings
from ember.core.errors import ConfigError
from ember.core.events import InboundEvent, OutboundKind
from ember.core.journal import TurnJournal
from ember.core.memory import shared_identity
from ember.core.messages import Message, Role, ToolCall
from ember.core.schedule import Schedule
from ember.core.tasks import Task
from ember.core.tools import ToolRun, ToolSpec
from ember.memory.identity import Identities
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store.engine import Database
from ember.store.tasks import run_event
from ember.tools.base import ToolRegistry
from ember.tools.files import file_tools
from ember.tools.shell import shell_tool
from ember.tools.skills import skill_tools
from ember.tools.workspace import Workspaces, folder_name
from tests.conftest import FixedApprover, Harness
from tests.gatewayproc import LaunchGateway
from tests.modelserver import ModelServer, Reply, tool_call
from tests.test_skills import write_skill

SECRET = "alice's secret: the diary"
KEYS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}


def tools(spaces: Workspaces) -> ToolRegistry:
    return ToolRegistry([*file_tools(spaces), shell_tool(spaces, timeout_s=10)])


async def call(registry: ToolRegistry, identity: str, tool: str, **arguments: Any) -> str:
    run = ToolRun(f"http:{identity}:s", uuid.uuid4().hex, FixedApprover(), TurnJournal(), identity)
    return await registry.call(ToolCall(id="c1", name=tool, arguments=json.dumps(arguments)), run)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def per_identity(home: Path) -> Workspaces:
    return Workspaces(home / "workspace", home / "workspaces")


async def test_bob_reaches_nothing_of_alices_workspace(per_identity: Workspaces, home: Path) -> None:
    registry = tools(per_identity)
    assert (await call(registry, "alice", "write_file", path="diary.txt", content=SECRET)).startswith("created")
    assert (home / "workspaces/alice/diary.txt").read_text() == SECRET
    alice_dir = str(home / "workspaces/alice")
    attempts = [
        ("read_file", {"path": "diary.txt"}), ("read_file", {"path": "../alice/diary.txt"}),
        ("read_file", {"path": f"{alice_dir}/diary.txt"}), ("list_dir", {"path": "."}),
        ("list_dir", {"path": "../alice"}), ("glob", {"pattern": "**"}), ("glob", {"pattern": "../alice/*"}),
        ("grep", {"pattern": "secret"}), ("grep", {"pattern": "secret", "path": "../alice"}),
        ("edit_file", {"path": "diary.txt", "old": "secret", "new": "nothing"}),
        ("shell", {"command": "cat diary.txt"}), ("shell", {"command": "ls"}),
    ]
    results = {f"{name} {arguments}": await call(registry, "bob", name, **arguments) for name, arguments in attempts}
    assert not [result for result in results.values() if SECRET in result]
    listings = [results[f"{name} {arguments}"] for name, arguments in attempts[3:9]]
    assert not [listing for listing in listings if "diary.txt" in listing.split("\n", 1)[-1]], listings
    assert "No such file" in results["shell {'command': 'cat diary.txt'}"]
    assert (await call(registry, "bob", "write_file", path="diary.txt", content="bob's")).startswith("created")
    assert (home / "workspaces/alice/diary.txt").read_text() == SECRET
    assert SECRET in await call(registry, "alice", "read_file", path="diary.txt")
    assert SECRET in await call(registry, "alice", "shell", command="cat diary.txt")


async def test_links_planted_in_ones_own_workspace_lead_nowhere(per_identity: Workspaces, home: Path) -> None:
    registry = tools(per_identity)
    await call(registry, "alice", "write_file", path="notes/diary.txt", content=SECRET)
    await call(registry, "bob", "write_file", path="mine.txt", content="bob's")
    bob = home / "workspaces/bob"
    (bob / "link.txt").symlink_to(home / "workspaces/alice/notes/diary.txt")
    (bob / "linkdir").symlink_to(home / "workspaces/alice/notes")
    (bob / "relative").symlink_to("../alice/notes")
    for name, arguments in [("read_file", {"path": "link.txt"}), ("read_file", {"path": "linkdir/diary.txt"}),
                            ("read_file", {"path": "relative/diary.txt"}), ("list_dir", {"path": "linkdir"}),
                            ("glob", {"pattern": "**/*.txt"}), ("grep", {"pattern": "secret"}),
                            ("grep", {"pattern": "secret", "path": "relative"}),
                            ("edit_file", {"path": "link.txt", "old": "secret", "new": "x"}),
                            ("write_file", {"path": "linkdir/diary.txt", "content": "overwritten"})]:
        result = await call(registry, "bob", name, **arguments)
        assert SECRET not in result and "overwrote" not in result and "edited" not in result, (name, result)
    assert (home / "workspaces/alice/notes/diary.txt").read_text() == SECRET


async def test_a_link_in_place_of_an_identitys_folder_is_refused(per_identity: Workspaces, home: Path) -> None:
    registry = tools(per_identity)
    await call(registry, "alice", "write_file", path="diary.txt", content=SECRET)
    (home / "workspaces/mallory").symlink_to(home / "workspaces/alice")
    result = await call(registry, "mallory", "read_file", path="diary.txt")
    assert result.startswith("Error: the workspace mallory is not a plain folder")


async def test_local_keeps_workspace_and_shared_scope_shares_it(home: Path, tmp_path: Path) -> None:
    registry = tools(Workspaces(tmp_path / "agent-files", home / "workspaces"))
    await call(registry, "local", "write_file", path="plan.txt", content="the plan")
    assert (tmp_path / "agent-files/plan.txt").read_text() == "the plan"
    assert "no such file" in await call(registry, "alice", "read_file", path="plan.txt")
    other = tmp_path / "other-home"
    shared = tools(workspaces(Settings(home=other, workspace_scope="shared"), None))  # type: ignore[arg-type]
    await call(shared, "alice", "write_file", path="diary.txt", content=SECRET)
    assert SECRET in await call(shared, "bob", "read_file", path="diary.txt")
    assert SECRET in await call(shared, "local", "shell", command="cat diary.txt")
    assert (other / "workspace/diary.txt").exists() and not (other / "workspaces").exists()


def test_a_workspace_holding_the_identities_folders_is_refused_at_start(home: Path) -> None:
    for workspace in (home, home / "workspaces", home / "workspaces/alice"):
        with pytest.raises(ConfigError, match="must not lie one inside the other"):
            workspaces(Settings(home=home, workspace=workspace), None)
    workspaces(Settings(home=home, workspace=home, workspace_scope="shared"), None)


async def test_skill_scripts_land_in_the_callers_workspace(home: Path, per_identity: Workspaces,
                                                           db: Database) -> None:
    config = Settings(home=home)
    write_skill(config.skills_path, "with-script", "Run scripts/go.sh.", {"scripts/go.sh": "echo go\n"})
    library = skill_library(config, db)
    await library.sync()
    registry = ToolRegistry([*skill_tools(library, per_identity), shell_tool(per_identity, timeout_s=10)])
    result = await call(registry, "alice", "skill_view", name="with-script", file="scripts/go.sh")
    assert "at .skills/with-script/scripts/go.sh in the workspace" in result
    assert (home / "workspaces/alice/.skills/with-script/scripts/go.sh").exists()
    assert not (home / "workspace/.skills").exists()
    assert "exit code: 0\ngo" in await call(registry, "alice", "shell", command="sh .skills/with-script/scripts/go.sh")
    assert "No such file" in await call(registry, "bob", "shell", command="sh .skills/with-script/scripts/go.sh")
    # A link planted where the script goes does not carry Bob's copy into Alice's folder.
    (home / "workspaces/bob/.skills").symlink_to(home / "workspaces/alice/.skills")
    (home / "workspaces/alice/.skills/with-script/scripts/go.sh").write_text("echo alice's own\n")
    refused = await call(registry, "bob", "skill_view", name="with-script", file="scripts/go.sh")
    assert refused.startswith("Error:") and "outside the workspace" in refused
    assert (home / "workspaces/alice/.skills/with-script/scripts/go.sh").read_text() == "echo alice's own\n"


IDENTITIES = st.one_of(
    st.text(max_size=300),
    st.sampled_from(["", ".", "..", "/", "a/b", "../alice", "alice", "Alice", "ALICE", "telegram:123",
                     "shared:http:alice:work", "x" * 400, "é", "e\u0301", "\x00", "-", "alice+0123456789abcdef"]),
    st.text(alphabet="aA./+-_:é", max_size=70),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(IDENTITIES, min_size=2, max_size=6, unique=True))
def test_folder_names_are_safe_single_components_and_distinct(identities: list[str]) -> None:
    names = [folder_name(identity) for identity in identities]
    for name in names:
        assert name not in ("", ".", "..") and "/" not in name and "\x00" not in name
        assert len(name.encode()) <= 255 and re.fullmatch(r"[a-z0-9._+-]+", name)
    assert len({name.lower() for name in names}) == len(names)  # distinct even where case is ignored


def test_folder_names_read_as_their_identity() -> None:
    assert folder_name("alice") == "alice"
    assert folder_name("bob-2.phone") == "bob-2.phone"
    assert folder_name("Alice").startswith("alice+") and folder_name("telegram:123").startswith("telegram-123+")
    assert folder_name("../etc").startswith("etc+") and folder_name("José").startswith("jose+")


def _writer(messages: list[Message], specs: list[ToolSpec]) -> ModelReply:
    """Writes the file the user names, then says what the tool answered."""
    last = messages[-1]
    if last.role is Role.TOOL:
        return ModelReply(text=f"tool said: {last.content}")
    name = str(last.content).split()[-1]
    return ModelReply(text="", tool_calls=(ToolCall(id=uuid.uuid4().hex, name="write_file",
                                                    arguments=json.dumps({"path": name, "content": name})),))


async def test_a_group_chat_works_in_the_groups_folder_once_two_people_wrote(home: Path) -> None:
    config = Settings(home=home, tool_policy={"write": "allow"}, consolidation_threshold=1_000)
    runtime = await build_runtime(config, FunctionModel(_writer))
    async with running(runtime):
        harness = Harness(runtime)
        try:
            for sender, file in [("ann", "first.txt"), ("ben", "second.txt"), ("ann", "third.txt")]:
                await runtime.bus.publish_inbound(InboundEvent(channel="test", chat_id="g1", sender_id=sender,
                                                               text=f"write {file}", message_id=uuid.uuid4().hex))
                final = await harness.next_closing("g1")
                assert final.kind is OutboundKind.FINAL and "created" in final.text, final.text
        finally:
            await harness.close()
    group = home / "workspaces" / folder_name(shared_identity("test:g1"))
    assert os.listdir(home / "workspaces" / folder_name("test:ann")) == ["first.txt"]
    assert sorted(os.listdir(group)) == ["second.txt", "third.txt"]
    assert not (home / "workspaces" / folder_name("test:ben")).exists()


def _tool_runner(body: dict[str, Any]) -> Reply:
    """The gateway's model: "RUN <tool> <json>" calls that tool; a tool's result is the answer."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return Reply(text=f"tool said: {last['content']}")
    found = re.search(r"RUN (\w+) (\{.*\})", str(last.get("content")))
    return Reply(tool_calls=(tool_call(found[1], **json.loads(found[2])),)) if found else Reply(text="ok")


def test_alices_diary_is_nowhere_bobs_turns_can_reach_over_the_gateway(launch_gateway: LaunchGateway,
                                                                       model_server: ModelServer) -> None:
    model_server.responder = _tool_runner
    gateway = launch_gateway(model_server, keys=KEYS, EMBER_TOOL_POLICY__WRITE="allow",
                             EMBER_TOOL_POLICY__EXECUTE="allow")

    def turn(key: str, tool: str, **arguments: Any) -> str:
        response = httpx.post(gateway.url("/v1/chat/completions"), timeout=60, headers={
            "Authorization": f"Bearer {KEYS[key]}", "X-Ember-Session": "diary"}, json={
            "model": "ember", "messages": [{"role": "user", "content": f"RUN {tool} {json.dumps(arguments)}"}]})
        assert response.status_code == 200, response.text
        answer: str = response.json()["choices"][0]["message"]["content"]
        return answer

    assert "created diary.txt" in turn("alice", "write_file", path="diary.txt", content=SECRET)
    for tool, arguments in [("read_file", {"path": "diary.txt"}), ("list_dir", {"path": "."}),
                            ("glob", {"pattern": "**/*.txt"}), ("grep", {"pattern": "secret"}),
                            ("read_file", {"path": "../alice/diary.txt"}), ("shell", {"command": "cat diary.txt"})]:
        answer = turn("bob", tool, **arguments)
        assert SECRET not in answer and "diary.txt\n" not in answer, (tool, answer)
    assert "created diary.txt" in turn("bob", "write_file", path="diary.txt", content="bob's day")
    assert SECRET in turn("alice", "read_file", path="diary.txt")
    assert (gateway.home / "workspaces/alice/diary.txt").read_text() == SECRET
    assert (gateway.home / "workspaces/bob/diary.txt").read_text() == "bob's day"
    assert not (gateway.home / "workspace/diary.txt").exists()


def test_scheduled_and_a2a_turns_run_as_their_owner() -> None:
    """Whose workspace a cron run and an A2A call use: the owner's, bindings included."""
    identities = Identities({"alice": ["http:alice-phone", "telegram:42"]})
    assert identities.resolve("a2a", "alice-phone") == "alice"  # the A2A call of a key bound to her
    assert identities.resolve("a2a", "bob") == "bob"
    task = Task(id="t1", identity=identities.resolve("telegram", "42"), prompt="p", schedule=Schedule.every("1h", 0.0),
                reply=None)
    run = run_event(task, 0.0)
    assert identities.resolve(run.channel, run.sender_id) == "alice"
