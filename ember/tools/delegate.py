"""The `delegate` tool: a task handed to another agent, or to a fresh one like the caller, which
works on it in a session of its own and answers with its result (runtime/delegation.py runs it).

The agent doing it sees only the task, never the conversation: what it needs must be in the task.
It is offered no tool its caller is not, and fewer when `tools` narrows them; its approvals are put
to the person who asked; `[delegation]` bounds its depth, its tokens, its time and how many run at once.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from ember.core.delegation import ChildTask, ChildTurns
from ember.core.journal import ToolProgress
from ember.core.tools import Risk, ToolRun
from ember.tools.base import Tool, ToolFailure, TurnTool

NAME = "delegate"
MAX_TASK_CHARS = 20_000


class DelegationSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Offer the `delegate` tool.
    enabled: bool = True
    # How deep delegations nest: 1 lets a person's turn delegate, and its delegated turns may not.
    max_depth: int = Field(default=2, ge=1, le=5)
    # Delegated tasks of one turn running at once; more wait for a place.
    max_concurrent: int = Field(default=4, ge=1, le=32)
    # Tokens (in and out, its own delegations' included) after which a delegated task takes no further step.
    token_budget: int = Field(default=200_000, ge=1_000)
    # Seconds after which a delegated task is stopped, and its parent told so.
    timeout_s: float = Field(default=600.0, gt=0)


class DelegateArgs(BaseModel):
    task: str = Field(min_length=1, max_length=MAX_TASK_CHARS, description=(
        "The whole task: it sees nothing of this chat, so give every fact and file name it needs, and what to "
        "answer with."))
    agent: str | None = Field(default=None, description="A named agent to do it; unset: one like you.")
    tools: list[str] | None = Field(default=None, description="The tools it may use, among yours; unset: all.")


def describe_agents(agents: Mapping[str, str]) -> str:
    if not agents:
        return ""
    return " Named agents: " + "; ".join(f"{name}: {about}" if about else name for name, about in agents.items()) + "."


def delegate_tool(children: ChildTurns, agents: Mapping[str, str]) -> Tool:
    """`agents`: each named agent, with what it is for (told to the model)."""

    async def delegate(args: DelegateArgs, run: ToolRun) -> str:
        if args.agent is not None and args.agent not in agents:
            known = ", ".join(agents) or "none are configured"
            raise ToolFailure(f"there is no agent named {args.agent!r} (named agents: {known}); leave agent unset "
                              "for an agent like you")
        run.observer.event(ToolProgress(NAME, f"{args.agent or 'an agent'} is working on the task"))
        tools = tuple(args.tools) if args.tools is not None else None
        answer = await children.run(ChildTask(args.task, args.agent, tools), run)
        if answer.failed:
            raise ToolFailure(answer.text)
        return answer.text

    return TurnTool(
        NAME, "Hand a self-contained task to another agent, which works on it apart and answers with its result: "
        "for work that would crowd this chat, or several tasks at once (several calls in one step)."
        + describe_agents(agents),
        DelegateArgs, delegate, risk=Risk.READ, subject=lambda a: a.task[:120], verb="delegate the task")
