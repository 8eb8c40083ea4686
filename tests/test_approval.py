"""Permission to act: the policy's decisions, the gate around the tools, and
approval requests travelling through a turn's channel."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ember.app.runtime import build_runtime
from ember.bus.memory import InProcessBus
from ember.config.settings import Settings
from ember.core.events import InboundEvent, OutboundKind
from ember.core.messages import Message, ToolCall
from ember.core.tools import Decision, Risk, ToolAction
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel, ScriptedModel
from ember.runtime.approvals import ApprovalBroker, Resolution
from ember.store.approvals import SqlApprovalStore
from ember.store.sqlite.database import SqliteDatabase
from ember.tools.approval import ApprovalGate, Rule, ToolPolicy
from ember.tools.base import FunctionTool, ToolRegistry
from ember.tools.explain import ApprovalExplainer
from tests.conftest import FixedApprover, running_harness, session_key, tool_run
from tests.pgserver import RUNTIMES, engine_settings


@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """A runtime's approval requests and traces kept on SQLite, on PostgreSQL, and on PostgreSQL
    with the Redis bus."""
    return engine_settings(settings, request.param, request)


class Note(BaseModel):
    text: str


class NoArgs(BaseModel):
    pass


def notebook(written: list[str]) -> ToolRegistry:
    async def write_note(args: Note) -> str:
        written.append(args.text)
        return f"noted {args.text!r}"

    async def read_notes(args: NoArgs) -> str:
        return ", ".join(written) or "no notes"

    return ToolRegistry([
        FunctionTool("write_note", "Write a note.", Note, write_note, risk=Risk.WRITE, subject=lambda a: a.text,
                     verb="write the note"),
        FunctionTool("read_notes", "Read the notes.", NoArgs, read_notes, risk=Risk.READ),
    ])


def note_call(text: str, call_id: str = "c1") -> ToolCall:
    return ToolCall(id=call_id, name="write_note", arguments=json.dumps({"text": text}))


def action(tool: str, risk: Risk, subject: str = "") -> ToolAction:
    return ToolAction(tool=tool, risk=risk, subject=subject, summary=f"{tool} {subject}")


def test_default_policy_asks_before_write_execute_and_network() -> None:
    policy = ToolPolicy()
    assert [policy.decide(action("t", risk)) for risk in Risk] == ["allow", "ask", "ask", "ask"]


def test_rules_come_first_then_tools_then_risk_classes() -> None:
    policy = ToolPolicy(
        execute="deny",
        tools={"shell": "ask", "files__*": "allow"},
        rules=[Rule(tool="shell", subject="pytest*", decision="allow"),
               Rule(tool="shell", subject="*rm -rf*", decision="deny")],
    )
    assert policy.decide(action("shell", Risk.EXECUTE, "pytest -q tests/")) == "allow"
    assert policy.decide(action("shell", Risk.EXECUTE, "cd x && rm -rf /")) == "deny"
    assert policy.decide(action("shell", Risk.EXECUTE, "make")) == "ask"
    assert policy.decide(action("files__delete", Risk.WRITE)) == "allow"
    assert policy.decide(action("other", Risk.EXECUTE)) == "deny"


def test_policy_comes_from_ember_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "home" / "ember.toml").write_text(
        '[tool_policy]\nnetwork = "deny"\ntimeout_s = 30\n'
        '[[tool_policy.rules]]\ntool = "shell"\nsubject = "pytest*"\ndecision = "allow"\n'
    )
    monkeypatch.setenv("EMBER_TOOL_POLICY__WRITE", "allow")
    policy = Settings().tool_policy
    assert (policy.network, policy.write, policy.timeout_s) == ("deny", "allow", 30)
    assert policy.decide(action("shell", Risk.EXECUTE, "pytest -x")) == "allow"


async def test_the_gate_runs_allowed_calls_and_refuses_denied_ones() -> None:
    written: list[str] = []
    approver = FixedApprover(Decision.DENY)
    gate = ApprovalGate(notebook(written), ToolPolicy())
    run = tool_run(approver)
    result = await gate.call(note_call("buy milk"), run)
    assert result.startswith("Error: not permitted to write the note buy milk")
    assert written == []
    assert [a.tool for a in approver.asked] == ["write_note"]
    # Reads are allowed by default: nobody is asked.
    assert await gate.call(ToolCall(id="c2", name="read_notes", arguments="{}"), run) == "no notes"
    assert len(approver.asked) == 1
    verdicts = [(a["tool"], a["decision"], a["decided_by"]) for a in run.observer.approvals]
    assert verdicts == [("write_note", "deny", "user:tester"), ("read_notes", "approve_once", "policy")]


async def test_approve_always_covers_the_rest_of_the_session_only() -> None:
    written: list[str] = []
    approver = FixedApprover(Decision.APPROVE_SESSION)
    gate = ApprovalGate(notebook(written), ToolPolicy())
    run = tool_run(approver)
    await gate.call(note_call("one"), run)
    approver.decision = Decision.DENY  # would refuse, if it were asked again
    await gate.call(note_call("two"), run)
    assert written == ["one", "two"]
    assert len(approver.asked) == 1
    assert run.observer.approvals[-1]["decided_by"] == "session-grant"
    other_session = run.__class__("test:other", "turn-2", approver, run.observer, "local")
    assert (await gate.call(note_call("three"), other_session)).startswith("Error: not permitted")
    assert written == ["one", "two"]


async def test_invalid_calls_are_the_models_to_fix_and_nobody_is_asked() -> None:
    approver = FixedApprover(Decision.APPROVE_ONCE)
    gate = ApprovalGate(notebook([]), ToolPolicy())
    result = await gate.call(ToolCall(id="c", name="write_note", arguments='{"txt": 1}'), tool_run(approver))
    assert result.startswith("Error: invalid arguments for write_note")
    assert approver.asked == []


async def test_policy_deny_never_asks() -> None:
    approver = FixedApprover(Decision.APPROVE_ONCE)
    gate = ApprovalGate(notebook([]), ToolPolicy(tools={"write_note": "deny"}))
    result = await gate.call(note_call("x"), tool_run(approver))
    assert "the tool policy denies it" in result and approver.asked == []


IDENTITY_U = "u"  # whose turn the broker's requests are for


def event(*, can_approve: bool = True) -> InboundEvent:
    return InboundEvent(channel="test", chat_id="c1", sender_id="u", text="hi", message_id="m1",
                        can_approve=can_approve)


async def test_a_request_goes_out_through_the_channel_and_its_answer_comes_back() -> None:
    bus = InProcessBus()
    broker = ApprovalBroker(bus, timeout_s=10)
    asking = asyncio.create_task(broker.ask(event(), "turn-1", IDENTITY_U, action("write_note", Risk.WRITE, "x")))
    request = await asyncio.wait_for(bus.next_outbound("test"), 5)
    assert request.kind is OutboundKind.APPROVAL_REQUEST and request.reply_to == "m1"
    assert request.approval is not None and "write_note" in request.text
    # Only the session's own scope can answer; an unknown id does not exist.
    other = await broker.resolve(request.approval.id, Decision.APPROVE_ONCE, by="x", scope="test:c2")
    assert other is Resolution.NOT_FOUND
    assert await broker.resolve("nope", Decision.APPROVE_ONCE, by="u", scope="test:c1") is Resolution.NOT_FOUND
    mine = await broker.resolve(request.approval.id, Decision.APPROVE_ONCE, by="u", scope="test:c1")
    assert mine is Resolution.RESOLVED
    verdict = await asking
    assert verdict.allowed and verdict.decided_by == "user:u"
    assert await broker.pending("test:c1") == []


async def test_silence_past_the_timeout_is_a_denial() -> None:
    bus = InProcessBus()
    broker = ApprovalBroker(bus, timeout_s=0.2)
    verdict = await broker.ask(event(), "turn-1", IDENTITY_U, action("write_note", Risk.WRITE))
    assert not verdict.allowed and verdict.decided_by == "timeout"
    request = (await bus.next_outbound("test")).approval
    assert request is not None
    assert await broker.resolve(request.id, Decision.APPROVE_ONCE, by="u", scope="test:c1") is Resolution.NOT_FOUND


async def test_a_channel_that_cannot_ask_gets_a_denial_at_once() -> None:
    broker = ApprovalBroker(InProcessBus(), timeout_s=60)
    verdict = await broker.ask(event(can_approve=False), "turn-1", IDENTITY_U, action("write_note", Risk.WRITE))
    assert not verdict.allowed and verdict.decided_by == "channel"
    assert "cannot ask" in verdict.reason


class AnswerWhile:
    """An approval store that lets the person's answer in at one moment of a resumed turn's
    taking up of its request: while the turn reads its old rows, or while the answer is closed
    into the row (the turn reading meanwhile)."""

    def __init__(self, store: SqlApprovalStore, moment: str) -> None:
        self._store = store
        self.moment = moment
        self.answer: Callable[[], Awaitable[Resolution]] | None = None
        self._held = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def asked_before(self, *args: Any, **kwargs: Any) -> Any:
        rows = await self._store.asked_before(*args, **kwargs)
        if self.moment == "while the turn reads" and self.answer is not None:
            await self.answer()  # the turn goes on with the rows it read: pending
        return rows

    async def closed(self, *args: Any, **kwargs: Any) -> bool:
        if self.moment == "while the row is closed" and not self._held:
            self._held = True
            await asyncio.sleep(0.2)  # the turn takes the request up meanwhile
        return await self._store.closed(*args, **kwargs)


@pytest.mark.parametrize("moment", ["while the turn reads", "while the row is closed"])
async def test_an_answer_given_as_the_resumed_turn_takes_its_request_up_is_not_lost(
        db: SqliteDatabase, moment: str) -> None:
    """The card shown before a restart is tapped as the resumed turn asks again: whichever
    finishes first, the turn gets the answer, not the timeout."""
    store = AnswerWhile(SqlApprovalStore(db), moment)
    write = action("write_note", Risk.WRITE, "x")
    before_bus = InProcessBus()
    asking = asyncio.create_task(ApprovalBroker(before_bus, 30, store=store).ask(event(), "turn-1", IDENTITY_U, write))
    asked = (await asyncio.wait_for(before_bus.next_outbound("test"), 5)).approval
    assert asked is not None
    asking.cancel()  # the process stopped while the turn waited
    await asyncio.gather(asking, return_exceptions=True)

    after_bus = InProcessBus()
    broker = ApprovalBroker(after_bus, 30, store=store)
    store.answer = lambda: broker.resolve(asked.id, Decision.APPROVE_ONCE, by="u", scope="test:c1")
    if moment == "while the row is closed":
        tapped = asyncio.create_task(store.answer())
        await asyncio.sleep(0.05)  # the tap found no turn listening and is closing the row
    resumed = await asyncio.wait_for(broker.ask(event(), "turn-1", IDENTITY_U, write, set()), 5)
    assert resumed.decision is Decision.APPROVE_ONCE and resumed.decided_by == "user:u"
    if moment == "while the turn reads":  # a question already answered is not asked again
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(after_bus.next_outbound("test"), 0.2)
    if moment == "while the row is closed":
        assert await tapped is Resolution.RESOLVED


async def test_a_denied_call_is_told_to_the_model_and_traced(start, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    written: list[str] = []
    model = ScriptedModel([
        ModelReply(tool_calls=(note_call("secret plan"),)),
        ModelReply(text="I was not allowed to write the note."),
    ])
    config = settings.model_copy(update={"tool_policy": ToolPolicy(timeout_s=0.2)})
    async with start(model, tools=notebook(written), config=config) as h:
        await h.publish("note this", stream=True, can_approve=True)
        final = await h.next_closing()
        asked = h.chats["c1"].of(OutboundKind.APPROVAL_REQUEST)
        while not (traces := await h.runtime.traces.for_session(session_key())):
            await asyncio.sleep(0.01)  # the trace is written just after the final goes out
    assert final.text == "I was not allowed to write the note."
    assert written == [] and len(asked) == 1  # asked once; nobody answered
    stored = [m for m in model.requests[-1] if m.role.value == "tool"]
    assert "not permitted" in stored[0].content and "nobody answered" in stored[0].content
    approval = traces[0].detail["approvals"][0]
    assert (approval["tool"], approval["decision"], approval["decided_by"]) == ("write_note", "deny", "timeout")


def explainer_model(reply: str | Exception, *, delay_s: float = 0.0) -> FunctionModel:
    def explain(messages: list[Message], tools: object) -> ModelReply:
        if isinstance(reply, Exception):
            raise reply
        return ModelReply(text=reply)

    return FunctionModel(explain, name="approval-model", delta_delay_s=delay_s)


EXPLAINED = json.dumps({"explanation": "It writes the note 'rm -rf ~' to your notebook; nothing runs.",
                        "risk": "low", "reason": "a note, not a command"})


async def test_an_approval_request_carries_the_approval_models_explanation_of_the_full_call() -> None:
    bus = InProcessBus()
    model = explainer_model(f"Here you go:\n```json\n{EXPLAINED}\n```")
    broker = ApprovalBroker(bus, timeout_s=10, explainer=ApprovalExplainer(model, timeout_s=5))
    full = action("write_note", Risk.WRITE, "rm -rf ~")
    full = replace(full, arguments='{"text": "rm -rf ~"}')
    asking = asyncio.create_task(broker.ask(event(), "turn-1", IDENTITY_U, full))
    request = await asyncio.wait_for(bus.next_outbound("test"), 5)
    assert request.approval is not None and request.approval.explanation is not None
    assert request.approval.explanation.risk == "low"
    assert "nothing runs" in request.text and "Risk: low (a note, not a command)" in request.text
    assert json.loads(model.requests[0][-1].content)["arguments"] == '{"text": "rm -rf ~"}'  # the whole call
    await broker.resolve(request.approval.id, Decision.DENY, by="u", scope="test:c1")
    verdict = await asking
    assert not verdict.allowed and verdict.explanation == request.approval.explanation  # the person decided


@pytest.mark.parametrize("model", [
    explainer_model(ConnectionError("the approval model is down")),
    explainer_model("I think it is fine."),  # no structure
    explainer_model(json.dumps({"explanation": "x", "risk": "catastrophic", "reason": "?"})),
    explainer_model(EXPLAINED, delay_s=0.5),  # slower than its timeout
], ids=["down", "prose", "bad-rating", "slow"])
async def test_without_a_usable_explanation_the_request_still_goes_out_unexplained(model: FunctionModel) -> None:
    bus = InProcessBus()
    broker = ApprovalBroker(bus, timeout_s=10, explainer=ApprovalExplainer(model, timeout_s=0.3))
    asking = asyncio.create_task(broker.ask(event(), "turn-1", IDENTITY_U, action("write_note", Risk.WRITE, "x")))
    request = await asyncio.wait_for(bus.next_outbound("test"), 5)
    assert request.approval is not None and request.approval.explanation is None
    assert request.text == "Allow Ember to write_note x? (write)"
    await broker.resolve(request.approval.id, Decision.APPROVE_ONCE, by="u", scope="test:c1")
    assert (await asking).allowed


async def test_an_explanation_never_shows_a_secret_from_the_arguments() -> None:
    bus = InProcessBus()
    leaky = json.dumps({"explanation": "It sends the key sk-live-0123456789abcdefghij to the server.",
                        "risk": "high", "reason": "token=sk-live-0123456789abcdefghij leaves the machine"})
    broker = ApprovalBroker(bus, timeout_s=0.2, explainer=ApprovalExplainer(explainer_model(leaky), 5))
    verdict = await broker.ask(event(), "turn-1", IDENTITY_U, action("web_fetch", Risk.NETWORK, "https://x.org"))
    request = await bus.next_outbound("test")
    assert verdict.explanation is not None and verdict.explanation.risk == "high"
    assert "sk-live-0123456789" not in request.text and "sk-live-0123456789" not in verdict.explanation.line()


async def test_an_explained_request_is_recorded_in_the_trace(start, settings: Settings) -> None:  # type: ignore[no-untyped-def]
    written: list[str] = []
    model = ScriptedModel([ModelReply(tool_calls=(note_call("buy milk"),)), ModelReply(text="Noted.")])
    config = settings.model_copy(update={"tool_policy": ToolPolicy(timeout_s=5)})
    runtime = await build_runtime(config, model, tools=notebook(written), approval_model=explainer_model(EXPLAINED))
    async with running_harness(runtime) as h:
        await h.publish("note this", stream=True, can_approve=True)
        while not (requests := h.chats["c1"].of(OutboundKind.APPROVAL_REQUEST)):
            await asyncio.sleep(0.01)
        asked = requests[0]
        assert asked.approval is not None and asked.approval.explanation is not None
        await h.runtime.approvals.resolve(asked.approval.id, Decision.APPROVE_ONCE, by="tester", scope="test:c1")
        final = await h.next_closing()
        while not (traces := await h.runtime.traces.for_session(session_key())):
            await asyncio.sleep(0.01)
    assert final.text == "Noted." and written == ["buy milk"]
    recorded = traces[0].detail["approvals"][0]
    assert recorded["decision"] == "approve_once" and "nothing runs" in recorded["explanation"]
