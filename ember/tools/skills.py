"""skill_view: the model reads a skill's instructions, or one of its files, when
the prompt's index says it applies (progressive disclosure: the prompt carries
names and descriptions only)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ember.core.errors import SkillError
from ember.core.tools import Risk, ToolRun
from ember.skills.library import SkillLibrary
from ember.tools.base import Tool, ToolFailure, TurnTool
from ember.tools.workspace import Workspaces


class SkillViewArgs(BaseModel):
    name: str = Field(description="The skill's name, as the index lists it.", max_length=200)
    file: str | None = Field(default=None, max_length=300,
                             description="One of the skill's files (e.g. 'references/guide.md'); "
                                         "omit it for the skill's instructions.")


def skill_tools(library: SkillLibrary, workspaces: Workspaces) -> list[Tool]:
    """skill_view puts a skill's script into the workspace of the turn that asked for it."""

    async def view(args: SkillViewArgs, run: ToolRun) -> str:
        workspace = await workspaces.for_run(run) if args.file is not None else None
        try:
            return await library.view(run.identity, args.name, args.file, workspace=workspace)
        except SkillError as exc:
            raise ToolFailure(str(exc)) from exc

    return [TurnTool("skill_view", "Read a skill's instructions (or one of its files) before following it.",
                     SkillViewArgs, view, risk=Risk.READ,
                     subject=lambda a: a.name if a.file is None else f"{a.name}/{a.file}", verb="read the skill")]
