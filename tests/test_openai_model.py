"""OpenAICompatibleModel over real HTTP, against the tests' own model server."""

from __future__ import annotations

import socket

import pytest
from tenacity import RetryCallState

from ember.core.errors import (
    ContextTooLong,
    ModelBadRequest,
    ModelError,
    ModelRateLimited,
    ModelRefused,
    ModelUnavailable,
    StreamBroken,
)
from ember.core.messages import Message, ToolCall
from ember.core.tools import ToolSpec
from ember.models.base import ModelEvent, ModelReply, ReasoningDelta, TextDelta, complete
from ember.models.openai_compat import OpenAICompatibleModel
from ember.models.retry import MAX_RETRY_AFTER_S, _Backoff
from tests.modelserver import MODEL, ModelServer, Reply, tool_call

HELLO = [Message.user("hello")]
READ_FILE = ToolSpec(
    name="read_file",
    description="Read a file.",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
)


def client(base_url: str, *, max_attempts: int = 4) -> OpenAICompatibleModel:
    return OpenAICompatibleModel(model=MODEL, base_url=base_url, api_key="test-key", timeout_s=10,
                                 max_attempts=max_attempts)


async def events_of(model: OpenAICompatibleModel, messages: list[Message] = HELLO,
                    tools: list[ToolSpec] | None = None) -> list[ModelEvent]:
    return [event async for event in model.stream(messages, tools or [])]


async def test_streamed_text_arrives_in_deltas_then_one_reply(model_server: ModelServer) -> None:
    model_server.push(Reply(text="The answer is forty-two."))

    events = await events_of(client(model_server.base_url))

    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 1
    assert "".join(deltas) == "The answer is forty-two."
    assert [type(e) for e in events].count(ModelReply) == 1
    reply = events[-1]
    assert isinstance(reply, ModelReply)
    assert reply.text == "The answer is forty-two."
    assert reply.tool_calls == ()
    # The usage chunk at the end of the stream is read.
    assert reply.input_tokens > 0 and reply.output_tokens > 0


async def test_tool_call_fragments_are_reassembled(model_server: ModelServer) -> None:
    arguments = '{"path": "notes/today.txt", "start_line": 3}'
    model_server.push(Reply(tool_calls=(("read_file", arguments), tool_call("list_dir", path="."))))

    reply = await complete(client(model_server.base_url), HELLO, [READ_FILE])

    assert reply.tool_calls == (
        ToolCall(id="call_1_0", name="read_file", arguments=arguments),
        ToolCall(id="call_1_1", name="list_dir", arguments='{"path": "."}'),
    )
    assert reply.text == ""


async def test_reasoning_content_is_kept_apart_from_the_text(model_server: ModelServer) -> None:
    model_server.push(Reply(reasoning="The user greets; greet back.", text="Hi there!"))

    events = await events_of(client(model_server.base_url))

    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert reasoning == "The user greets; greet back."
    assert text == "Hi there!"
    reply = events[-1]
    assert isinstance(reply, ModelReply)
    assert (reply.text, reply.reasoning) == ("Hi there!", "The user greets; greet back.")


async def test_overload_and_rate_limit_are_retried(model_server: ModelServer) -> None:
    model_server.push(Reply(status=503), Reply(status=429), Reply(text="made it"))

    reply = await complete(client(model_server.base_url, max_attempts=4), HELLO)

    assert reply.text == "made it"
    assert len(model_server.requests) == 3


async def test_bad_request_is_not_retried(model_server: ModelServer) -> None:
    model_server.push(Reply(status=400), Reply(text="a retry would get this"))

    with pytest.raises(ModelBadRequest, match="HTTP 400"):
        await complete(client(model_server.base_url), HELLO)

    assert len(model_server.requests) == 1


@pytest.mark.parametrize(("reply", "kind"), [
    (Reply(status=400, error_code="context_length_exceeded",
           error_message="This model's maximum context length is 8192 tokens."), ContextTooLong),
    (Reply(status=400, error_message="prompt is too long: 210000 tokens > 200000 maximum"), ContextTooLong),
    (Reply(status=400, error_code="content_filter", error_message="The response was filtered."), ModelRefused),
    (Reply(status=422, error_message="messages: field required"), ModelBadRequest),
    (Reply(status=404, error_message="The model does not exist."), ModelBadRequest),
], ids=["context code", "context message", "content filter", "invalid", "unknown model"])
async def test_a_failure_no_retry_can_fix_is_its_own_kind_and_tried_once(model_server: ModelServer, reply: Reply,
                                                                         kind: type[ModelError]) -> None:
    model_server.push(reply, Reply(text="a retry would get this"))

    with pytest.raises(kind) as failure:
        await complete(client(model_server.base_url), HELLO)

    assert not isinstance(failure.value, ModelUnavailable)  # a fallback model would not help either
    assert len(model_server.requests) == 1


