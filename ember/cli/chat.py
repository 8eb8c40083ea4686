"""`ember chat` (and its alias `ember run`): the model it talks to, and the conversation itself."""

from __future__ import annotations

import asyncio

import typer
from rich.markup import escape

from ember.app.models import configured_model
from ember.app.runtime import configured_runtime, running
from ember.channels.cli import CHANNEL, CliChannel
from ember.cli.common import err, out
from ember.config.settings import CONFIGURE_MODEL_HINT, Settings
from ember.core.errors import EmberError
from ember.models.base import ModelClient
from ember.models.demo import LABEL, demo_model


def chosen_model(settings: Settings, *, demo: bool, fallback: bool) -> tuple[ModelClient, bool]:
    """(the model, whether it is the demo model): the demo model when asked for, the configured one,
    else (with `fallback`, and nothing of a model configured at all) the demo model, said loudly.
    A half-made model configuration is an error, never a silent fallback."""
    if demo:
        return demo_model(), True
    if not settings.model_configured and fallback and not settings.missing_model_setting():
        out.print(f"[yellow]No model configured: running on the scripted demo model {escape(LABEL)}. "
                  "Its answers are canned, not AI.[/yellow]")
        out.print(f"To use a real model: [bold]{CONFIGURE_MODEL_HINT}[/bold]", markup=True)
        return demo_model(), True
    try:
        model = configured_model(settings)
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    if fallback:
        out.print(f"Ember on model [bold]{escape(model.name)}[/bold]; data in {settings.home_dir}")
    return model, False


async def chat_on(settings: Settings, model: ModelClient, session: str, message: str | None, *,
                  demo: bool = False, agent: str | None = None) -> int:
    """One answer to `message`, printed; or, without one, the interactive chat."""
    # The demo model does the background work too; a configured chain may name its own for it.
    runtime = await configured_runtime(settings, model, own_roles=not demo)
    channel = CliChannel(runtime.bus, runtime.approvals, out, err, chat_id=session, agent=agent)
    runtime.channels.register(channel)
    async with running(runtime):
        if message is not None:
            answer = await channel.send(message, stream=False)
            if not answer.ok:
                err.print(answer.text, markup=False)
                return 1
            print(answer.text, flush=True)  # before shutdown, which may wait for a background job
            return 0
        return await _interactive(channel, session)


async def _interactive(channel: CliChannel, session: str) -> int:
    out.print(f"[dim]session {CHANNEL}:{session} — type /quit or Ctrl-D to leave[/dim]")
    while True:
        try:
            line = await asyncio.to_thread(input, "you> ")
        except (EOFError, KeyboardInterrupt):
            out.print()
            return 0
        if line.strip() in {"/quit", "/exit"}:
            return 0
        if not line.strip():
            continue
        out.print("[bold]ember>[/bold] ", end="")
        answer = await channel.send(line, stream=True)
        if not answer.ok:
            err.print(answer.text, markup=False)
