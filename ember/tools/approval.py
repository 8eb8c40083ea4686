"""Permission to act: a policy per tool and risk class, and the gate that applies it.

    decide(action):  the first rule whose tool and subject patterns match,
                     else the tool's own setting, else its risk class's.
                     A shell command is judged by its parts (decide_command).
    allow -> run;  deny -> an "Error:" result;  ask -> the turn's approver asks
    the person behind the channel, and silence past the timeout denies.

"Approve always for this session" lets that tool run unasked for the rest of
the session. Every verdict goes to the turn's observer (its trace): who, what, when.
"""

from __future__ import annotations

import fnmatch
import time
from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from ember.core.journal import ApprovalEvent
from ember.core.messages import ToolCall
from ember.core.tools import Decision, Risk, ToolAction, ToolRun, ToolSpec, Verdict
from ember.tools.base import ToolFailure, Toolset

if TYPE_CHECKING:
    from ember.tools.shell_parse import SimpleCommand

Choice = Literal["allow", "ask", "deny"]
# The tool whose subject is a command line (tools/shell.py).
SHELL_TOOL = "shell"


class Rule(BaseModel):
    """Matches a call by tool name and subject (shell-style patterns, e.g. `pytest*`)."""

    model_config = ConfigDict(extra="forbid")
    # A tool name pattern (MCP tools are server__tool).
    tool: str = "*"
    # A pattern for what the call acts on: a path, a command, a URL. A shell command line
    # is matched part by part: each simple command in it must be allowed (docs/tools.md, "Shell rules match what runs").
    subject: str = "*"
    # What a matching call gets.
    decision: Choice


class ToolPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Reading files, searching memory, scheduling.
    read: Choice = "allow"
    # Writing or deleting files, forgetting, cancelling tasks.
    write: Choice = "ask"
    # Running commands (shell, MCP servers by default).
    execute: Choice = "ask"
    # Reaching the network (web_fetch, call_agent).
    network: Choice = "ask"
    # Per tool name; MCP tools are named `server__tool`, and `server__*` covers a server.
    tools: dict[str, Choice] = Field(default_factory=dict)
    # Checked in order before everything else; the first match decides.
    rules: list[Rule] = Field(default_factory=list)
    # How long an approval request waits for an answer before it counts as a denial.
    timeout_s: float = Field(default=120.0, gt=0)

    def decide(self, action: ToolAction) -> Choice:
        if action.tool == SHELL_TOOL:
            return self.decide_command(action)
        return self._rule(action.tool, action.subject) or self._setting(action)

    def decide_command(self, action: ToolAction) -> Choice:
        """A shell command line, judged by what it runs.

        A rule denying the whole line denies it. Otherwise each simple command in it
        gets the first rule matching its text, else the tool's setting: any deny
        denies, any ask asks, and the line is allowed only when every part is. A rule
        cannot allow a part with a guard its pattern does not spell out, nor any part
        of a line with unsafe features (those ask). A line bashlex cannot read asks
        if a rule matches it whole, else gets the setting.
        """
        whole = self._rule(action.tool, action.subject)
        if whole == "deny":
            return "deny"
        from ember.tools.shell_parse import read_command  # bashlex: where a policy judges a command, not in config

        setting = self._setting(action)
        line = read_command(action.subject)
        if line is None:
            return setting if whole is None else "ask"
        choices = {self._part(action.tool, command, setting, bool(line.unsafe)) for command in line.commands}
        return "deny" if "deny" in choices else "ask" if "ask" in choices else "allow"

    def _part(self, tool: str, command: SimpleCommand, setting: Choice, unsafe: bool) -> Choice:
        choice = self._rule(tool, command.text, command.guard)
        if choice is None:
            return setting
        return "ask" if choice == "allow" and unsafe else choice

    def _rule(self, tool: str, subject: str, guard: str = "") -> Choice | None:
        """The first matching rule's decision; an allow rule matches a guarded subject only by naming its guard."""
        for rule in self.rules:
            if not (fnmatch.fnmatchcase(tool, rule.tool) and fnmatch.fnmatchcase(subject, rule.subject)):
                continue
            if rule.decision == "allow" and guard and not _literal_start(rule.subject).startswith(guard):
                continue
            return rule.decision
        return None

    def _setting(self, action: ToolAction) -> Choice:
        for pattern, choice in self.tools.items():
            if fnmatch.fnmatchcase(action.tool, pattern):
                return choice
        by_risk: dict[Risk, Choice] = {Risk.READ: self.read, Risk.WRITE: self.write, Risk.EXECUTE: self.execute,
                                       Risk.NETWORK: self.network}
        return by_risk[action.risk]


def _literal_start(pattern: str) -> str:
    """A pattern's text before its first wildcard: what it requires literally."""
    cut = min((i for i, c in enumerate(pattern) if c in "*?["), default=len(pattern))
    return pattern[:cut]


def denial_text(action: ToolAction, verdict: Verdict) -> str:
    why = verdict.reason or "the user said no"
    return (f"Error: not permitted to {action.summary} ({why}). Do not retry it; "
            "tell the user what you wanted to do and why.")


class SessionGrants(Protocol):
    """The tools a person allowed for the rest of a session ("allow for this session")."""

    async def grant(self, session_key: str, tool: str) -> None: ...

    async def granted(self, session_key: str, tool: str) -> bool: ...


class InMemoryGrants:
    """Grants that last as long as the process (the store's, SqlApprovalStore, last with the session)."""

    def __init__(self) -> None:
        self._tools: defaultdict[str, set[str]] = defaultdict(set)

    async def grant(self, session_key: str, tool: str) -> None:
        self._tools[session_key].add(tool)

    async def granted(self, session_key: str, tool: str) -> bool:
        return tool in self._tools.get(session_key, ())


class ApprovalGate:
    """A Toolset around another that asks before the calls its policy says to ask about."""

    def __init__(self, inner: Toolset, policy: ToolPolicy, grants: SessionGrants | None = None) -> None:
        self._inner = inner
        self._policy = policy
        self._grants = grants if grants is not None else InMemoryGrants()

    def specs(self) -> list[ToolSpec]:
        return self._inner.specs()

    def describe(self, call: ToolCall) -> ToolAction:
        return self._inner.describe(call)

    async def call(self, call: ToolCall, run: ToolRun) -> str:
        try:
            action = replace(self._inner.describe(call), arguments=call.arguments)
        except ToolFailure as exc:  # invalid calls are the model's to fix; nobody is asked about them
            return f"Error: {exc}"
        verdict = await self._verdict(action, run)
        run.observer.event(ApprovalEvent(
            call.id, action.tool, action.subject, verdict.decision.value, verdict.decided_by, verdict.decided_at,
            verdict.reason, explanation=verdict.explanation.line() if verdict.explanation else None))
        if not verdict.allowed:
            return denial_text(action, verdict)
        if verdict.decision is Decision.APPROVE_SESSION:
            await self._grants.grant(run.conversation, action.tool)
        return await self._inner.call(call, run)

    async def _verdict(self, action: ToolAction, run: ToolRun) -> Verdict:
        choice = self._policy.decide(action)
        if choice == "allow":
            return Verdict(Decision.APPROVE_ONCE, "policy", time.time())
        if choice == "deny":
            return Verdict(Decision.DENY, "policy", time.time(), "the tool policy denies it")
        if await self._grants.granted(run.conversation, action.tool):
            return Verdict(Decision.APPROVE_ONCE, "session-grant", time.time())
        return await run.approver.approve(action)
