"""The model's memory tools: remember, memory_search, forget. Each acts on the
memory of the turn's person only (or the named agent's own with them); forget archives, it never deletes."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, Field

from ember.core.errors import MemoryInputError
from ember.core.memory import MAX_CONTENT_CHARS, MemoryRecord, SourceRank, remembered_in
from ember.core.redact import redact_text
from ember.core.tools import Risk, ToolRun
from ember.memory.protocols import PersonalMemory
from ember.memory.service import MAX_LIMIT
from ember.tools.base import Tool, ToolFailure, TurnTool


class RememberArgs(BaseModel):
    content: str = Field(description="The fact, in a full sentence that makes sense on its own later.",
                         max_length=MAX_CONTENT_CHARS)
    subject: str | None = Field(default=None, description="Whom or what it is about, e.g. 'user' or 'project ember'.")
    key: str | None = Field(default=None, description="The attribute, e.g. 'home_city'. A new fact with the same "
                            "subject and key replaces the old one.")


class SearchArgs(BaseModel):
    query: str = Field(description="What to look for, in words.")
    limit: int = Field(default=5, ge=1, le=MAX_LIMIT)


class ForgetArgs(BaseModel):
    id: str = Field(description="The id memory_search returned.")


def _line(record: MemoryRecord) -> str:
    day = dt.datetime.fromtimestamp(record.created_at, dt.UTC).strftime("%Y-%m-%d")
    about = f" ({record.subject}.{record.key})" if record.key else ""
    return f"[{record.id}] {day} {record.kind.value}{about}: {record.content}"


def memory_tools(memory: PersonalMemory) -> list[Tool]:
    async def remember(args: RememberArgs, run: ToolRun) -> str:
        try:
            outcome = await memory.remember(run.memory_owner, args.content, subject=args.subject, key=args.key,
                                            source=remembered_in(run.conversation),
                                            source_rank=SourceRank.INFERRED)
        except MemoryInputError as exc:
            raise ToolFailure(str(exc)) from exc
        record = outcome.record
        # The store keeps memories redacted: the model learns that the secret was not kept.
        unkept = (" The secret in it was not kept: memories never hold credentials."
                  if redact_text(args.content) != args.content else "")
        if not outcome.created:
            return f"Already remembered as {record.id}.{unkept}"
        if record.status.value == "pending":
            return (f"Saved as {record.id}, pending confirmation: it contradicts a fact the user stated "
                    "themselves, which stays in force until they confirm the change.")
        replaced = f" It replaces {', '.join(outcome.superseded)}." if outcome.superseded else ""
        return f"Remembered as {record.id}.{replaced}{unkept}"

    async def search(args: SearchArgs, run: ToolRun) -> str:
        try:
            hits = await memory.search(run.memory_owner, args.query, limit=args.limit)
        except MemoryInputError as exc:
            raise ToolFailure(str(exc)) from exc
        return "\n".join(_line(hit.record) for hit in hits) or "Nothing found."

    async def forget(args: ForgetArgs, run: ToolRun) -> str:
        try:
            record = await memory.forget(run.memory_owner, args.id)
        except MemoryInputError as exc:
            raise ToolFailure(str(exc)) from exc
        return f"Forgotten: {record.id} is archived and will not be recalled again."

    return [
        TurnTool("remember", "Remember a durable fact about the user or their work for later conversations.",
                 RememberArgs, remember, risk=Risk.READ, subject=lambda a: a.content, verb="remember"),
        TurnTool("memory_search", "Search what you remember from earlier conversations with this user.",
                 SearchArgs, search, risk=Risk.READ, subject=lambda a: a.query, verb="search memory for"),
        TurnTool("forget", "Forget a memory by its id (it is archived, not deleted).", ForgetArgs, forget,
                 risk=Risk.WRITE, subject=lambda a: a.id, verb="forget the memory"),
    ]