async def test_a_rate_limit_says_how_long_the_endpoint_asked_to_wait(model_server: ModelServer) -> None:
    model_server.push(Reply(status=429, retry_after="7"))

    with pytest.raises(ModelRateLimited) as failure:
        await complete(client(model_server.base_url, max_attempts=1), HELLO)

    assert failure.value.retry_after_s == 7.0 and isinstance(failure.value, ModelUnavailable)


def test_the_backoff_waits_at_least_what_a_rate_limit_asks_within_a_cap() -> None:
    def wait_after(error: BaseException) -> float:
        state = RetryCallState(None, None, (), {})
        state.set_exception((type(error), error, None))
        return _Backoff()(state)

    assert wait_after(ModelRateLimited("429", retry_after_s=5)) >= 5
    assert wait_after(ModelRateLimited("429", retry_after_s=3600)) == MAX_RETRY_AFTER_S
    assert wait_after(ModelUnavailable("503")) <= 0.25 + 1.0  # the first backoff step and its jitter


async def test_persistent_overload_reports_the_attempts(model_server: ModelServer) -> None:
    model_server.push(*[Reply(status=503)] * 3)

    with pytest.raises(ModelUnavailable, match="after 3 attempts") as failure:
        await complete(client(model_server.base_url, max_attempts=3), HELLO)

    assert "HTTP 503" in str(failure.value)
    assert len(model_server.requests) == 3


async def test_stream_cut_midway_fails_without_retry(model_server: ModelServer) -> None:
    model_server.push(Reply(text="This answer never finishes streaming.", cut_after_chunks=3),
                      Reply(text="a retry would duplicate the streamed text"))
    seen: list[ModelEvent] = []

    with pytest.raises(StreamBroken, match="broke off"):
        async for event in client(model_server.base_url).stream(HELLO):
            seen.append(event)

    assert any(isinstance(e, TextDelta) for e in seen)
    assert not any(isinstance(e, ModelReply) for e in seen)
    assert len(model_server.requests) == 1


@pytest.mark.parametrize("event", [
    'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "ok"\n\n',  # truncated JSON
    'data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": "nope"}\n\n',
    'data: {"error": {"message": "upstream overloaded", "type": "server_error"}}\n\n',
])
async def test_a_stream_that_breaks_the_protocol_is_a_model_error(model_server: ModelServer, event: str) -> None:
    model_server.push(Reply(raw_events=(event, "data: [DONE]\n\n")))

    with pytest.raises(ModelError):
        async for _ in client(model_server.base_url).stream(HELLO):
            pass


async def test_usage_without_counts_is_not_an_error(model_server: ModelServer) -> None:
    chunk = ('data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", '
             '"choices": [{"index": 0, "delta": {"content": "fine"}}]}\n\n')
    usage = ('data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [], '
             '"usage": {"prompt_tokens": null, "completion_tokens": null, "total_tokens": null}}\n\n')
    model_server.push(Reply(raw_events=(chunk, usage, "data: [DONE]\n\n")))

    reply = await complete(client(model_server.base_url), HELLO)

    assert (reply.text, reply.input_tokens, reply.output_tokens) == ("fine", 0, 0)


async def test_unreachable_endpoint_raises_model_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The port is closed now: connections are refused.

    with pytest.raises(ModelUnavailable, match="could not connect"):
        await complete(client(f"http://127.0.0.1:{port}/v1", max_attempts=2), HELLO)


async def test_request_carries_history_and_tools_in_openai_format(model_server: ModelServer) -> None:
    call = ToolCall(id="call_a", name="read_file", arguments='{"path": "a.txt"}')
    history = [
        Message.system("Be brief."),
        Message.user("What is in a.txt?"),
        Message.assistant("Let me look.", tool_calls=(call,)),
        Message.tool_result("call_a", "apples"),
    ]
    model_server.push(Reply(text="It lists apples."))

    await complete(client(model_server.base_url), history, [READ_FILE])

    [body] = model_server.requests
    assert body["model"] == MODEL
    assert body["stream"] is True
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is in a.txt?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "call_a", "type": "function",
                         "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "apples"},
    ]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file.", "parameters": READ_FILE.parameters}}]


async def test_list_models_reads_the_endpoint(model_server: ModelServer) -> None:
    assert await client(model_server.base_url).list_models() == [MODEL]


async def test_an_unscripted_call_fails_loudly(model_server: ModelServer) -> None:
    with pytest.raises(ModelError, match="no scripted reply left"):
        await complete(client(model_server.base_url, max_attempts=1), HELLO)
