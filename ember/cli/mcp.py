"""`ember mcp`: the configured MCP servers, as `ember serve` would connect to them."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ember.cli.common import out, print_json, run_command, settings_or_exit, setup_logging

mcp_app = typer.Typer(help="Inspect MCP servers.", no_args_is_help=True)


@mcp_app.command("list")
def mcp_list(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Connect to each configured MCP server and show its state and tools."""
    from ember.tools.mcp import start_mcp

    settings = settings_or_exit()
    setup_logging(settings, verbose=False)

    async def main() -> int:
        hub = await start_mcp(settings.mcp_servers)
        try:
            statuses = hub.status()
        finally:
            await hub.close()
        # A server switched off is listed as such, whatever its connection did.
        states = {s.name: s.state if settings.mcp_servers[s.name].enabled else "disabled" for s in statuses}
        if as_json:
            print_json([{"name": s.name, "transport": s.transport, "target": s.target, "state": states[s.name],
                         "risk": s.risk.value, "tools": list(s.tools), "error": s.error} for s in statuses])
            return 0
        if not statuses:
            out.print("No MCP servers configured; add a [mcp_servers.<name>] table to ember.toml.", markup=False)
            return 0
        table = Table("server", "transport", "status", "risk", "tools", "error")
        for s in statuses:
            state = {"connected": "[green]connected[/green]", "failed": "[red]failed[/red]"}.get(
                states[s.name], states[s.name])
            table.add_row(escape(s.name), escape(f"{s.transport}: {s.target}"), state, s.risk.value,
                          escape(", ".join(s.tools)), escape(s.error or ""))
        out.print(table)
        return 0

    run_command(main())
