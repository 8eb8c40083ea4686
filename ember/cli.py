"""The `ember` command."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ember.app import configured_runtime, require_shared_bus, running
from ember.channels.cli import CHANNEL, CliChannel
from ember.channels_cli import channels
from ember.cli_common import err, open_store, out, print_json, run_command, settings_or_exit, setup_logging
from ember.config import CONFIGURE_MODEL_HINT, Settings
from ember.configured_models import configured_model
from ember.core.delivery import interleaved
from ember.core.errors import EmberError
from ember.core.messages import Message
from ember.cron_cli import cron_app
from ember.mcp_cli import mcp_app
from ember.memory_cli import memory_app
from ember.models.base import ModelClient
from ember.models.demo import LABEL, demo_model
from ember.models_cli import models
from ember.runtime.hardening import make_undumpable
from ember.skills_cli import skills_app
from ember.store.deliveries import SqlDeliveryStore
from ember.store.sessions import SqlSessionStore
from ember.store.traces import SqlTraceStore
from ember.store_cli import store_app
from ember.usage_cli import usage

app = typer.Typer(help="Ember: a self-hosted AI agent runtime.", no_args_is_help=True, add_completion=False)
sessions_app = typer.Typer(help="Inspect stored sessions.", no_args_is_help=True)
app.add_typer(sessions_app, name="sessions")
trace_app = typer.Typer(help="What a turn did: stages, model calls, tool calls, approvals.", no_args_is_help=True)
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

async def _chat(settings: Settings, model: ModelClient, session: str, message: str | None, *,
                demo: bool = False) -> int:
    # The demo model does the background work too; a configured chain may name its own for it.
    runtime = await configured_runtime(settings, model, own_roles=not demo)
    channel = CliChannel(runtime.bus, runtime.approvals, out, err, chat_id=session)
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


@app.command()
def chat(
    message: Annotated[
        str | None, typer.Option("--message", "-m", help="Send one message, print the answer, exit.")
    ] = None,
    session: SessionOption = "default",
    demo: Annotated[bool, typer.Option(help="Use the offline scripted demo model.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show logs on stderr.")] = False,
) -> None:
    """Chat with the agent: interactive and streaming, or one shot with -m."""
    settings = settings_or_exit()
    setup_logging(settings, verbose)
    if message is not None and not message.strip():
        err.print("[red]error:[/red] the message is empty: give -m some text to send")
        raise typer.Exit(2)
    try:
        model: ModelClient = demo_model() if demo else configured_model(settings)
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    run_command(_chat(settings, model, session, message, demo=demo))


@app.command()
def run(
    session: SessionOption = "default",
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Start the agent on the embedded defaults (falls back to the scripted demo model)."""
    settings = settings_or_exit()
    setup_logging(settings, verbose)
    run_command(_chat(settings, _model_or_demo(settings), session, None))


