"""How a caller asks a model to sample its answer: the request options a client may set."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """Options for each model call of one turn; None leaves the model's own setting.

    `max_tokens` bounds each call's output (a turn with tool calls makes several).
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
