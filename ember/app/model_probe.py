"""Asking a configured model's endpoint whether it answers: `ember doctor`, `ember models --check`,
and once, bounded, when `ember serve` starts."""

from __future__ import annotations

import asyncio

from ember.app.models import model_endpoints, model_specs
from ember.config.settings import Settings
from ember.core.errors import EmberError, ModelTimedOut, ModelUnavailable
from ember.models.base import ModelEndpoint
from ember.models.unreachable import LISTING

MODEL_CHECK_TIMEOUT_S = 10.0
# `ember serve` waits at most this long for its model before it serves anyway.
START_PROBE_TIMEOUT_S = 2.0


async def probe_model(model: ModelEndpoint, timeout_s: float = MODEL_CHECK_TIMEOUT_S) -> tuple[str, str]:
    """("up" | "unlisted" | "down", what to say), the endpoint asked for its model list; closes the client."""
    try:
        names = await asyncio.wait_for(model.list_models(), timeout_s)
    except (EmberError, TimeoutError) as exc:
        return "down", str(exc) or f"no answer within {timeout_s:g} s"
    finally:
        await model.aclose()
    if names and model.name not in names:
        return "unlisted", f"answers, but does not list {model.name!r}"
    return "up", f"answers; model {model.name}"


async def _unreachable(model: ModelEndpoint, timeout_s: float) -> str | None:
    """Why `model`'s endpoint cannot be reached, or None when it answers (with whatever status:
    an endpoint that refuses a key or lists no models is reachable, and doctor says the rest)."""
    try:
        await asyncio.wait_for(model.list_models(), timeout_s)
    except (ModelUnavailable, ModelTimedOut) as exc:
        return str(exc).removeprefix(f"{LISTING}: ")
    except TimeoutError:
        return f"no answer from {model.base_url} within {timeout_s:g} s"
    except EmberError:
        return None
    finally:
        await model.aclose()
    return None


async def unreachable_models(settings: Settings, timeout_s: float = START_PROBE_TIMEOUT_S) -> str:
    """One sentence naming each configured model whose endpoint cannot be reached, "" when all can
    (or none is configured). Each is asked once, all at once, for at most `timeout_s`."""
    if not settings.model_configured:
        return ""
    names = list(model_specs(settings))
    endpoints = model_endpoints(settings, tried_once=names)
    said = await asyncio.gather(*(_unreachable(model, timeout_s) for model in endpoints.values()))
    down = [f"{name}: {why}" if settings.models else why
            for name, why in zip(endpoints, said) if why is not None]
    return "; ".join(down)
