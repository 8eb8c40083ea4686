"""`ember agents list`: the named agents of this Ember ([agents.NAME]) and what each runs with."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from ember.cli.common import out, print_json, settings_or_exit

agents_app = typer.Typer(help="The named agents ([agents.NAME]): each its own prompt, models, tools, skills "
                              "and memory.", no_args_is_help=True)


@agents_app.command("list")
def list_agents(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Each agent: the model chain it calls ([] in JSON: the main chain), the tools and skills it is
    given (null: all), and its memory scope. The default agent answers a turn that names none."""
    settings = settings_or_exit()
    rows = [{"name": name, "description": spec.description, "models": spec.models, "tools": spec.tools,
             "skills": spec.skills, "memory": spec.memory, "system_prompt": spec.system_prompt is not None}
            for name, spec in sorted(settings.agents.items())]
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print("No named agents: every turn runs as the default agent. Add one under [agents.NAME] in "
                  "ember.toml (docs/models-and-settings.md).", markup=False)
        return
    for row in rows:
        chain = ", ".join(row["models"]) or "the main chain"
        about = f" — {escape(row['description'])}" if row["description"] else ""
        out.print(f"[bold]{escape(row['name'])}[/bold]{about}  models: {escape(chain)}  "
                  f"memory: {row['memory']}", highlight=False)
        tools = "every tool" if row["tools"] is None else ", ".join(row["tools"]) or "no tools"
        skills = "every skill" if row["skills"] is None else ", ".join(row["skills"]) or "no skills"
        prompt = "its own system prompt" if row["system_prompt"] else "the default system prompt"
        out.print(f"  {escape(tools)} · {escape(skills)} · {prompt}", highlight=False)
