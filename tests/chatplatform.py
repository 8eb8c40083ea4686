"""What the chat platforms' tests share: a tool that needs approval, a model that calls it, and
what a test reads back: the texts a chat shows, and what was kept of a sender."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from ember.app.runtime import Runtime
from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import Risk
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store.tx import Statement
from ember.tools.base import FunctionTool


class WriteArgs(BaseModel):
    path: str


def writing_tool(ran: list[str]) -> FunctionTool[WriteArgs]:
    """A write-risk tool (so it asks first) that records each path it was allowed to write."""
    async def write(args: WriteArgs) -> str:
        ran.append(args.path)
        return f"wrote {args.path}"
    return FunctionTool("write_note", "Write a note file.", WriteArgs, write, risk=Risk.WRITE,
                        subject=lambda a: a.path, verb="write the file")


def asking_model() -> FunctionModel:
    """Calls write_note on notes.txt, then answers with what the call returned."""
    def reply(messages: list[Message], tools: Any) -> ModelReply:
        if messages[-1].role is Role.TOOL:
            return ModelReply(text=f"Result: {messages[-1].content}")
        return ModelReply(tool_calls=(ToolCall("w1", "write_note", json.dumps({"path": "notes.txt"})),))
    return FunctionModel(reply)


async def texts_when(texts: Callable[[], list[str]], count: int, *, timeout_s: float = 30) -> list[str]:
    """`texts()` once it has `count` of them, and a moment after (anything sent twice shows by then)."""
    async with asyncio.timeout(timeout_s):
        while len(texts()) < count:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    return texts()


async def kept(runtime: Runtime, sender: str) -> int:
    """How many of `sender`'s messages the store kept."""
    return await runtime.db.run_read(lambda tx: tx.execute(Statement(
        "SELECT COUNT(*) FROM accepted_inbound WHERE sender_id = :sender"), {"sender": sender}).fetchone()[0])
