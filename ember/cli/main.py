"""The `ember` command.

Importing this module (and the *_cli modules it mounts) loads typer and the
command groups, never the runtime, the SDKs or the store: each command imports
what it runs, so `ember --help` and the list commands answer at once.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from ember.cli.agents import agents_app
from ember.cli.channels import channels
from ember.cli.common import err, out, run_command, settings_or_exit, setup_logging
from ember.cli.cron import cron_app
from ember.cli.mcp import mcp_app
from ember.cli.memory import memory_app
from ember.cli.models import models
from ember.cli.sessions import sessions_app, trace_app
from ember.cli.skills import skills_app
from ember.cli.store import store_app
from ember.cli.usage import usage

if TYPE_CHECKING:
    from ember.config.settings import Settings
    from ember.models.base import ModelClient

# Plain help (no rich markup): a "[default: …]" in a help text is shown, not eaten as a style
# tag, and flags show no "<bool>" type.
app = typer.Typer(help="Ember: a self-hosted AI agent runtime.", no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(sessions_app, name="sessions")
app.add_typer(agents_app, name="agents")
app.add_typer(trace_app, name="trace")
app.add_typer(memory_app, name="memory")
app.add_typer(skills_app, name="skills")
app.add_typer(cron_app, name="cron")
app.add_typer(mcp_app, name="mcp")
app.add_typer(store_app, name="store")
app.command()(models)
app.command()(usage)
app.command()(channels)

SessionOption = Annotated[str, typer.Option("--session", "-s", help="Session name (the CLI's chat id).")]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="Show logs on stderr.")]


def _print_version(value: bool) -> None:
    if value:
        from ember import __version__

        print(f"ember {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", "-V", callback=_print_version, is_eager=True, help="Print Ember's version and exit.")] = False,
          ) -> None:
    """Ember: a self-hosted AI agent runtime."""


def chat(
    message: Annotated[
        str | None, typer.Option("--message", "-m", help="Send one message, print the answer, exit.")
    ] = None,
    session: SessionOption = "default",
    demo: Annotated[bool, typer.Option("--demo", help="Use the offline scripted demo model.")] = False,
    agent: Annotated[str | None, typer.Option("--agent", help="A named agent ([agents.NAME]) to answer.")] = None,
    verbose: VerboseOption = False,
) -> None:
    """Chat with the agent: interactive and streaming, or one shot with -m. With no model
    configured, the interactive chat runs on the scripted demo model (said on its first line)."""
    from ember.cli.chat import chat_on, chosen_model

    settings = settings_or_exit()
    setup_logging(settings, verbose)
    if message is not None and not message.strip():
        err.print("[red]error:[/red] the message is empty: give -m some text to send")
        raise typer.Exit(2)
    if agent is not None and agent not in settings.agents:
        known = ", ".join(sorted(settings.agents)) or "none is configured"
        err.print(f"error: there is no agent named {agent!r} (agents: {known})", markup=False)
        raise typer.Exit(2)
    # A one-shot answer feeds a script: canned text must be asked for (--demo), never a fallback.
    model, demo = chosen_model(settings, demo=demo, fallback=message is None)
    run_command(chat_on(settings, model, session, message, demo=demo, agent=agent))


app.command("chat")(chat)
app.command("run", help="The same as `ember chat`.")(chat)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(
        help="Address to listen on (default: the gateway_host setting, 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: the gateway_port setting, 8765).")] = None,
    workers: Annotated[int, typer.Option(
        min=0, max=1, help="1: run the turns in this process too; 0: leave them to `ember worker` processes "
                           "on the same store and Redis bus.")] = 1,
    verbose: VerboseOption = False,
) -> None:
    """Run the HTTP gateway (OpenAI-compatible API, native API, web chat) with the agent."""
    from ember.cli.serve import serve_gateway

    settings = settings_or_exit()
    setup_logging(settings, verbose)
    if not workers:
        _shared_bus_or_exit(settings, "ember serve --workers 0")
    run_command(serve_gateway(settings, _model_or_demo(settings), host or settings.gateway_host,
                              settings.gateway_port if port is None else port, turns=workers > 0))


@app.command()
def worker(
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", min=0, max=65535,
        help="Serve Prometheus /metrics on this port (default: EMBER_WORKER_METRICS_PORT, else none).")] = None,
    verbose: VerboseOption = False,
) -> None:
    """Run turns, background jobs and scheduled tasks for the gateways on the same store and Redis bus."""
    from rich.markup import escape

    from ember.app.worker import work

    settings = settings_or_exit()
    if metrics_port is not None:
        settings = settings.model_copy(update={"worker_metrics_port": metrics_port})
    setup_logging(settings, verbose)
    _shared_bus_or_exit(settings, "ember worker")

    def ready(metrics_url: str | None) -> None:
        out.print(f"Ember worker {escape(settings.agent_name)} is taking turns off the Redis bus "
                  f"(namespace {escape(settings.redis_namespace)})"
                  + (f"; metrics at {escape(metrics_url)}." if metrics_url else "."))
        sys.stdout.flush()

    run_command(work(settings, _model_or_demo(settings), ready))


def _model_or_demo(settings: Settings) -> ModelClient:
    from ember.cli.chat import chosen_model

    return chosen_model(settings, demo=False, fallback=True)[0]


def _shared_bus_or_exit(settings: Settings, command: str) -> None:
    from rich.markup import escape

    from ember.app.runtime import require_shared_bus
    from ember.core.errors import EmberError

    try:
        require_shared_bus(settings, command)
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc


@app.command()
def doctor() -> None:
    """Check the configuration, the store and the model endpoint; every check that can run does,
    also when the configuration does not load."""
    from ember.cli.doctor import run_doctor

    run_command(run_doctor(out))


@app.command()
def demo() -> None:
    """An offline walkthrough on the scripted demo model (no AI involved)."""
    from ember.cli.demo import run_demo

    run_command(run_demo(out))


def main() -> None:
    from ember.runtime.hardening import make_undumpable

    # Every command: a process of the same user must not read its environment (its keys) from /proc.
    make_undumpable()
    app()
