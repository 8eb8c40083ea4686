"""The offline demo model: scripted rules, clearly labelled, no network.

It lets `make run` and `ember demo` show the whole runtime (streaming, a tool
call, reasoning kept out of the answer, consolidation, memory, approvals,
skills) without any model: "remember that …" is kept with the `remember` tool,
and every later answer, in any session, says what the profile in its prompt
holds; "write a note …" writes it with `write_file`, which asks the person's
approval first; "which skills …" reads a skill of the prompt's index with
`skill_view`, as a model does before following one; "ask a helper …" hands the
listing of the workspace to another agent with `delegate`.
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
_NOTE = re.compile(r"^\s*(?:please\s+)?(?:write|save|take)\s+(?:down\s+)?(?:a\s+|this\s+)?note\b[\s:,]*"
                   r"(?:(?:that\s+)?says?\s*:?\s*|saying\s*:?\s*)?(.*?)\s*$", re.IGNORECASE | re.DOTALL)
_HELPER = re.compile(r"\b(?:helper|delegate)\b", re.IGNORECASE)
NOTE_PATH = "notes/demo-note.md"
HELPER_TASK = "List the files in the workspace and say what is there."
HINTS = ("Ask me about the files in your workspace to see a tool call, to \"write a note …\" to see an approval, "
         "which skills I have to see one read, or to ask a helper to see a task delegated.")


def _profile(system: str) -> list[str]:
    """The facts the prompt's profile section lists."""
    if PROFILE_HEADING not in system:
        return []
    section = system.split(PROFILE_HEADING, 1)[1].split("\n\n", 1)[0]
    return [line[2:] for line in section.splitlines() if line.startswith("- ")]


def _skills(system: str) -> list[str]:
    """The skill names the prompt's index lists (the section whose heading names skill_view)."""
    section = next((part for part in system.split("\n\n") if "skill_view" in part.split("\n", 1)[0]), "")
    return [line[2:].split(":", 1)[0] for line in section.splitlines()[1:] if line.startswith("- ")]


def _called(messages: list[Message], call_id: str | None) -> ToolCall | None:
    """The call a tool result answers."""
    for message in reversed(messages):
        for call in message.tool_calls:
            if call.id == call_id:
                return call
    return None


def _after_tool(messages: list[Message]) -> ModelReply:
    last = messages[-1]
    call = _called(messages, last.tool_call_id)
    if last.content.startswith(("Remembered as", "Already remembered")):
        return ModelReply(text=f"{LABEL} {last.content} Start a new session and ask me what I know about you.")
    if call is not None and call.name == "skill_view" and last.content.startswith("# Skill "):
        shown = "\n".join([line for line in last.content.splitlines() if line.strip()][:4])
        return ModelReply(text=f"{LABEL} Before following a skill, a model reads it:\n{shown}")
    if call is not None and call.name == "write_file" and "(the user said no)" in last.content:
        return ModelReply(text=f"{LABEL} You said no, so nothing was written. Ask again and answer y to see it done.")
    if call is not None and call.name == "write_file" and last.content.startswith(("created ", "overwrote ")):
        return ModelReply(text=f"{LABEL} You approved it, and the note is in {NOTE_PATH}: {last.content}")
    if call is not None and call.name == "delegate":
        return ModelReply(text=f"{LABEL} A helper worked on it in a session of its own (its steps are in this "
                               f"turn's trace) and answered:\n{last.content}")
    return ModelReply(text=f"{LABEL} The tool answered:\n{last.content}")


def _demo_reply(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
    system = messages[0].content if messages and messages[0].role is Role.SYSTEM else ""
    last = messages[-1]
    if not any(m.role is Role.ASSISTANT for m in messages) and "Summarise" in system:
        return ModelReply(text=f"{LABEL} summary: {last.content[:200]}")
    if "durable facts" in system:
        return ModelReply(text="NONE")
    if last.role is Role.TOOL:
        return _after_tool(messages)
    words = last.content.lower()
    tool_names = {spec.name for spec in tools}
    asked_to_remember = _REMEMBER.match(last.content)
    if "remember" in tool_names and asked_to_remember:
        call = ToolCall(id="demo_call_1", name="remember",
                        arguments=json.dumps({"content": asked_to_remember.group(1)}))
        return ModelReply(text="I will remember that.", tool_calls=(call,))
    asked_to_note = _NOTE.match(last.content)
    if "write_file" in tool_names and asked_to_note:
        note = asked_to_note.group(1) or "A note from Ember's demo."
        call = ToolCall(id="demo_call_1", name="write_file",
                        arguments=json.dumps({"path": NOTE_PATH, "content": note + "\n"}))
        return ModelReply(text=f"I will write it to {NOTE_PATH}; writing a file asks for your approval first.",
                          tool_calls=(call,))
    if "delegate" in tool_names and _HELPER.search(last.content):
        call = ToolCall(id="demo_call_1", name="delegate", arguments=json.dumps({"task": HELPER_TASK}))
        return ModelReply(text="I will hand that to a helper.", tool_calls=(call,))
    skills = _skills(system)
    if "skill_view" in tool_names and skills and "skill" in words:
        name = next((skill for skill in skills if skill.lower() in words), skills[0])
        call = ToolCall(id="demo_call_1", name="skill_view", arguments=json.dumps({"name": name}))
        return ModelReply(text=f"I have {len(skills)} skills: {', '.join(skills)}. Let me read \"{name}\".",
                          tool_calls=(call,))
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
            f"{HINTS}{remembered}"
        )
    )


DEMO_NAME = "scripted-demo"


def demo_model() -> FunctionModel:
    return FunctionModel(_demo_reply, name=DEMO_NAME, chunk_size=6, delta_delay_s=0.01)
