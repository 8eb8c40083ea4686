"""`ember demo`: the whole runtime on the scripted demo model, in a throwaway home."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ember.app.runtime import build_runtime, running
from ember.channels.cli import CliChannel
from ember.config.settings import CONFIGURE_MODEL_HINT, isolated_settings
from ember.core.memory import LOCAL_IDENTITY
from ember.models.demo import LABEL, demo_model

DEMO_TURNS = (
    "Hello! Who are you?",
    "Which files are in my workspace?",
    "Thanks, that is all for now.",
)


async def run_demo(console: Console) -> int:
    console.rule("Ember demo")
    console.print(f"This walkthrough runs on the {escape(LABEL)}: canned answers, no AI involved.")
    console.print("It shows streaming, a tool call, reasoning kept out of the answer, the commit, and consolidation.")
    console.rule()
    with tempfile.TemporaryDirectory(prefix="ember-demo-") as home:
        workspace = Path(home) / "workspace"
        workspace.mkdir()
        (workspace / "notes.md").write_text("# Notes\nBuy milk.\n")
        (workspace / "plan.txt").write_text("Ship Ember.\n")
        settings = isolated_settings(home=Path(home), consolidation_threshold=6, consolidation_keep_recent=2)
        runtime = await build_runtime(settings, demo_model())
        channel = CliChannel(runtime.bus, runtime.approvals, console, console, chat_id="demo")
        runtime.channels.register(channel)
        async with running(runtime):
            for line in DEMO_TURNS:
                console.print(f"[bold cyan]you>[/bold cyan] {line}")
                console.print("[bold]ember>[/bold] ", end="")
                await channel.send(line, stream=True)
            await runtime.runner.wait_idle()
            history = await runtime.sessions.history("cli:demo")
            session = await runtime.sessions.load("cli:demo")
            episodes = await runtime.memory.episodes(LOCAL_IDENTITY, session.key, 5)
        console.print(f"\n[bold]Committed:[/bold] {len(history)} messages; "
                      f"reasoning stored: {any('<think>' in m.content for m in history)}.")
        console.print(f"[bold]Consolidated:[/bold] messages before #{session.last_consolidated} "
                      "are now an episodic memory:")
        console.print("\n".join(f"- {e.content}" for e in episodes) or "(nothing yet)", markup=False)
    console.print(f"\nTo use a real model: {CONFIGURE_MODEL_HINT}", markup=False)
    return 0
