"""A chain of models that answers as one: the first that can, tried in order.

A model is passed over while its circuit breaker is open (it kept being
unavailable, or timed out, or asked to wait), and left for the next one when
it is unavailable or rate limited now; every model but a chain's last is
tried once per call (configured_model), since its own retries would only
delay the next. Nothing falls over once the stream has sent text (the person has
seen it: a second model would answer twice), nor on a bad request or a refusal
(our request is at fault, or the answer is). A context too long goes only to a
model with a larger window. Every switch is logged, and the reply names the
model that answered and those passed over (the turn's trace shows them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from ember.core.errors import (
    ContextTooLong,
    ModelError,
    ModelRateLimited,
    ModelTimedOut,
    ModelUnavailable,
    StreamBroken,
)
from ember.core.messages import Message
from ember.core.sampling import Sampling
from ember.core.tools import ToolSpec
from ember.models.base import ModelClient, ModelEvent, ModelReply

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Opens after `failures` unavailable answers within `window_s`, or at once after a
    timeout or a rate limit (`failed(at_once=True)`, held at least the wait it asked for);
    after `cooldown_s` it lets one call through (half-open): its success closes it, its
    failure opens it again."""

    def __init__(self, *, failures: int = 3, window_s: float = 60.0, cooldown_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._failures, self._window_s, self._cooldown_s, self._clock = failures, window_s, cooldown_s, clock
        self._recent: list[float] = []
        self._opened_at: float | None = None
        self._open_for = cooldown_s
        self._probing = False

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half-open" if self._probing or self._clock() - self._opened_at >= self._open_for else "open"

    def allows(self) -> bool:
        """Whether a call may go to the model now (a half-open breaker lets one through at a time)."""
        if self._opened_at is None:
            return True
        if self._probing or self._clock() - self._opened_at < self._open_for:
            return False
        self._probing = True
        return True

    def succeeded(self) -> None:
        self._recent.clear()
        self._opened_at, self._probing = None, False

    def released(self) -> None:
        """The call it let through ended without a verdict (cancelled): the next may probe instead."""
        self._probing = False

    def failed(self, *, at_once: bool = False, hold_s: float | None = None) -> None:
        now = self._clock()
        self._open_for = max(self._cooldown_s, hold_s or 0.0)
        if self._probing or at_once:
            self._opened_at, self._probing = now, False
            return
        self._recent = [t for t in self._recent if now - t < self._window_s] + [now]
        if len(self._recent) >= self._failures:
            self._opened_at = now


@dataclass(slots=True)
class Route:
    """One model of a chain, with its window (None: not said) and its breaker."""

    label: str
    model: ModelClient
    context_window: int | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)


class ModelRouter:
    """A ModelClient over `routes`, tried in order for each call."""

    def __init__(self, role: str, routes: Sequence[Route]) -> None:
        if not routes:
            raise ValueError(f"the {role} role has no model")
        self.role = role
        self.routes = list(routes)
        self.name = self.routes[0].model.name

    async def stream(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *,
                     sampling: Sampling | None = None) -> AsyncIterator[ModelEvent]:
        failures: list[str] = []
        needs_window = 0  # set by a context too long: only a larger window may take the request
        for position, route in enumerate(self.routes):
            breaker = route.breaker
            if needs_window and (route.context_window or 0) <= needs_window:
                continue
            if not breaker.allows():
                failures.append(f"{route.label}: skipped, its breaker is open")
                continue
            sent = False
            try:
                async for event in route.model.stream(messages, tools, sampling=sampling):
                    if isinstance(event, ModelReply):
                        breaker.succeeded()  # before the yield: a consumer may stop at the reply
                        event = replace(event, model=route.label, passed_over=tuple(failures))
                    else:
                        sent = True
                    yield event
            except ModelUnavailable as exc:
                # A timeout costs the whole timeout each time; a rate limit said when to come back.
                breaker.failed(at_once=isinstance(exc, ModelTimedOut | ModelRateLimited),
                               hold_s=exc.retry_after_s if isinstance(exc, ModelRateLimited) else None)
                if sent:
                    raise StreamBroken(f"{route.label} failed after its answer had started: {exc}") from exc
                failures.append(f"{route.label}: {exc}")
                self._switching(route, position, exc)
                continue
            except StreamBroken:
                breaker.failed()  # cut off: down, as far as anyone can tell, but what was sent stands
                raise
            except ContextTooLong as exc:
                breaker.succeeded()  # it answered, and it is up
                failures.append(f"{route.label}: {exc}")
                needs_window = route.context_window or 1
                if not any((later.context_window or 0) > needs_window for later in self.routes[position + 1:]):
                    raise
                self._switching(route, position, exc)
                continue
            except ModelError:
                breaker.succeeded()  # up, but the request or its answer is at fault: no other model is asked
                raise
            except BaseException:
                breaker.released()  # cancelled, or the consumer stopped early: no verdict on the model
                raise
            return
        raise ModelUnavailable(f"no model of the {self.role} role could answer: " + "; ".join(failures))

    def _switching(self, route: Route, position: int, exc: Exception) -> None:
        following = next((later.label for later in self.routes[position + 1:]), None)
        log.warning("model %s (%s role) failed: %s; %s", route.label, self.role, exc,
                    f"trying {following}" if following else "no model left to try")

    async def aclose(self) -> None:
        for route in self.routes:
            await route.model.aclose()
