"""The OpenAI route's sampling options, checked against the API's ranges and the gateway's caps."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ember.channels.gateway.http import ApiError
from ember.channels.gateway.schemas import ChatCompletionRequest
from ember.core.sampling import Sampling


@dataclass(frozen=True, slots=True)
class SamplingLimits:
    """The most a request may ask for (settings gateway_max_tokens, gateway_max_temperature)."""

    max_tokens: int = 32_768
    max_temperature: float = 2.0


DEFAULT_LIMITS = SamplingLimits()


def requested_sampling(body: ChatCompletionRequest, limits: SamplingLimits) -> Sampling | None:
    """The request's options, or None when it sets none; ApiError 400 for one out of range."""
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                       code="invalid_value", param="max_completion_tokens")
    name = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    if max_tokens is not None:
        _within(name, max_tokens, 1, limits.max_tokens, "gateway_max_tokens caps it")
    if body.temperature is not None:
        _within("temperature", body.temperature, 0, limits.max_temperature,
                "gateway_max_temperature caps it" if limits.max_temperature < 2 else "")
    if body.top_p is not None:
        _within("top_p", body.top_p, 0, 1, "")
    if max_tokens is None and body.temperature is None and body.top_p is None:
        return None
    return Sampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p)


def _within(name: str, value: float, low: float, high: float, cap: str) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        said = f" ({cap})" if cap else ""
        raise ApiError(400, f"{name} must be from {_shown(low)} to {_shown(high)}{said}; it was {_shown(value)}",
                       code="invalid_value", param=name)


def _shown(number: float) -> str:
    return str(int(number)) if math.isfinite(number) and float(number).is_integer() else f"{number:g}"
