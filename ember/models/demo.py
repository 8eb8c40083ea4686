"""The offline demo model: scripted rules, clearly labelled, no network.

It lets `make run` and `ember demo` show the whole runtime (streaming, a tool
call, reasoning kept out of the answer, consolidation) without any model.
"""

from __future__ import annotations

import json

from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import ToolSpec
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel

LABEL = "[scripted demo model]"


def _demo_reply(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
    system = messages[0].content if messages and messages[0].role is Role.SYSTEM else ""
    last = messages[-1]
    if not any(m.role is Role.ASSISTANT for m in messages) and "Summarise" in system:
        return ModelReply(text=f"{LABEL} summary: {last.content[:200]}")
    if "durable facts" in system:
        return ModelReply(text="NONE")
    if last.role is Role.TOOL:
        return ModelReply(text=f"{LABEL} The tool answered:\n{last.content}")
    words = last.content.lower()
    tool_names = {spec.name for spec in tools}
    if "list_dir" in tool_names and any(w in words for w in ("file", "folder", "workspace", "ls")):
        call = ToolCall(id="demo_call_1", name="list_dir", arguments=json.dumps({"path": "."}))
        return ModelReply(text="Let me look at the workspace.", tool_calls=(call,))
    return ModelReply(
        text=(
            "<think>The user wants a reply; this reasoning must never be shown or stored.</think>"
            f"{LABEL} You said: {last.content!r}. I am not a real model: configure one to get real answers. "
            "Ask me about the files in your workspace to see a tool call."
        )
    )


DEMO_NAME = "scripted-demo"


def demo_model() -> FunctionModel:
    return FunctionModel(_demo_reply, name=DEMO_NAME, chunk_size=6, delta_delay_s=0.01)
