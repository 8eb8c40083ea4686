"""Retrying a model request, the same way for every client: only before its stream starts.

Once text has streamed to a person, a retry would say it twice, so a client
retries only the opening of a request (connect, status, first bytes), and only
what another attempt may fix: ModelUnavailable, and ModelRateLimited after the
wait the endpoint asks for (when it asks for longer than the backoff). A bad
request, a refusal or a context too long fail at once; a StreamBroken is raised
after the opening and never reaches here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_exponential_jitter

from ember.core.errors import ModelRateLimited, ModelUnavailable

T = TypeVar("T")

# The longest wait a rate limit's Retry-After is honoured for, between two attempts.
MAX_RETRY_AFTER_S = 30.0


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header in seconds (the HTTP-date form is rare from model APIs and read as unknown)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


class _Backoff:
    """Exponential backoff with jitter, or the wait a rate limit asks for when that is longer."""

    def __init__(self) -> None:
        self._exponential = wait_exponential_jitter(multiplier=0.25, max=8.0)

    def __call__(self, state: RetryCallState) -> float:
        backoff = self._exponential(state)
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, ModelRateLimited) and error.retry_after_s is not None:
            return max(backoff, min(error.retry_after_s, MAX_RETRY_AFTER_S))
        return backoff


async def open_with_retries(open_request: Callable[[], Awaitable[T]], attempts: int) -> T:
    """`open_request()`, tried up to `attempts` times while it raises ModelUnavailable;
    the last error is raised with the number of attempts in its message."""
    retrying = AsyncRetrying(retry=retry_if_exception_type(ModelUnavailable), stop=stop_after_attempt(attempts),
                             wait=_Backoff(), reraise=True)
    try:
        async for attempt in retrying:
            with attempt:
                return await open_request()
    except ModelUnavailable as exc:
        if attempts > 1:
            exc.args = (f"{exc.args[0]} (after {attempts} attempts)", *exc.args[1:])
        raise
    raise AssertionError("unreachable: tenacity either returns or raises")


def call_with_retries(request: Callable[[], T], attempts: int) -> T:
    """`request()` as open_with_retries tries it, for a blocking call made on a thread of its own."""
    retrying = Retrying(retry=retry_if_exception_type(ModelUnavailable), stop=stop_after_attempt(attempts),
                        wait=_Backoff(), reraise=True)
    try:
        return retrying(request)
    except ModelUnavailable as exc:
        if attempts > 1:
            exc.args = (f"{exc.args[0]} (after {attempts} attempts)", *exc.args[1:])
        raise
