"""What each consumer needs of the memory service: the prompt's recall, the turn's closing note,
a person's own memory tools, and the reviewers' writes. `MemoryService` is all of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, Unpack

if TYPE_CHECKING:
    from ember.core.memory import MemoryFields, MemoryKind, MemoryRecord, NewMemory, Recalled, WriteOutcome
    from ember.core.messages import Session
    from ember.memory.prompt import PromptMemory, RecallBudget


class PromptRecall(Protocol):
    """The context stage: what the prompt carries of the person's memory."""

    async def for_prompt(self, identity: str, message: str, *, budget: RecallBudget, session_key: str = "",
                         episodes: int = 0, exclude: Callable[[MemoryRecord], bool] = ...) -> PromptMemory: ...


class RecallNotes(Protocol):
    """The response stage: whether recalls wait to be written (a job the answer's commit queues)."""

    @property
    def recalls_pending(self) -> bool: ...


class PersonalMemory(Protocol):
    """The remember, recall and forget tools: a person's memory, by their own hand."""

    async def remember(self, identity: str, content: str, **fields: Unpack[MemoryFields]) -> WriteOutcome: ...

    async def search(self, identity: str, query: str, *, limit: int = 10, include_inactive: bool = False,
                     kinds: Sequence[MemoryKind] = (), relevant_only: bool = True) -> list[Recalled]: ...

    async def forget(self, identity: str, memory_id: str) -> MemoryRecord: ...


class ReviewedMemory(Protocol):
    """The reviewers: whose turn it was, and what they learned of it."""

    async def turn_owner(self, session: Session, turn_id: str | None) -> str: ...

    async def remember_many(self, memories: Sequence[NewMemory]) -> list[WriteOutcome]: ...
