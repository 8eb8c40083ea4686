"""`ember serve`: the gateway's start, said on standard output."""

from __future__ import annotations

import gc
import sys

import typer
from rich.markup import escape

from ember.app.serve import Listening, api_keys, serve
from ember.cli.common import err, out
from ember.config.settings import Settings
from ember.core.errors import EmberError
from ember.models.base import ModelClient


async def serve_gateway(settings: Settings, model: ModelClient, host: str, port: int, *, turns: bool) -> int:
    try:
        keys = api_keys(settings, host)
    except EmberError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc

    def ready(at: Listening) -> None:
        # What start-up built lives as long as the process: out of the collector's way, each full
        # collection no longer walks it (about 5 ms of CPU a turn with embedding_model = "none").
        gc.collect()
        gc.freeze()
        url = f"http://{at.host}:{at.port}"
        if at.model_problem:  # one line, before the rest: what will fail until it is fixed
            out.print(f"[yellow]The model cannot be reached: {escape(at.model_problem)} "
                      "Ember serves anyway; turns fail until the model answers.[/yellow]")
        out.print(f"Ember gateway on [bold]{url}[/bold] — web chat at {url}/, OpenAI API at {url}/v1")
        if not turns:
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

    return await serve(settings, model, keys, host, port, ready, turns=turns)
