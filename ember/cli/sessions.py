"""`ember sessions` and `ember trace`: what is stored, and what each turn did."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ember.cli.common import err, open_listings, open_store, out, print_json, run_command, settings_or_exit

if TYPE_CHECKING:
    from ember.store.protocols import SessionBrowser
    from ember.store.sqlite.glance import GlancedSessions

sessions_app = typer.Typer(help="Inspect stored sessions.", no_args_is_help=True)
trace_app = typer.Typer(help="What a turn did: stages, model calls, tool calls, approvals.", no_args_is_help=True)


def _resolve_session_key(known: set[str], name: str) -> str:
    """The stored key a person means by `name`: the key itself, a terminal session's name, or the
    last part of any key (`work` for `http:alice:work`). ValueError says why none, or which several."""
    from ember.channels.cli import CHANNEL

    for candidate in (name, f"{CHANNEL}:{name}"):
        if candidate in known:
            return candidate
    matches = sorted(key for key in known if key.rsplit(":", 1)[-1] == name)
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"{name!r} names several sessions: {', '.join(matches)}; give the whole key")
    raise ValueError(f"no session named {name!r}; `ember sessions list` shows them")


async def _session_key_or_exit(store: SessionBrowser | GlancedSessions, name: str) -> str | None:
    try:
        return _resolve_session_key({row.key for row in await store.list_sessions()}, name)
    except ValueError as exc:
        err.print(str(exc), markup=False)
        return None


TURN_ID_SHOWN = 12  # a turn id's unique prefix in lists; every command takes it


@sessions_app.command("list")
def sessions_list(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List sessions, most recently active first."""
    from rich.table import Table

    async def main() -> int:
        async with open_listings() as stores:
            rows = await stores.sessions.list_sessions()
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
    from ember.core.delivery import interleaved
    from ember.core.messages import Message

    settings = settings_or_exit()

    async def main() -> int:
        async with open_store(settings) as stores:
            store = stores.sessions
            resolved = await _session_key_or_exit(store, key)
            if resolved is None:
                return 1
            entries = interleaved(await store.history(resolved), await stores.deliveries.failures(resolved))
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
    from rich.table import Table

    async def main() -> int:
        async with open_listings() as stores:
            key = None
            if session is not None and (key := await _session_key_or_exit(stores.sessions, session)) is None:
                return 1
            traces = await stores.traces.recent(limit, key)
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
    from ember.cli.trace_view import show_trace, trace_json
    from ember.core.traces import delegated_traces

    settings = settings_or_exit()

    async def main() -> int:
        async with open_store(settings) as stores:
            traces = stores.traces
            matches = await traces.turn_ids(turn_id) if turn_id else []
            if len(matches) > 1 and turn_id not in matches:
                err.print(f"{turn_id!r} starts several turn ids ({', '.join(matches)}); give more of it",
                          markup=False)
                return 1
            trace = await traces.get(turn_id if turn_id in matches else matches[0]) if matches else None
            children = await delegated_traces(trace, traces.get) if trace is not None else {}
        if trace is None:
            err.print(f"no turn {turn_id!r}; `ember trace list` shows recent ones", markup=False)
            return 1
        if as_json:
            print_json(trace_json(trace, children))
            return 0
        show_trace(trace, out, children)
        return 0

    run_command(main())


def _when(timestamp: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")
