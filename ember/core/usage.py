"""What model calls cost: the tokens of each call, its price, and whom it is charged to.

A call is charged to the scope it runs in (a context variable): a turn sets
its session, identity and turn id; a background job its kind and session, and
the identity is that session's. A price is per model, in USD per million
tokens; a call with tokens of a kind whose price is not configured gets no
cost at all (never a guess), its tokens are still counted.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class UsageScope:
    session_key: str | None = None
    identity: str | None = None
    turn_id: str | None = None
    job_kind: str | None = None  # None: the turn's own calls
    agent: str | None = None  # the named agent the turn runs as (None: the default agent)


@dataclass(slots=True)
class TurnTally:
    """What a turn's model calls used so far, its delegated turns' included."""

    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from (or written to) a provider's cache

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def add(self, other: TurnTally) -> None:
        self.model_calls += other.model_calls
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cached_tokens += other.cached_tokens


NO_SCOPE = UsageScope()  # frozen: safe as the default of every context
current_scope: ContextVar[UsageScope] = ContextVar("ember_usage_scope", default=NO_SCOPE)


@dataclass(frozen=True, slots=True)
class Price:
    input_per_mtok: float | None = None
    output_per_mtok: float | None = None
    cache_read_per_mtok: float | None = None
    cache_write_per_mtok: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageRow:
    at: float
    model: str
    scope: UsageScope
    input_tokens: int = 0  # not read from a cache
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: float | None = None


@dataclass(frozen=True, slots=True)
class UsageCell:
    """One person's model calls of one day in one session, summed."""

    day: int  # days since 1970-01-01, in the person's time zone
    session_key: str | None  # None: background work of no session
    calls: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    cost_usd: float  # of the priced calls
    unpriced_calls: int


def cost_usd(price: Price | None, *, input_tokens: int, output_tokens: int, cache_read_tokens: int = 0,
             cache_write_tokens: int = 0) -> float | None:
    """The call's cost, or None when a kind of token it used has no price."""
    if price is None:
        return None
    total = 0.0
    for tokens, per_mtok in ((input_tokens, price.input_per_mtok), (output_tokens, price.output_per_mtok),
                             (cache_read_tokens, price.cache_read_per_mtok),
                             (cache_write_tokens, price.cache_write_per_mtok)):
        if tokens:
            if per_mtok is None:
                return None
            total += tokens * per_mtok / 1e6
    return total


# What a call is reserved as before it is made, so concurrent calls cannot all spend the same
# room in a budget: its prompt at 3 characters a token (more tokens than providers count), and its
# whole output limit.
RESERVED_CHARS_PER_TOKEN = 3
RESERVED_OUTPUT_TOKENS = 4096  # when the call sets no max_tokens


def reservation_usd(price: Price | None, prompt_chars: int, max_output_tokens: int | None) -> float | None:
    """The most a call may cost, at `price`; None when it has no price (it is then never budgeted)."""
    return cost_usd(price, input_tokens=-(-prompt_chars // RESERVED_CHARS_PER_TOKEN),
                    output_tokens=max_output_tokens or RESERVED_OUTPUT_TOKENS)


class Budget(Protocol):
    async def refusal(self, identity: str, agent: str | None = None) -> str | None:
        """Why the identity (or the named agent) may not start a turn now, or None."""
        ...


class CallBudget(Protocol):
    def holds(self, scope: UsageScope) -> bool:
        """Whether a budget holds calls of `scope` back (else there is nothing to reserve)."""
        ...

    async def reserve(self, scope: UsageScope, usd: float) -> Callable[[], None]:
        """Hold `usd` of the day of the scope's identity, and of its agent, for one call; the
        release to call once the call is over (its cost counted by then). BudgetSpent when a day
        has no room for it."""
        ...
