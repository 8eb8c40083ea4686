"""`[agents.NAME]`: what a named agent is configured with (pipeline/agents.py runs it). Apart from
the agents' code, so that reading the settings imports no tool."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

AGENT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
MemoryScope = Literal["shared", "own"]


class AgentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # What it is for, in a few words: the delegate tool tells other agents, so they know when to ask it.
    description: str = ""
    # Its system prompt, in place of the default one ({agent_name} is filled in).
    system_prompt: str | None = None
    # The [models] it calls, tried in order; empty: the main chain.
    models: list[str] = Field(default_factory=list)
    # The tools it is offered, by name or pattern (`memory_*`, `github__*`); unset: every tool.
    tools: list[str] | None = None
    # The skills in its prompt's index, by name or pattern; unset: every skill.
    skills: list[str] | None = None
    # "shared": the person's own memory; "own": a memory of its own with each person.
    memory: MemoryScope = "shared"
    # USD a day (UTC) its turns may spend on priced models, whoever they are for; past it, they are refused.
    budget_usd_per_day: float | None = Field(default=None, ge=0)


def check_agents(agents: Mapping[str, AgentSpec], models: Sequence[str], bindings: Mapping[str, str]) -> None:
    """ValueError for an agent whose name is not a plain lower-case name, whose chain names a model
    not under [models], or a channel bound to an agent that is not configured."""
    for name, spec in agents.items():
        if not AGENT_NAME.fullmatch(name):
            raise ValueError(f"agents.{name}: an agent's name is lower-case letters, digits, '-' and '_'")
        if unknown := [model for model in spec.models if model not in models]:
            raise ValueError(f"agents.{name}.models names {', '.join(map(repr, unknown))}, not under [models]")
    for where, agent in bindings.items():
        if agent not in agents:
            raise ValueError(f"channel_agents.{where} names agent {agent!r}, not under [agents]")


def matches(name: str, patterns: Sequence[str] | None) -> bool:
    """Whether `patterns` (None: all) take `name`."""
    return patterns is None or any(fnmatchcase(name, pattern) for pattern in patterns)
