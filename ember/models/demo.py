"""The offline demo model: scripted rules, clearly labelled, no network.

It lets `make run` and `ember demo` show the whole runtime (streaming, a tool
call, reasoning kept out of the answer, consolidation, memory) without any
model: "remember that …" is kept with the `remember` tool, and every later
answer, in any session, says what the profile in its prompt holds.
"""

from __future__ import annotations

import json
import re

from ember.core.memory import PROFILE_HEADING
from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import ToolSpec
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel

LABEL = "[scripted demo model]"
_REMEMBER = re.compile(r"^\s*(?:please\s+)?remember(?:\s+that)?\s+(.+?)\s*$", re.IGNORECASE | re.DOTALL)


def _profile(system: str) -> list[str]:
    """The facts the prompt's profile section lists."""
    if PROFILE_HEADING not in system:
        return []
    section = system.split(PROFILE_HEADING, 1)[1].split("\n\n", 1)[0]
    return [line[2:] for line in section.splitlines() if line.startswith("- ")]


def _demo_reply(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
    system = messages[0].content if messages and messages[0].role is Role.SYSTEM else ""
    last = messages[-1]
    if not any(m.role is Role.ASSISTANT for m in messages) and "Summarise" in system:
        return ModelReply(text=f"{LABEL} summary: {last.content[:200]}")
    if "durable facts" in system:
        return ModelReply(text="NONE")
    if last.role is Role.TOOL:
        if last.content.startswith(("Remembered as", "Already remembered")):
            return ModelReply(text=f"{LABEL} {last.content} Start a new session and ask me what I know about you.")
        return ModelReply(text=f"{LABEL} The tool answered:\n{last.content}")
    words = last.content.lower()
    tool_names = {spec.name for spec in tools}
    asked_to_remember = _REMEMBER.match(last.content)
    if "remember" in tool_names and asked_to_remember:
        call = ToolCall(id="demo_call_1", name="remember",
                        arguments=json.dumps({"content": asked_to_remember.group(1)}))
        return ModelReply(text="I will remember that.", tool_calls=(call,))
    if "list_dir" in tool_names and any(w in words for w in ("file", "folder", "workspace", "ls")):
        call = ToolCall(id="demo_call_1", name="list_dir", arguments=json.dumps({"path": "."}))
        return ModelReply(text="Let me look at the workspace.", tool_calls=(call,))
    known = _profile(system)
    remembered = (" What I remember about you: " + " ".join(known)) if known else (
        " Tell me \"remember that …\" to see memory at work.")
    return ModelReply(
        text=(
            "<think>The user wants a reply; this reasoning must never be shown or stored.</think>"
            f"{LABEL} You said: {last.content!r}. I am not a real model: configure one to get real answers. "
            f"Ask me about the files in your workspace to see a tool call.{remembered}"
        )
    )


DEMO_NAME = "scripted-demo"


def demo_model() -> FunctionModel:
    return FunctionModel(_demo_reply, name=DEMO_NAME, chunk_size=6, delta_delay_s=0.01)