def _model_or_demo(settings: Settings) -> ModelClient:
    """The configured model, else the scripted demo model, said loudly."""
    if settings.model_configured:
        model: ModelClient = configured_model(settings)
        out.print(f"Ember on model [bold]{model.name}[/bold]; data in {settings.home_dir}")
        return model
    out.print(f"[yellow]No model configured: running on the scripted demo model {escape(LABEL)}. "
              "Its answers are canned, not AI.[/yellow]")
    out.print(f"To use a real model: [bold]{CONFIGURE_MODEL_HINT}[/bold]", markup=True)
    return demo_model()


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on [default: gateway_host, 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="Port [default: gateway_port, 8765].")] = None,
    workers: Annotated[int, typer.Option(
        min=0, max=1, help="1: run the turns in this process too; 0: leave them to `ember worker` processes "
                           "on the same store and Redis bus.")] = 1,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show logs on stderr.")] = False,
) -> None:
    """Run the HTTP gateway (OpenAI-compatible API, native API, web chat) with the agent."""
    from ember.channels.gateway.server import Listening, api_keys
    from ember.channels.gateway.server import serve as serve_gateway

    settings = settings_or_exit()
    setup_logging(settings, verbose)
    host = host or settings.gateway_host
    if not workers:
        _shared_bus_or_exit(settings, "ember serve --workers 0")
    try:
        keys = api_keys(settings, host)
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc

    def ready(at: Listening) -> None:
        url = f"http://{at.host}:{at.port}"
        out.print(f"Ember gateway on [bold]{url}[/bold] — web chat at {url}/, OpenAI API at {url}/v1")
        if not workers:
            out.print("It runs no turns: `ember worker` processes on the same store and Redis bus run them.")
        if at.identities:
            out.print(f"{at.identities} API key(s) configured; every route but /healthz needs one.")
        else:
            out.print("[yellow]No API keys configured: anyone on this machine may use it; "
                      "it listens on loopback only. Set EMBER_API_KEYS to require keys.[/yellow]")
        if settings.a2a_enabled:
            out.print(f"A2A agent card at {url}/.well-known/agent-card.json")
        if settings.webhooks:
            out.print(f"Webhooks: {', '.join(f'{url}/webhooks/{name}' for name in settings.webhooks)}")
        if settings.outbound:
            out.print(f"Outbound webhook targets: {', '.join(settings.outbound)}")
        sys.stdout.flush()

    run_command(serve_gateway(settings, _model_or_demo(settings), keys, host,
                              settings.gateway_port if port is None else port, ready, turns=workers > 0))


@app.command()
def worker(
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", min=0, max=65535,
        help="Serve Prometheus /metrics on this port (default: EMBER_WORKER_METRICS_PORT, else none).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show logs on stderr.")] = False,
) -> None:
    """Run turns, background jobs and scheduled tasks for the gateways on the same store and Redis bus."""
    from ember.worker import work

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


def _shared_bus_or_exit(settings: Settings, command: str) -> None:
    try:
        require_shared_bus(settings, command)
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc


def _resolve_session_key(known: set[str], name: str) -> str:
    """The stored key a person means by `name`: the key itself, a terminal session's name, or the
    last part of any key (`work` for `http:alice:work`). ValueError says why none, or which several."""
    for candidate in (name, f"{CHANNEL}:{name}"):
        if candidate in known:
            return candidate
    matches = sorted(key for key in known if key.rsplit(":", 1)[-1] == name)
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"{name!r} names several sessions: {', '.join(matches)}; give the whole key")
    raise ValueError(f"no session named {name!r}; `ember sessions list` shows them")


async def _session_key_or_exit(store: SqlSessionStore, name: str) -> str | None:
    try:
        return _resolve_session_key({row.key for row in await store.list_sessions()}, name)
    except ValueError as exc:
        err.print(str(exc), markup=False)
        return None


TURN_ID_SHOWN = 12  # a turn id's unique prefix in lists; every command takes it


