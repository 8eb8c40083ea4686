"""Tool calls a local model writes as text (`[models.NAME] tool_call_format`): read in every
common form, run as real calls, never streamed or stored as an answer; and a server that takes no
tools at all (llama.cpp without --jinja, an Ollama model without them) is told them as text.

The conformance tests run the real `openai` SDK client and the whole runtime against the tests'
model server answering as Ollama's and llama.cpp's OpenAI-compatible endpoints do."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.messages import Message, Role
from ember.models.base import ModelReply, TextDelta
from ember.models.openai_compat import OpenAICompatibleModel
from ember.models.spec import ToolCallFormat
from ember.models.text_tools import TextCallStream, parse_text_calls
from ember.tools.base import ToolRegistry
from tests.conftest import note_tool, session_key
from tests.modelserver import MODEL, ModelServer, Reply, serving

OFFERED = {"note", "read_file"}
CALL = {"name": "note", "arguments": {"text": "tea"}}
CALL_JSON = json.dumps(CALL)

# (what the model wrote, the answer left, the calls as (name, arguments))
WRITTEN = [
    (f"Let me note it.\n<tool_call>\n{CALL_JSON}\n</tool_call>", "Let me note it.", [("note", {"text": "tea"})]),
    (f"<tool_call>{CALL_JSON}</tool_call><tool_call>" + json.dumps({"name": "read_file", "arguments": {"path": "a"}})
     + "</tool_call>", "", [("note", {"text": "tea"}), ("read_file", {"path": "a"})]),
    (f"<tool_call>\n{CALL_JSON}", "", [("note", {"text": "tea"})]),  # stopped before the closing tag
    (f"```json\n{CALL_JSON}\n```", "", [("note", {"text": "tea"})]),
    ('{"name": "note", "parameters": {"text": "tea"}}', "", [("note", {"text": "tea"})]),  # Llama 3
    ('<|python_tag|>{"name": "note", "parameters": {"text": "tea"}}', "", [("note", {"text": "tea"})]),
    (f"[TOOL_CALLS][{CALL_JSON}]", "", [("note", {"text": "tea"})]),  # Mistral
    ('<tool_call>{"type": "function", "function": {"name": "note", "arguments": "{\\"text\\": \\"tea\\"}"}}'
     "</tool_call>", "", [("note", {"text": "tea"})]),
]
# Answers that hold no call: each stays the answer, as written.
PLAIN = [
    'Here is the JSON you asked for:\n```json\n{"name": "Bob", "age": 3}\n```\nAnything else?',
    '{"name": "Bob", "arguments": {}}',  # a JSON answer naming no offered tool
    '```python\nprint("<tool_call>")\n```\nThat prints a tag.',
    "[a link](https://example.org) comes first here.",
    f"<think>I could write <tool_call>{CALL_JSON}</tool_call></think>No tool is needed.",
    "Plain words, with `inline code` and a ``` fence never closed",
]


@pytest.mark.parametrize(("written", "answer", "calls"), WRITTEN)
def test_a_call_written_in_each_common_form_is_read(written: str, answer: str, calls: list) -> None:
    rest, found = parse_text_calls(written, OFFERED)
    assert rest == answer
    assert [(call.name, json.loads(call.arguments)) for call in found] == calls
    assert len({call.id for call in found}) == len(found)


@pytest.mark.parametrize("written", PLAIN)
def test_an_answer_without_a_call_stays_as_written(written: str) -> None:
    assert parse_text_calls(written, OFFERED) == (written, ())


def streamed(written: str, cuts: list[int]) -> tuple[str, str, list]:
    stream = TextCallStream(OFFERED)
    bounds = [0, *sorted(set(cuts)), len(written)]
    shown = "".join(stream.feed(written[a:b]) for a, b in itertools.pairwise(bounds))
    tail, answer, calls = stream.finish()
    return shown + tail, answer, [(call.name, json.loads(call.arguments)) for call in calls]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(WRITTEN + [(text, text, []) for text in PLAIN]), data=st.data())
def test_however_the_stream_is_cut_a_call_is_never_shown_and_the_rest_is(case: tuple, data: st.DataObject) -> None:
    written, answer, calls = case
    cuts = data.draw(st.lists(st.integers(0, len(written)), max_size=12))
    shown, streamed_answer, streamed_calls = streamed(written, cuts)
    assert streamed_calls == calls
    if calls:
        assert "tea" not in shown and "tool_call" not in shown and streamed_answer == answer
        assert shown.strip() == answer  # what was shown is the answer the history keeps
    else:
        assert shown == written and streamed_answer == written


def local_model(server: ModelServer, tool_call_format: ToolCallFormat = "auto") -> OpenAICompatibleModel:
    return OpenAICompatibleModel(model=MODEL, base_url=server.base_url, api_key=None, timeout_s=10,
                                 max_attempts=2, tool_call_format=tool_call_format)


@pytest.mark.parametrize("dialect", ["ollama", "llamacpp"])
async def test_a_call_written_as_text_streams_nothing_of_itself_and_comes_out_a_call(dialect: str) -> None:
    with serving(dialect=dialect) as server:
        server.push(Reply(text=f"Noting it.\n<tool_call>\n{CALL_JSON}\n</tool_call>"))
        model = local_model(server)
        try:
            events = [event async for event in model.stream([Message.user("note tea")], tools_noted([]).specs())]
        finally:
            await model.aclose()
    shown = "".join(event.text for event in events if isinstance(event, TextDelta))
    [reply] = [event for event in events if isinstance(event, ModelReply)]
    assert shown.strip() == "Noting it." and reply.text == "Noting it."
    assert [(call.name, json.loads(call.arguments)) for call in reply.tool_calls] == [("note", {"text": "tea"})]
    assert reply.input_tokens > 0  # the usage each dialect sends where it sends it


def tools_noted(noted: list[str]) -> ToolRegistry:
    registry = ToolRegistry()
    registry.register(note_tool(noted))
    return registry


async def test_on_ollama_a_text_call_runs_as_a_tool_and_the_history_keeps_a_real_call(start) -> None:  # type: ignore[no-untyped-def]
    noted: list[str] = []
    with serving(dialect="ollama") as server:
        server.push(Reply(text=f"<tool_call>\n{CALL_JSON}\n</tool_call>"), Reply(text="Noted: tea."))
        async with start(local_model(server), tools=tools_noted(noted)) as h:
            final = await h.turn("note that I like tea", stream=True)
            session = await h.runtime.sessions.load(session_key())
            streamed_text = "".join(event.text for event in h.chats["c1"].events)

    assert final.text == "Noted: tea." and noted == ["tea"]
    assert "tool_call" not in streamed_text and '"note"' not in streamed_text
    [_question, call, result, answer] = session.messages
    assert call.role is Role.ASSISTANT and call.content == "" and [c.name for c in call.tool_calls] == ["note"]
    assert result.role is Role.TOOL and result.content == "noted tea" and answer.content == "Noted: tea."
    # The tool's result goes back as a native one: this server took the tools.
    second = server.requests[1]
    assert "tools" in second and [m["role"] for m in second["messages"]][-2:] == ["assistant", "tool"]


@pytest.mark.parametrize(("tool_call_format", "refusals"), [("auto", 1), ("text", 0)])
async def test_llamacpp_without_jinja_is_told_its_tools_as_text(start, tool_call_format: ToolCallFormat,  # type: ignore[no-untyped-def]
                                                                refusals: int) -> None:
    """`auto` learns it from the one refusal, and does not ask again; `text` never sends them."""
    noted: list[str] = []
    with serving(dialect="llamacpp", takes_tools=False) as server:
        server.push(Reply(text=f"<tool_call>\n{CALL_JSON}\n</tool_call>"), Reply(text="Noted: tea."),
                    Reply(text="Still here."))
        async with start(local_model(server, tool_call_format), tools=tools_noted(noted)) as h:
            final = await h.turn("note that I like tea")
            later = await h.turn("are you there?")

    assert final.text == "Noted: tea." and later.text == "Still here." and noted == ["tea"]
    assert len(server.refused) == refusals  # not retried, and not asked again in the next turn
    first, after_tool, next_turn = server.requests
    assert all("tools" not in body for body in server.requests)
    system = first["messages"][0]
    assert system["role"] == "system" and "<tools>" in system["content"] and '"name": "note"' in system["content"]
    # The call and its result go back as the text the model reads: no tool role, no native call.
    roles = [m["role"] for m in after_tool["messages"]]
    assert "tool" not in roles and roles[-2:] == ["assistant", "user"]
    assert "<tool_call>" in after_tool["messages"][-2]["content"]
    assert after_tool["messages"][-1]["content"] == "<tool_response>\nnoted tea\n</tool_response>"
    assert "<tools>" in next_turn["messages"][0]["content"]


async def test_a_native_model_keeps_a_tag_in_its_answer_as_text(start) -> None:  # type: ignore[no-untyped-def]
    noted: list[str] = []
    with serving() as server:
        server.push(Reply(text=f"Write it like <tool_call>{CALL_JSON}</tool_call>."))
        async with start(local_model(server, "native"), tools=tools_noted(noted)) as h:
            final = await h.turn("how does a text tool call look?")

    assert noted == [] and final.text == f"Write it like <tool_call>{CALL_JSON}</tool_call>."
