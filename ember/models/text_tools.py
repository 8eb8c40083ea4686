"""Tool calls a model writes as text, as local models served by Ollama or llama.cpp often do when
the server's chat template does not turn them into real calls: found, run as calls, and never
shown or stored as an answer (`[models.NAME] tool_call_format`).

The forms read, each call an object `{"name", "arguments" | "parameters"}` (or OpenAI's
`{"type": "function", "function": {…}}`), or a list of them:
- `<tool_call>{…}</tool_call>` (Hermes, Qwen), anywhere, its closing tag optional at the end;
- a fenced block (```` ```json ````, ```` ```tool_call ```` or a bare fence) that holds only calls
  to offered tools;
- the whole answer a call to an offered tool (Llama 3's bare JSON, after an optional
  `<|python_tag|>`), or `[TOOL_CALLS][…]` (Mistral).

A model that cannot be sent tools at all (`text`, or `auto` after the server refused them) is
told them in its system prompt, in the Hermes form most open models are trained on, and reads
its calls and their results back as text (`as_text_history`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from ember.core.messages import Message, Role, ToolCall
from ember.core.thinking import strip_thinking
from ember.core.tools import ToolSpec

TAG = "<tool_call>"
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_FENCE = "```"
_CALL_FENCES = ("", "json", "tool_call", "tool_code")  # the info strings a fenced call comes under
_FENCED = re.compile(r"```(?:json|tool_call|tool_code)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)
_WHOLE_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")
_THINK_TAG = re.compile(r"</?(?:think|thinking|thought)\b", re.IGNORECASE)


def _call(item: Any) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):
        item = item["function"]
    name, arguments = item.get("name"), item.get("arguments", item.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments)
    if not isinstance(arguments, str):
        return None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:16]}", name=name, arguments=arguments or "{}")


def _calls_in(raw: str, offered: Collection[str] | None) -> list[ToolCall] | None:
    """The calls a JSON text holds; None when it holds anything else (or a tool not `offered`)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    calls = [_call(item) for item in (value if isinstance(value, list) else [value])]
    if not calls or any(call is None or (offered is not None and call.name not in offered) for call in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_text_calls(text: str, offered: Collection[str]) -> tuple[str, tuple[ToolCall, ...]]:
    """`text` without the tool calls written in it, and those calls; `text` as it was when it has none.
    Thinking is left out first: a call drafted in a think block is not made."""
    return _extracted(strip_thinking(text) if _THINK_TAG.search(text) else text, offered, original=text)


def _extracted(text: str, offered: Collection[str], *, original: str) -> tuple[str, tuple[ToolCall, ...]]:
    calls: list[ToolCall] = []

    def taken(match: re.Match[str], names: Collection[str] | None) -> str:
        found = _calls_in(match.group(1), names)
        if found is None:
            return match.group(0)
        calls.extend(found)
        return ""

    rest = _TAGGED.sub(lambda match: taken(match, None), text)  # a tag says it is a call, whatever its tool
    rest = _FENCED.sub(lambda match: taken(match, offered), rest)
    if calls:
        return rest.strip(), tuple(calls)
    whole = text.strip()
    for prefix in _WHOLE_PREFIXES:
        if whole.startswith(prefix):
            found = _calls_in(whole.removeprefix(prefix).strip(), None)
            return ("", tuple(found)) if found else (original, ())
    found = _calls_in(whole, offered) if whole[:1] in ("{", "[") else None
    return ("", tuple(found)) if found else (original, ())


class TextCallStream:
    """An answer's text deltas in, the text safe to show out: whatever may still turn out to be a
    tool call is held back until it is known, and the rest streams as it comes. `finish` then
    gives what is left to show, the answer's text and the calls."""

    def __init__(self, offered: Collection[str]) -> None:
        self._offered = offered
        self._text = ""
        self._shown = 0  # characters of the text given out
        self._scan = 0  # where the next look for a call starts; what is before it is decided
        self._start_free = False  # the answer does not begin as a call as a whole
        self._in_plain_fence = False  # inside a fenced block that is not a call (code)
        self._held_from: int | None = None  # a call starts here: nothing from here is shown

    def feed(self, delta: str) -> str:
        self._text += delta
        end = self._safe_end()
        shown, self._shown = self._text[self._shown:end], max(self._shown, end)
        return shown

    def finish(self) -> tuple[str, str, tuple[ToolCall, ...]]:
        """(the text still to show, the answer's text, the calls written in it)."""
        held = self._text[self._shown:]
        answer, calls = parse_text_calls(self._text, self._offered)
        if not calls:
            return held, self._text, ()
        # The calls lie in what was held back. Its thinking is left to the stream's own filter,
        # which has seen where a think block opened.
        tail, _ = _extracted(held, self._offered, original=held)
        return tail, answer, calls

    def _safe_end(self) -> int:
        if self._held_from is not None:
            return self._held_from
        if not self._start_free:
            start = _whole_answer_start(self._text.lstrip())
            if start == "call":
                self._held_from = 0
            if start != "free":
                return 0
            self._start_free = True
        return self._scan_for_calls()

    def _scan_for_calls(self) -> int:
        text = self._text
        while True:
            if self._in_plain_fence:
                close = text.find(_FENCE, self._scan)
                if close < 0:  # code shows as it comes; its closing fence may still be arriving
                    self._scan = max(self._scan, len(text) - len(_FENCE) + 1)
                    return len(text)
                self._scan, self._in_plain_fence = close + len(_FENCE), False
            tag, fence = text.find(TAG, self._scan), text.find(_FENCE, self._scan)
            if tag >= 0 and (fence < 0 or tag < fence):
                self._held_from = tag
                return tag
            if fence < 0:
                # Nothing before the last few characters can start a tag or a fence any more.
                self._scan = max(self._scan, len(text) - len(TAG) + 1)
                return len(text) - _partial_marker(text[self._scan:])
            decided = self._fence_at(fence)
            if decided is not None:
                return decided

    def _fence_at(self, fence: int) -> int | None:
        """Decide the fenced block opening at `fence`: where showing must stop for now, or None
        when it is plain code (the scan goes on inside it)."""
        text = self._text
        line_end = text.find("\n", fence)
        if line_end < 0:
            return fence  # its info string is not known yet
        body = text[line_end + 1:].lstrip()
        json_fence = text[fence + len(_FENCE):line_end].strip().lower() in _CALL_FENCES
        if json_fence and not body:
            return fence
        if not json_fence or body[0] not in ("{", "["):
            self._scan, self._in_plain_fence = line_end + 1, True
            return None
        close = text.find(_FENCE, line_end)
        if close < 0:
            return fence  # JSON, maybe a call: known when the block closes
        if _calls_in(text[line_end + 1:close].strip(), self._offered):
            self._held_from = fence
            return fence
        self._scan = close + len(_FENCE)
        return None


def _whole_answer_start(lead: str) -> str:
    """Whether an answer beginning `lead` may be a call as a whole: "call", "free", or "wait" (too soon)."""
    if not lead:
        return "wait"
    if lead[0] == "{" or lead.startswith(_WHOLE_PREFIXES):
        return "call"
    if any(prefix.startswith(lead) for prefix in _WHOLE_PREFIXES):
        return "wait"
    if lead[0] == "[":
        after = lead[1:].lstrip()
        return "wait" if not after else "call" if after[0] == "{" else "free"
    return "free"


def _partial_marker(tail: str) -> int:
    """How many characters at the end of `tail` may begin a tag or a fence still being written."""
    for size in range(len(TAG) - 1, 0, -1):
        if tail.endswith(TAG[:size]):
            return size
    return len(tail) - len(tail.rstrip("`"))


def tools_prompt(specs: Sequence[ToolSpec]) -> str:
    """The system prompt's part that tells a model without native tools which it has, and how to call them."""
    listed = "\n".join(json.dumps({"name": spec.name, "description": spec.description,
                                   "parameters": spec.parameters}, ensure_ascii=False) for spec in specs)
    return ("# Tools\n\nYou may call one or more tools to help with the request. They are described, "
            f"as JSON schemas, within <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
            "To call a tool, answer with one block per call, and nothing after the last:\n"
            '<tool_call>\n{"name": "<tool name>", "arguments": {<its arguments, as JSON>}}\n</tool_call>\n'
            "Each result comes back to you within <tool_response></tool_response>.")


def as_text_history(messages: Iterable[Message]) -> list[Message]:
    """The history for a model without native tools: its calls written back as it wrote them, and
    the results as a person's message (consecutive ones together, so roles keep alternating)."""
    shown: list[Message] = []
    for message in messages:
        if message.role is Role.ASSISTANT and message.tool_calls:
            calls = "\n".join(f"{TAG}\n" + json.dumps({"name": call.name, "arguments": _arguments(call.arguments)},
                                                      ensure_ascii=False) + "\n</tool_call>"
                              for call in message.tool_calls)
            shown.append(Message.assistant("\n".join(filter(None, (message.content, calls)))))
        elif message.role is Role.TOOL:
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            if shown and shown[-1].role is Role.USER and shown[-1].content.startswith("<tool_response>"):
                shown[-1] = Message.user(f"{shown[-1].content}\n{response}")
            else:
                shown.append(Message.user(response))
        else:
            shown.append(message)
    return shown


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw or "{}")
    except ValueError:
        return raw
