"""AnthropicModel over real HTTP, against the tests' own Messages API server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.core.errors import (
    ContextTooLong,
    ModelBadRequest,
    ModelRateLimited,
    ModelRefused,
    ModelUnavailable,
    StreamBroken,
)
from ember.core.messages import Message, ToolCall
from ember.core.sampling import Sampling
from ember.models.anthropic_messages import AnthropicModel, TokenLimits
from ember.models.base import ModelEvent, ModelReply, ReasoningDelta, TextDelta, complete
from tests.anthropicserver import MODEL, AnthropicServer, Turn, signature
from tests.modelserver import tool_call
from tests.test_cli_e2e import chat, ember, ember_env, stored
from tests.test_openai_model import READ_FILE

HELLO = [Message.system("Be brief."), Message.user("hello")]


def client(server: AnthropicServer, *, max_attempts: int = 1, thinking_budget: int | None = None) -> AnthropicModel:
    return AnthropicModel(model=f"anthropic:{MODEL}", api_key="sk-ant-test", base_url=server.base_url,
                          timeout_s=10, max_attempts=max_attempts,
                          limits=TokenLimits(4096, thinking_budget))


async def events_of(model: AnthropicModel, messages: list[Message] = HELLO) -> list[ModelEvent]:
    try:
        return [event async for event in model.stream(messages, [READ_FILE])]
    finally:
        await model.aclose()


async def test_text_streams_in_pieces_with_usage_and_cache_tokens(anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(Turn(text="Hello there, human.", input_tokens=40, output_tokens=9, cache_read_tokens=30,
                               cache_write_tokens=5))
    events = await events_of(client(anthropic_server))

    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 1 and "".join(deltas) == "Hello there, human."
    reply = events[-1]
    assert isinstance(reply, ModelReply) and reply.text == "Hello there, human." and not reply.truncated
    assert (reply.input_tokens, reply.output_tokens) == (40, 9)
    assert (reply.cache_read_tokens, reply.cache_write_tokens) == (30, 5)
    sent = anthropic_server.requests[0]
    assert sent["model"] == MODEL and sent["system"] == "Be brief." and sent["max_tokens"] == 4096
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert sent["tools"][0]["name"] == "read_file" and sent["tools"][0]["input_schema"]["required"] == ["path"]
    assert "thinking" not in sent
    headers = anthropic_server.headers[0]  # the SDK sends the key as a bearer token (older ones: x-api-key)
    assert headers.get("x-api-key", headers.get("authorization", "").removeprefix("Bearer ")) == "sk-ant-test"
    assert headers["anthropic-version"]


async def test_a_callers_max_tokens_is_sent_and_the_options_the_api_lacks_are_not(
        anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(Turn(text="Brief."), Turn(text="Thought."))
    model = client(anthropic_server)
    options = Sampling(max_tokens=64, temperature=0.6, top_p=0.8)
    assert (await _reply(model, options)).text == "Brief."
    sent = anthropic_server.requests[0]
    assert sent["max_tokens"] == 64 and "temperature" not in sent and "top_p" not in sent
    thinking = client(anthropic_server, thinking_budget=1024)
    assert (await _reply(thinking, options)).text == "Thought."
    sent = anthropic_server.requests[1]  # the thinking budget must fit under the configured limit
    assert sent["max_tokens"] == 4096 and sent["thinking"]["budget_tokens"] == 1024


async def _reply(model: AnthropicModel, sampling: Sampling) -> ModelReply:
    try:
        events = [event async for event in model.stream(HELLO, sampling=sampling)]
    finally:
        await model.aclose()
    assert isinstance(events[-1], ModelReply)
    return events[-1]


async def test_a_tool_call_is_put_together_from_its_json_fragments(anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(Turn(text="Let me look.", tool_calls=(tool_call("read_file", path="notes/todo.md"),)))
    reply = await complete(client(anthropic_server), HELLO, [READ_FILE])

    assert reply.text == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("read_file", {"path": "notes/todo.md"})]
    assert reply.tool_calls[0].id.startswith("toolu_")


async def test_thinking_streams_apart_and_goes_back_with_its_signature_in_the_tool_loop(
        anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(
        Turn(thinking="The user wants the list; read it.", tool_calls=(tool_call("read_file", path="todo.md"),)),
        Turn(text="You need milk."))
    model = client(anthropic_server, thinking_budget=2048)
    events = [event async for event in model.stream(HELLO, [READ_FILE])]
    first = events[-1]
    assert isinstance(first, ModelReply)
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "The user wants the list; read it."
    assert first.reasoning == "The user wants the list; read it." and not first.text
    assert not any(isinstance(e, TextDelta) for e in events)

    loop = [*HELLO, Message.assistant("", tool_calls=first.tool_calls, reasoning=first.reasoning,
                                      reasoning_blocks=first.reasoning_blocks),
            Message.tool_result(first.tool_calls[0].id, "milk")]
    second = await complete(model, loop, [READ_FILE])
    await model.aclose()

    assert second.text == "You need milk."  # the server refuses a thinking block whose signature it did not send
    replayed = anthropic_server.requests[1]
    assert replayed["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assistant, results = replayed["messages"][1], replayed["messages"][2]
    assert assistant["content"][0] == {"type": "thinking", "thinking": "The user wants the list; read it.",
                                       "signature": signature("The user wants the list; read it.")}
    assert assistant["content"][1]["type"] == "tool_use" and assistant["content"][1]["input"] == {"path": "todo.md"}
    assert results == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": first.tool_calls[0].id, "content": "milk"}]}


async def test_a_resumed_tool_loop_without_its_thinking_blocks_goes_without_thinking(
        anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(Turn(text="Done."))
    call = ToolCall(id="toolu_old", name="read_file", arguments='{"path": "a"}')
    resumed = [*HELLO, Message.assistant("", tool_calls=(call,)), Message.tool_result("toolu_old", "text of a")]

    reply = await complete(client(anthropic_server, thinking_budget=2048), resumed, [READ_FILE])

    assert reply.text == "Done." and "thinking" not in anthropic_server.requests[0]


async def test_redacted_thinking_is_kept_for_the_loop(anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(Turn(redacted_thinking="opaque-bytes", tool_calls=(tool_call("read_file", path="b"),)))
    reply = await complete(client(anthropic_server, thinking_budget=2048), HELLO, [READ_FILE])

    assert reply.reasoning is None
    assert json.loads(reply.reasoning_blocks or "[]") == [{"type": "redacted_thinking", "data": "opaque-bytes"}]


@pytest.mark.parametrize(("turn", "kind"), [
    (Turn(status=529, error_type="overloaded_error", error_message="Overloaded"), ModelUnavailable),
    (Turn(status=500, error_type="api_error"), ModelUnavailable),
    (Turn(status=429, error_type="rate_limit_error", retry_after="3"), ModelRateLimited),
    (Turn(status=400, error_type="invalid_request_error", error_message="prompt is too long: 210000 tokens > 200000"),
     ContextTooLong),
    (Turn(status=400, error_type="invalid_request_error", error_message="messages: bad"), ModelBadRequest),
    (Turn(status=401, error_type="authentication_error", error_message="invalid x-api-key"), ModelBadRequest),
])
async def test_api_errors_become_their_kinds(anthropic_server: AnthropicServer, turn: Turn, kind: type) -> None:
    anthropic_server.push(turn)
    with pytest.raises(kind) as raised:
        await complete(client(anthropic_server), HELLO)
    assert turn.error_message in str(raised.value)
    if isinstance(raised.value, ModelRateLimited):
        assert raised.value.retry_after_s == 3.0


async def test_an_overloaded_api_is_retried_before_the_stream_starts(anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(Turn(status=529, error_type="overloaded_error"), Turn(text="Back."))
    reply = await complete(client(anthropic_server, max_attempts=2), HELLO)
    assert reply.text == "Back." and len(anthropic_server.requests) == 2


async def test_an_error_event_after_text_is_a_broken_stream_and_before_any_is_unavailable(
        anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(Turn(text="Partial answer that goes on", stream_error="overloaded_error",
                               error_after_text=10))
    events: list[ModelEvent] = []
    with pytest.raises(StreamBroken):
        async for event in client(anthropic_server).stream(HELLO):
            events.append(event)
    assert events and all(isinstance(e, TextDelta) for e in events)

    anthropic_server.push(Turn(text="never shown", stream_error="overloaded_error", error_after_text=0))
    with pytest.raises(ModelUnavailable):  # nothing was shown: a fallback model may answer
        await complete(client(anthropic_server), HELLO)


async def test_stop_reasons_truncated_refused_and_paused(anthropic_server: AnthropicServer) -> None:
    anthropic_server.push(Turn(text="The first half of", stop_reason="max_tokens"))
    assert (await complete(client(anthropic_server), HELLO)).truncated

    anthropic_server.push(Turn(text="I can't", stop_reason="refusal"))
    with pytest.raises(ModelRefused):
        await complete(client(anthropic_server), HELLO)

    anthropic_server.push(Turn(text="Searching... ", stop_reason="pause_turn"), Turn(text="found it."))
    reply = await complete(client(anthropic_server), HELLO)
    assert reply.text == "Searching... found it."
    continued = anthropic_server.requests[-1]["messages"]
    assert continued[-1] == {"role": "assistant", "content": [{"type": "text", "text": "Searching... "}]}


async def test_list_models_reads_the_endpoint(anthropic_server: AnthropicServer) -> None:
    model = client(anthropic_server)
    try:
        assert await model.list_models() == [MODEL]
    finally:
        await model.aclose()


def test_ember_chat_runs_a_tool_loop_with_thinking_on_claude(tmp_path: Path,
                                                               anthropic_server: AnthropicServer) -> None:
    env = ember_env(tmp_path, None, EMBER_MODEL=f"anthropic:{MODEL}", EMBER_MODEL_BASE_URL=anthropic_server.base_url,
                    ANTHROPIC_API_KEY="sk-ant-e2e-secret", EMBER_MODEL_THINKING_BUDGET="2048")
    (tmp_path / "workspace").mkdir()
    (tmp_path / "workspace" / "todo.txt").write_text("water the plants\n")
    anthropic_server.push(
        Turn(thinking="Read the list first.", text="Checking.", tool_calls=(tool_call("read_file", path="todo.txt"),)),
        Turn(thinking="It says plants.", text="You need to water the plants."))

    done = chat(env, "what is on my list?", "claude")

    assert done.returncode == 0, done.stderr
    assert "You need to water the plants." in done.stdout and "Read the list first." not in done.stdout
    first, second = anthropic_server.requests
    assert first["model"] == MODEL and first["thinking"]["budget_tokens"] == 2048
    assistant, results = second["messages"][-2], second["messages"][-1]
    assert [block["type"] for block in assistant["content"]] == ["thinking", "text", "tool_use"]
    assert "water the plants" in results["content"][0]["content"]
    assert [m["role"] for m in stored(env, "claude")] == ["user", "assistant", "tool", "assistant"]
    checked = ember(env, "models", "--check", "--json")
    assert json.loads(checked.stdout)[0]["state"] == "up" and json.loads(checked.stdout)[0]["provider"] == "anthropic"
    for output in (done, checked, ember(env, "trace", "list")):
        assert "sk-ant-e2e-secret" not in output.stdout + output.stderr
