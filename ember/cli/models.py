"""`ember models`: the configured models, the roles that call them, and whether they answer.

A key is never printed: only where it comes from and whether it is set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from ember.cli.common import err, out, print_json, run_command, settings_or_exit, setup_logging

if TYPE_CHECKING:
    from ember.config.settings import Settings


@dataclass(slots=True)
class ModelRow:
    name: str
    provider: str
    model: str
    base_url: str
    key: str  # where the key comes from, never the key
    context_window: int | None
    price_input_per_mtok: float | None
    price_output_per_mtok: float | None
    roles: dict[str, int] = field(default_factory=dict)  # role -> place in its chain, from 1
    state: str = "not checked"


def model_rows(settings: Settings) -> list[ModelRow]:
    from ember.app.models import model_specs
    from ember.models.spec import ANTHROPIC_BASE_URL, ROLES, role_chains

    if not settings.model_configured:
        return []
    specs = model_specs(settings)
    chains = role_chains(specs, dict(settings.model_roles)) if settings.models else {role: list(specs)
                                                                                     for role in ROLES}
    rows = []
    for name, spec in specs.items():
        if not settings.models:  # the single-model settings: a key from the environment or the config
            key = "set" if spec.api_key is not None else "none"
        elif spec.api_key is not None:
            key = "in the config"
        elif spec.api_key_env:
            key = f"${spec.api_key_env} ({'set' if spec.key() else 'not set'})"
        else:
            key = "none"
        rows.append(ModelRow(name, spec.provider, spec.model, spec.base_url or ANTHROPIC_BASE_URL, key,
                             spec.context_window, spec.price_input_per_mtok, spec.price_output_per_mtok,
                             {role: chain.index(name) + 1 for role, chain in chains.items() if name in chain}))
    return rows


def _demo_row() -> ModelRow:
    from ember.models.demo import DEMO_NAME
    from ember.models.spec import ROLES

    return ModelRow(DEMO_NAME, "scripted", DEMO_NAME, "offline, in this process", "none", None, None, None,
                    dict.fromkeys(ROLES, 1), state="demo: canned answers, not AI")


def models(
    check: Annotated[bool, typer.Option("--check", help="Ask each endpoint whether it answers.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the configured models: provider, endpoint, window, prices, the roles that call them
    (with none configured, the scripted demo model that `ember chat` and `ember serve` then use)."""
    from ember.app.model_probe import probe_model
    from ember.app.models import model_endpoints
    from ember.config.settings import CONFIGURE_MODEL_HINT

    settings = settings_or_exit()
    setup_logging(settings, verbose=False)
    rows = model_rows(settings)
    if not rows and (missing := settings.missing_model_setting()):
        err.print(f"error: {missing}.", markup=False)
        raise typer.Exit(1)
    if not rows:
        rows = [_demo_row()]
        err.print(f"No model is configured: the scripted demo model answers (canned text, not AI). "
                  f"Configure one with:\n  {CONFIGURE_MODEL_HINT}", markup=False)

    async def main() -> int:
        if check and settings.model_configured:
            for name, model in model_endpoints(settings).items():
                state, said = await probe_model(model)
                row = next(row for row in rows if row.name == name)
                row.state = "up" if state == "up" else f"up; {said}" if state == "unlisted" else f"down: {said}"
        if as_json:
            print_json([asdict(row) for row in rows])
            return 0
        for row in rows:  # two lines a model: readable in 80 columns, where a table wraps every cell
            prices = ("$" + " / $".join("?" if p is None else f"{p:g}" for p in (
                row.price_input_per_mtok, row.price_output_per_mtok)) + " per Mtok in / out"
                      if row.price_input_per_mtok is not None or row.price_output_per_mtok is not None
                      else "no price (tokens only)")
            state = (f"[green]{escape(row.state)}[/green]" if row.state.startswith("up")
                     else f"[red]{escape(row.state)}[/red]" if row.state.startswith("down") else row.state)
            out.print(f"[bold]{escape(row.name)}[/bold]  {row.provider}:{escape(row.model)}  {escape(row.base_url)}"
                      f"  {state}", highlight=False)
            details = [", ".join(f"{role} #{place}" for role, place in row.roles.items()) or "no role",
                       f"key {escape(row.key)}", f"window {row.context_window:,}" if row.context_window
                       else "window not set", prices]
            out.print("  " + " · ".join(details), highlight=False)
        return 1 if any(row.state.startswith("down") for row in rows) else 0

    run_command(main())
