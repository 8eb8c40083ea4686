"""The `delegate` tool: a task handed to a child turn in a session of its own, with a toolset no
wider than its parent's, its approvals put to the person who asked, its depth, tokens, time and
number bounded, its cost rolled up into its parent's, and its trace kept under its parent's. A
kill -9 mid-child resumes the child from its committed steps: no step runs twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
from collections import defaultdict
from typing import Any

import httpx
import pytest

from ember.config.settings import Settings
from ember.core.events import InboundEvent, OutboundKind
from ember.core.memory import shared_identity
from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import Decision, Risk, ToolSpec
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.pipeline.agent_spec import AgentSpec
from ember.tools.approval import ToolPolicy
from ember.tools.base import FunctionTool, ToolRegistry
from ember.tools.delegate import DelegationSpec
from ember.tools.workspace import folder_name
from tests.conftest import CHANNEL, IDENTITY, NoteArgs, note_tool, session_key
from tests.gatewayproc import EMBER, LaunchGateway
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply, tool_call

ASK = "Find out what the notes say."
TASK = "Read the notes and sum them up."


def delegating(config: Settings, **limits: Any) -> Settings:
    return config.model_copy(update={"delegation": DelegationSpec(**limits)})


def call(name: str, call_id: str, **arguments: Any) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=json.dumps(arguments))


def is_child(messages: list[Message]) -> bool:
    return next(m for m in messages if m.role is Role.USER).content.startswith(TASK)


class Family:
    """A model for a parent turn that delegates and the child turns it asks for: the parent delegates
    `delegations` (each a delegate call's arguments) in one step, then answers with what came back;
    each child makes `child_steps` (tool calls, one step each), then answers with the last result."""

    def __init__(self, delegations: list[dict[str, Any]], child_steps: list[ToolCall], *,
                 tokens: tuple[int, int] = (0, 0)) -> None:
        self.delegations = delegations
        self.child_steps = child_steps
        self.tokens = tokens
        self.offered: defaultdict[str, list[list[str]]] = defaultdict(list)
        self.model = FunctionModel(self.reply)

    def reply(self, messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        used = {"input_tokens": self.tokens[0], "output_tokens": self.tokens[1]}
        last = messages[-1]
        if is_child(messages):
            self.offered["child"].append([spec.name for spec in tools])
            made = sum(1 for m in messages if m.role is Role.TOOL)
            if made < len(self.child_steps):
                return ModelReply(tool_calls=(self.child_steps[made],), **used)
            return ModelReply(text=f"child found: {last.content}", **used)
        self.offered["parent"].append([spec.name for spec in tools])
        if last.role is Role.USER:
            return ModelReply(tool_calls=tuple(call("delegate", f"d{n}", **arguments)
                                               for n, arguments in enumerate(self.delegations)), **used)
        results = [m.content for m in messages if m.role is Role.TOOL]
        return ModelReply(text="parent says: " + " | ".join(results), **used)


def tools_of(noted: list[str]) -> ToolRegistry:
    return ToolRegistry([note_tool(noted), note_tool(noted, name="jot")])


async def test_a_child_works_in_a_session_of_its_own_with_no_more_tools_than_asked(start, settings) -> None:  # type: ignore[no-untyped-def]
    noted: list[str] = []
    family = Family([{"task": TASK, "tools": ["note"]}], [call("note", "n1", text="from the child")],
                    tokens=(100, 10))
    async with start(family.model, tools=tools_of(noted), config=delegating(settings)) as h:
        final = await h.turn(ASK)
        await h.runtime.traces.flush()
        parent = await h.runtime.traces.get(final.turn_id)
        assert parent is not None
        [delegated] = parent.detail["delegations"]
        child = await h.runtime.traces.get(delegated["turn_id"])
        parent_history = (await h.runtime.sessions.load(session_key())).messages
        await h.runtime.usage.flush()
        charged = await h.runtime.usage.store.totals("session")

    assert final.kind is OutboundKind.FINAL
    assert final.text == "parent says: child found: noted from the child" and noted == ["from the child"]
    assert sorted(family.offered["parent"][0]) == ["delegate", "jot", "note"]
    assert family.offered["child"] == [["note"], ["note"]]  # what the task asked for, and no delegate
    child_requests = [r for r in family.model.requests if is_child(r)]
    assert all(m.content != ASK for r in child_requests for m in r)  # it sees the task, not the chat
    # The child's steps are in its own session, not its parent's.
    assert child is not None and child.session_key.startswith("delegate:") and child.status == "ok"
    assert child.detail["delegated_by"]["turn_id"] == final.turn_id
    assert [c["name"] for c in child.detail["tool_calls"]] == ["note"]
    assert [m.role for m in parent_history] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    # Its cost rolls up: two calls of its own, in the parent's trace and in the parent's usage.
    assert (delegated["model_calls"], delegated["input_tokens"], delegated["output_tokens"]) == (2, 200, 20)
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens) == (400, 40)
    # And the person's conversation is charged for it (`ember usage --by session`, the page's usage panel).
    assert [(row["key"], row["calls"], row["input_tokens"]) for row in charged] == [(session_key(), 4, 400)]


async def test_a_child_of_a_group_chats_turn_works_in_the_groups_folder_not_the_askers_own(start, settings) -> None:  # type: ignore[no-untyped-def]
    def reply(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        last = messages[-1]
        if is_child(messages):
            if last.role is Role.USER:
                return ModelReply(tool_calls=(call("list_dir", "l1", path="."),))
            return ModelReply(text=f"child found: {last.content}")
        if last.role is Role.USER:
            return ModelReply(text="hi") if last.content == "hello all" else ModelReply(
                tool_calls=(call("delegate", "d1", task=TASK),))
        return ModelReply(text=f"parent says: {last.content}")

    group, own = (settings.workspaces_dir / folder_name(identity)
                  for identity in (shared_identity(session_key("group")), IDENTITY))
    for folder, name in ((group, "group-plan.txt"), (own, "private-diary.txt")):
        folder.mkdir(parents=True)
        (folder / name).write_text("x")
    async with start(FunctionModel(reply), config=delegating(settings)) as h:
        await h.runtime.bus.publish_inbound(InboundEvent(channel=CHANNEL, chat_id="group", sender_id="ann",
                                                         text="hello all", message_id="m1"))
        await h.next_closing("group")
        await h.publish(ASK, chat="group")
        final = await h.next_closing("group")
    assert "group-plan.txt" in final.text and "private-diary.txt" not in final.text


async def test_the_person_who_asked_answers_the_childs_approval(start, settings) -> None:  # type: ignore[no-untyped-def]
    filed: list[str] = []

    async def file_it(args: NoteArgs) -> str:
        filed.append(args.text)
        return f"filed {args.text}"

    tools = ToolRegistry([FunctionTool("file", "File a note away.", NoteArgs, file_it, risk=Risk.WRITE)])
    family = Family([{"task": TASK}], [call("file", "f1", text="the report")])
    config = delegating(settings).model_copy(update={"tool_policy": ToolPolicy(timeout_s=10)})
    async with start(family.model, tools=tools, config=config) as h:
        await h.publish(ASK, can_approve=True)
        while not (asked := h.chats["c1"].of(OutboundKind.APPROVAL_REQUEST)):
            await asyncio.sleep(0.01)
        request = asked[0].approval
        assert request is not None and request.session_key == session_key()  # the asker's chat
        assert "for a delegated task" in asked[0].text and filed == []
        resolved = await h.runtime.approvals.resolve(request.id, Decision.APPROVE_ONCE, by="tester",
                                                     scope=session_key())
        final = await h.next_closing()

    assert resolved.value == "resolved"
    assert filed == ["the report"] and final.text == "parent says: child found: filed the report"


@pytest.mark.parametrize(("arguments", "refusal"), [
    ({"task": TASK, "tools": ["shell"]}, "Error: tools 'shell' are not yours to give; yours: delegate, jot, note"),
    ({"task": TASK, "agent": "nobody"}, "Error: there is no agent named 'nobody' (named agents: none are "
                                        "configured); leave agent unset for an agent like you"),
    ({"task": ""}, "Error: invalid arguments for delegate: task: String should have at least 1 character"),
])
async def test_a_task_the_parent_may_not_hand_over_is_refused_clearly(start, settings, arguments: dict[str, Any],  # type: ignore[no-untyped-def]
                                                                       refusal: str) -> None:
    family = Family([arguments], [])
    async with start(family.model, tools=tools_of([]), config=delegating(settings)) as h:
        final = await h.turn(ASK)
    assert final.text == f"parent says: {refusal}"
    assert family.offered["child"] == []  # no child turn ran


async def test_at_the_depth_limit_delegate_is_neither_offered_nor_run(start, settings) -> None:  # type: ignore[no-untyped-def]
    family = Family([{"task": TASK}], [call("delegate", "again", task=TASK + " Deeper.")])
    async with start(family.model, tools=tools_of([]), config=delegating(settings, max_depth=1)) as h:
        final = await h.turn(ASK)
    assert family.offered["child"][0] == ["note", "jot"]
    assert final.text == ("parent says: child found: Error: there is no tool named 'delegate' for this "
                          "delegated task. Available: note, jot.")


async def test_a_child_past_its_token_budget_takes_no_further_step(start, settings) -> None:  # type: ignore[no-untyped-def]
    noted: list[str] = []
    endless = [call("note", f"n{n}", text=str(n)) for n in range(10)]
    family = Family([{"task": TASK}], endless, tokens=(600, 0))
    async with start(family.model, tools=tools_of(noted), config=delegating(settings, token_budget=1_000)) as h:
        final = await h.turn(ASK)
    assert noted == ["0", "1"]  # 1,200 tokens after its second step: no third
    assert final.text == ("parent says: I stopped after using 1,200 tokens, over this task's budget of 1,000, "
                          "before reaching an answer.")


async def test_a_child_past_its_time_is_stopped_and_reported_again_if_asked_again(start, settings) -> None:  # type: ignore[no-untyped-def]
    async def stall(args: NoteArgs) -> str:
        await asyncio.sleep(30)
        return "never"

    tools = ToolRegistry([FunctionTool("stall", "Wait.", NoteArgs, stall, risk=Risk.READ)])
    family = Family([{"task": TASK}, {"task": TASK}], [call("stall", "s1", text="x")])
    async with start(family.model, tools=tools, config=delegating(settings, timeout_s=2)) as h:
        final = await h.turn(ASK)
    stopped = "Error: the delegated task ran past its 2 s limit ([delegation] timeout_s) and was stopped"
    # The same task asked twice in one step is one child: stopped once, and both calls are told so.
    assert final.text == f"parent says: {stopped} | {stopped}"
    assert len(family.offered["child"]) == 1


async def test_several_children_run_at_once_within_the_limit(start, settings) -> None:  # type: ignore[no-untyped-def]
    running, most = 0, 0
    two_running = asyncio.Event()

    async def reply(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        nonlocal running, most
        if not is_child(messages):
            if messages[-1].role is Role.USER:
                return ModelReply(tool_calls=tuple(call("delegate", f"d{n}", task=f"{TASK} Part {n}.")
                                                   for n in range(5)))
            return ModelReply(text=" | ".join(m.content for m in messages if m.role is Role.TOOL))
        running += 1
        most = max(most, running)
        if running == 2:
            two_running.set()
        await asyncio.wait_for(two_running.wait(), 10)  # the first waits for a second beside it
        await asyncio.sleep(0.05)  # time for a third to start, were the limit not kept
        running -= 1
        return ModelReply(text=f"done: {messages[-1].content[-7:]}")

    async with start(FunctionModel(reply), tools=tools_of([]), config=delegating(settings, max_concurrent=2)) as h:
        final = await h.turn(ASK)
    assert final.text == " | ".join(f"done: Part {n}." for n in range(5))
    assert most == 2


async def test_trace_show_prints_the_child_under_its_parent(start, settings) -> None:  # type: ignore[no-untyped-def]
    family = Family([{"task": TASK, "tools": ["note"]}], [call("note", "n1", text="x")], tokens=(7, 3))
    async with start(family.model, tools=tools_of([]), config=delegating(settings)) as h:
        final = await h.turn(ASK)
    env = {"EMBER_HOME": str(settings.home_dir), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    shown = subprocess.run([EMBER, "trace", "show", final.turn_id], env=env, capture_output=True, text=True,
                           timeout=60, check=True).stdout
    as_json = json.loads(subprocess.run([EMBER, "trace", "show", final.turn_id, "--json"], env=env,
                                        capture_output=True, text=True, timeout=60, check=True).stdout)
    [delegated] = as_json["delegations"]
    child = delegated["trace"]
    assert child["delegated_by"]["task"] == TASK and [c["name"] for c in child["tool_calls"]] == ["note"]
    assert "delegated to an agent: ok, 2 model calls, 14 / 6 tokens in / out" in shown
    assert f"    turn {child['turn_id']}" in shown  # indented under its parent
    assert shown.index(f"turn {final.turn_id}") < shown.index(f"turn {child['turn_id']}")


CRASH_ASK = "Look around the workspace, through a helper."


def crash_responder(held: threading.Event) -> Any:
    """The model of the kill test: the parent delegates, the child lists the workspace, then answers; while
    `held` is unset, the child's answer is held back (the test kills the gateway meanwhile)."""

    def respond(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        first = next(m for m in messages if m["role"] == "user")["content"]
        if first.startswith(TASK):
            if messages[-1]["role"] == "user":
                return Reply(tool_calls=(tool_call("list_dir", path="."),))
            return Reply(text="child found the workspace", hold=held, hold_timeout_s=15)
        if messages[-1]["role"] == "user":
            return Reply(tool_calls=(tool_call("delegate", task=TASK),))
        return Reply(text="parent: " + messages[-1]["content"])

    return respond


def test_kill_9_mid_child_resumes_it_without_running_a_step_twice(launch_gateway: LaunchGateway,
                                                                  model_server: ModelServer) -> None:
    held = threading.Event()
    model_server.responder = crash_responder(held)
    gateway = launch_gateway(model_server)

    def child_requests() -> list[list[dict[str, Any]]]:
        return [r["messages"] for r in model_server.requests
                if next(m for m in r["messages"] if m["role"] == "user")["content"].startswith(TASK)]

    def ask() -> None:
        with contextlib.suppress(httpx.TransportError):  # the gateway is killed under it
            httpx.post(gateway.url("/api/sessions/helper/messages"), json={"text": CRASH_ASK}, timeout=60)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    # The child's step (list_dir) is committed once its next model call is asked for: kill it there.
    wait_until(lambda: len(child_requests()) == 2, what="the child's second model call")
    gateway.kill()
    held.set()
    restarted = launch_gateway(model_server, port=gateway.port)

    def answered() -> list[dict[str, Any]]:
        messages = httpx.get(restarted.url("/api/sessions/helper/messages")).json()["messages"]
        return [m for m in messages if m["role"] == "assistant" and m["content"].startswith("parent:")]

    wait_until(lambda: bool(answered()), what="the resumed parent's answer")
    asking.join(timeout=5)
    assert [m["content"] for m in answered()] == ["parent: child found the workspace"]
    fresh = [r for r in child_requests() if r[-1]["role"] == "user"]
    assert len(fresh) == 1  # the child was resumed, not begun again: list_dir ran once
    last = child_requests()[-1]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool"]


async def test_a_named_agent_does_the_task_with_its_own_prompt_within_its_own_tools(start, settings) -> None:  # type: ignore[no-untyped-def]
    family = Family([{"task": TASK, "agent": "coder"}], [call("jot", "j1", text="x")])
    coder = AgentSpec(description="writes code", system_prompt="You are Coder.", tools=["note"])
    config = delegating(settings).model_copy(update={"agents": {"coder": coder}})
    async with start(family.model, tools=tools_of([]), config=config) as h:
        final = await h.turn(ASK)
    [child_prompt, *_] = [r for r in family.model.requests if is_child(r)]
    assert child_prompt[0].content.startswith("You are Coder.")
    assert family.offered["child"][0] == ["note"]  # the parent's tools, within the coder's own
    assert final.text == ("parent says: child found: Error: there is no tool named 'jot' for agent coder. "
                          "Available: note.")