@sessions_app.command("list")
def sessions_list(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List sessions, most recently active first."""
    settings = settings_or_exit()

    async def main() -> int:
        async with open_store(settings) as db:
            rows = await SqlSessionStore(db).list_sessions()
        if as_json:
            print_json([{"key": row.key, "messages": row.message_count,
                         "last_consolidated": row.last_consolidated, "updated_at": row.updated_at} for row in rows])
            return 0
        table = Table("session", "messages", "consolidated up to", "last active")
        for row in rows:
            table.add_row(row.key, str(row.message_count), str(row.last_consolidated), _when(row.updated_at))
        out.print(table if rows else "No sessions yet.")
        return 0

    run_command(main())


@sessions_app.command("show")
def sessions_show(
    key: Annotated[str, typer.Argument(help="Session key, or a CLI session name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the messages as JSON.")] = False,
) -> None:
    """Show a session's whole stored history."""
    settings = settings_or_exit()

    async def main() -> int:
        async with open_store(settings) as db:
            store = SqlSessionStore(db)
            resolved = await _session_key_or_exit(store, key)
            if resolved is None:
                return 1
            entries = interleaved(await store.history(resolved), await SqlDeliveryStore(db).failures(resolved))
        if as_json:
            print_json([{**m.to_json_dict(), "kind": "message"} if isinstance(m, Message) else
                        {"seq": None, "role": "assistant", "content": m.text, "kind": "error", "turn_id": m.turn_id}
                        for m in entries])
            return 0
        for m in entries:
            if not isinstance(m, Message):  # the turn never answered: how it ended
                out.print(f"[bold red]{'':>5} {'error':<9}[/bold red]", end=" ")
                out.print(m.text, markup=False)
                continue
            calls = " ".join(f"[{c.name}({c.arguments})]" for c in m.tool_calls)
            out.print(f"[bold]{m.seq:>5} {m.role.value:<9}[/bold]", end=" ")
            out.print(f"{m.content} {calls}".strip(), markup=False)
        return 0

    run_command(main())


@trace_app.command("list")
def trace_list(
    session: Annotated[str | None, typer.Option("--session", "-s",
                                                help="Only this session (its key or its name).")] = None,
    limit: Annotated[int, typer.Option(help="How many turns.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (whole turn ids).")] = False,
) -> None:
    """The latest turns, newest first."""
    settings = settings_or_exit()

    async def main() -> int:
        async with open_store(settings) as db:
            key = None
            if session is not None and (key := await _session_key_or_exit(SqlSessionStore(db), session)) is None:
                return 1
            traces = await SqlTraceStore(db).recent(limit, key)
        if as_json:
            print_json([{"turn_id": t.turn_id, "session": t.session_key, "status": t.status,
                         "started_at": t.started_at, "tool_calls": len(t.detail.get("tool_calls", []))}
                        for t in traces])
            return 0
        table = Table("turn", "session", "status", "started", "tool calls")
        table.columns[0].no_wrap = True
        for t in traces:
            tool_calls = len(t.detail.get("tool_calls", []))
            table.add_row(t.turn_id[:TURN_ID_SHOWN], t.session_key, t.status, _when(t.started_at), str(tool_calls))
        out.print(table if traces else "No turns recorded yet.")
        return 0

    run_command(main())


@trace_app.command("show")
def trace_show(turn_id: Annotated[str, typer.Argument(
        help="A turn id, or its start as `ember trace list` shows it.")],
        as_json: Annotated[bool, typer.Option("--json", help="Print the trace as JSON.")] = False) -> None:
    """A turn's stages, model calls, tool calls and approval decisions."""
    from ember.trace_view import show_trace

    settings = settings_or_exit()

    async def main() -> int:
        async with open_store(settings) as db:
            traces = SqlTraceStore(db)
            matches = await traces.turn_ids(turn_id) if turn_id else []
            if len(matches) > 1 and turn_id not in matches:
                err.print(f"{turn_id!r} starts several turn ids ({', '.join(matches)}); give more of it",
                          markup=False)
                return 1
            trace = await traces.get(turn_id if turn_id in matches else matches[0]) if matches else None
        if trace is None:
            err.print(f"no turn {turn_id!r}; `ember trace list` shows recent ones", markup=False)
            return 1
        if as_json:
            print_json({"turn_id": trace.turn_id, "session": trace.session_key, "status": trace.status,
                        "error": trace.error, "started_at": trace.started_at, "finished_at": trace.finished_at,
                        **trace.detail})
            return 0
        show_trace(trace, out)
        return 0

    run_command(main())


@app.command()
def doctor() -> None:
    """Check the configuration, the store and the model endpoint."""
    from ember.diagnostics import run_checks

    settings = settings_or_exit()
    run_command(run_checks(settings, out))


@app.command()
def demo() -> None:
    """An offline walkthrough on the scripted demo model (no AI involved)."""
    from ember.demo import run_demo

    run_command(run_demo(out))


def _when(timestamp: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


def main() -> None:
    # Every command: a process of the same user must not read its environment (its keys) from /proc.
    make_undumpable()
    app()

