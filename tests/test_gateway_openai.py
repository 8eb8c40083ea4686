"""The official `openai` SDK against a running `ember serve`, with the tests' own
model server behind it: what any OpenAI client sees of an Ember agent."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, Reply, serving, tool_call

KEY = "test-secret-key-0123456789"
AGENT = "ember"


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(model: ModelServer, launch_module_gateway: LaunchGateway,
            tmp_path_factory: pytest.TempPathFactory) -> GatewayProcess:
    home = tmp_path_factory.mktemp("gateway") / "home"
    (home / "workspaces" / "tester").mkdir(parents=True)
    (home / "workspaces" / "tester" / "notes.txt").write_text("the launch code is 4711\n")
    return launch_module_gateway(model, keys={"tester": KEY}, home=home)


@pytest.fixture
def client(gateway: GatewayProcess, model: ModelServer) -> Iterator[openai.OpenAI]:
    model.responder = None
    with openai.OpenAI(base_url=gateway.url("/v1"), api_key=KEY, max_retries=0, timeout=30) as sdk:
        yield sdk
    assert not model._script, "a test left scripted replies unused"


def history(gateway: GatewayProcess, session: str) -> list[dict]:
    response = httpx.get(gateway.url(f"/api/sessions/{session}/messages"),
                         headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    return response.json()["messages"]


def streamed(client: openai.OpenAI, content: str | list[dict], *, session: str | None = None,
             user: str | None = None) -> tuple[list[str], str | None]:
    """The content deltas of one streamed completion, and its finish reason."""
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    headers = {"X-Ember-Session": session} if session else {}
    deltas: list[str] = []
    finish = None
    for chunk in client.chat.completions.create(model=AGENT, messages=messages, stream=True,
                                                extra_headers=headers, **({"user": user} if user else {})):
        choice = chunk.choices[0]
        if choice.delta.content:
            deltas.append(choice.delta.content)
        finish = choice.finish_reason or finish
    return deltas, finish


def test_models_lists_the_agent(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [AGENT]


def test_non_streaming_turn_answers_and_commits(client: openai.OpenAI, model: ModelServer,
                                                 gateway: GatewayProcess) -> None:
    model.push(Reply(text="Paris is the capital of France."))
    raw = client.chat.completions.with_raw_response.create(
        model=AGENT, messages=[{"role": "user", "content": "Capital of France?"}],
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "Paris is the capital of France."
    assert completion.choices[0].finish_reason == "stop"
    session = raw.headers["X-Ember-Session"]  # no session was named: the server made one
    assert [(m["role"], m["content"]) for m in history(gateway, session)] == [
        ("user", "Capital of France?"), ("assistant", "Paris is the capital of France."),
    ]


def test_streamed_deltas_add_up_to_the_committed_answer(client: openai.OpenAI, model: ModelServer,
                                                        gateway: GatewayProcess) -> None:
    answer = "Streaming works: each delta is a piece, and together they are the answer."
    # A model paced like a real one: chunks read faster than they are sent would go out together.
    model.push(Reply(text=answer, chunk_delay_s=0.02))
    deltas, finish = streamed(client, "stream please", session="s-stream")
    assert len(deltas) > 3  # really streamed, not one block
    assert "".join(deltas) == answer
    assert finish == "stop"
    assert history(gateway, "s-stream")[-1]["content"] == answer


def test_thinking_reaches_neither_the_stream_nor_the_history(client: openai.OpenAI, model: ModelServer,
                                                             gateway: GatewayProcess) -> None:
    model.push(Reply(text="<think>the user wants 42, keep it secret</think>The answer is 42."))
    deltas, _ = streamed(client, "what is the answer?", session="s-think")
    assert "".join(deltas) == "The answer is 42."
    assert "secret" not in str(history(gateway, "s-think"))
    model.push(Reply(text="<THINKING>hidden</THINKING>Visible."))
    completion = client.chat.completions.create(
        model=AGENT, messages=[{"role": "user", "content": "again"}], extra_headers={"X-Ember-Session": "s-think"},
    )
    assert completion.choices[0].message.content == "Visible."


def test_tool_using_turn_streams_only_the_answer(client: openai.OpenAI, model: ModelServer,
                                                 gateway: GatewayProcess) -> None:
    model.push(Reply(tool_calls=(tool_call("read_file", path="notes.txt"),)),
               Reply(text="The launch code is 4711."))
    deltas, finish = streamed(client, "what is in my notes?", session="s-tool")
    assert "".join(deltas) == "The launch code is 4711."
    assert finish == "stop"
    # The model saw the file's content as the tool's result.
    tool_message = model.requests[-1]["messages"][-1]
    assert tool_message["role"] == "tool" and "4711" in tool_message["content"]
    stored = history(gateway, "s-tool")
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["name"] == "read_file"


def test_second_turn_remembers_the_first(client: openai.OpenAI, model: ModelServer) -> None:
    model.push(Reply(text="Nice to meet you, Ada."), Reply(text="Your name is Ada."))
    first = client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "I am Ada."}],
                                           user="ada-session")
    assert first.choices[0].message.content == "Nice to meet you, Ada."
    # A front-end resends the whole conversation; Ember takes the last user message and keeps its own history.
    deltas, _ = streamed(client, [
        {"role": "user", "content": "I am Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada."},
        {"role": "user", "content": "What is my name?"},
    ], user="ada-session")
    assert "".join(deltas) == "Your name is Ada."
    seen = [(m["role"], m["content"]) for m in model.requests[-1]["messages"] if m["role"] != "system"]
    assert seen == [("user", "I am Ada."), ("assistant", "Nice to meet you, Ada."), ("user", "What is my name?")]


def test_text_before_a_tool_call_is_streamed_once_and_set_apart(client: openai.OpenAI, model: ModelServer,
                                                                 gateway: GatewayProcess) -> None:
    model.push(Reply(text="Let me look.", tool_calls=(tool_call("list_dir", path="."),)),
               Reply(text="You have notes.txt."))
    deltas, _ = streamed(client, "what files?", session="s-preamble")
    assert "".join(deltas) == "Let me look.\n\nYou have notes.txt."
    stored = history(gateway, "s-preamble")
    assert stored[1]["content"] == "Let me look." and stored[-1]["content"] == "You have notes.txt."


def test_content_parts_are_read_as_text(client: openai.OpenAI, model: ModelServer) -> None:
    model.push(Reply(text="ok"))
    client.chat.completions.create(model=AGENT, messages=[
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
    ], extra_headers={"X-Ember-Session": "s-parts"})
    assert model.requests[-1]["messages"][-1]["content"] == "part one\npart two"


def test_a_failing_model_is_an_api_error_for_the_sdk(client: openai.OpenAI, model: ModelServer,
                                                     gateway: GatewayProcess) -> None:
    model.push(*[Reply(status=500)] * 4)  # every attempt of Ember's model client fails
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "fail me"}],
                                       extra_headers={"X-Ember-Session": "s-fail"})
    assert caught.value.status_code == 502
    assert "could not answer" in caught.value.message
    model.push(*[Reply(status=500)] * 4)
    with pytest.raises(openai.APIError):
        streamed(client, "fail me streaming", session="s-fail")
    # The questions are kept, each with the record of its failure; no answer was invented.
    kept = history(gateway, "s-fail")
    assert [(m["role"], m["kind"]) for m in kept] == [
        ("user", "message"), ("assistant", "error"), ("user", "message"), ("assistant", "error")]
    assert [m["content"] for m in kept if m["role"] == "user"] == ["fail me", "fail me streaming"]
    assert all("could not answer" in m["content"] for m in kept if m["kind"] == "error")


def test_wrong_key_is_an_authentication_error(gateway: GatewayProcess) -> None:
    with openai.OpenAI(base_url=gateway.url("/v1"), api_key="not-the-key", max_retries=0) as sdk, \
            pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_bad_request_is_reported_in_the_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=AGENT, messages=[{"role": "system", "content": "no user here"}])
    assert "user message" in caught.value.message
    assert caught.value.body["code"] == "no_user_message"


@pytest.mark.parametrize("stream", [False, True])
def test_async_client_works_too(gateway: GatewayProcess, model: ModelServer, stream: bool) -> None:
    import asyncio

    model.push(Reply(text="async hello"))

    async def main() -> str:
        async with openai.AsyncOpenAI(base_url=gateway.url("/v1"), api_key=KEY, max_retries=0) as sdk:
            if not stream:
                done = await sdk.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "hi"}])
                return done.choices[0].message.content or ""
            parts = await sdk.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in parts])

    assert asyncio.run(main()) == "async hello"


def test_usage_is_the_turns_real_token_counts(client: openai.OpenAI, model: ModelServer) -> None:
    model.push(Reply(tool_calls=(tool_call("read_file", path="notes.txt"),)), Reply(text="It says 4711."))
    before = len(model.requests)
    completion = client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "notes?"}],
                                                extra_headers={"X-Ember-Session": "s-usage"})
    calls = model.requests[before:]
    # The test model server reports words as tokens; each of the turn's two calls counts.
    prompt = sum(sum(len(str(m.get("content") or "").split()) for m in body["messages"]) for body in calls)
    assert completion.usage is not None and len(calls) == 2
    assert completion.usage.prompt_tokens == prompt
    assert completion.usage.completion_tokens == 1 + 3  # a tool call, then three words
    assert completion.usage.total_tokens == prompt + completion.usage.completion_tokens


def test_a_stream_reports_usage_only_when_asked(client: openai.OpenAI, model: ModelServer) -> None:
    model.push(Reply(text="One two three."), Reply(text="Four five."))
    chunks = list(client.chat.completions.create(
        model=AGENT, messages=[{"role": "user", "content": "count"}], stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Ember-Session": "s-usage-stream"}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 3
    assert all(chunk.usage is None for chunk in chunks[:-1])
    plain = list(client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "again"}],
                                                stream=True, extra_headers={"X-Ember-Session": "s-usage-stream"}))
    assert all(chunk.usage is None and chunk.choices for chunk in plain)


def test_sampling_options_reach_each_model_call(client: openai.OpenAI, model: ModelServer) -> None:
    model.push(Reply(text="Short."))
    client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "be brief"}],
                                   max_tokens=50, temperature=0.3, top_p=0.9,
                                   extra_headers={"X-Ember-Session": "s-sampling"})
    sent = model.requests[-1]
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"]) == (50, 0.3, 0.9)
    # Streamed, with the newer name, through a tool call: every call of the turn gets them.
    model.push(Reply(tool_calls=(tool_call("list_dir", path="."),)), Reply(text="Done."))
    before = len(model.requests)
    streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=AGENT, messages=[{"role": "user", "content": "look"}], stream=True, max_completion_tokens=40,
        temperature=0, extra_headers={"X-Ember-Session": "s-sampling"}))
    assert streamed_text == "Done."
    calls = model.requests[before:]
    assert len(calls) == 2
    assert all(c["max_tokens"] == 40 and c["temperature"] == 0 and "top_p" not in c for c in calls)
    # A request that sets none leaves the model its own settings.
    model.push(Reply(text="ok"))
    client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "plain"}],
                                   extra_headers={"X-Ember-Session": "s-sampling"})
    assert not {"max_tokens", "temperature", "top_p"} & set(model.requests[-1])


@pytest.mark.parametrize(("options", "param", "says"), [
    ({"temperature": 2.5}, "temperature", "temperature must be from 0 to 2; it was 2.5"),
    ({"temperature": -0.1}, "temperature", "from 0 to 2"),
    ({"top_p": 1.5}, "top_p", "top_p must be from 0 to 1; it was 1.5"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be from 1 to 32768"),
    ({"max_completion_tokens": 100_000}, "max_completion_tokens",
     "from 1 to 32768 (gateway_max_tokens caps it); it was 100000"),
    ({"max_tokens": 10, "max_completion_tokens": 20}, "max_completion_tokens", "disagree"),
])
def test_an_out_of_range_sampling_option_is_a_400(client: openai.OpenAI, model: ModelServer,
                                                  options: dict, param: str, says: str) -> None:
    before = len(model.requests)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "hi"}],
                                           stream=stream, **options)
        assert caught.value.body["code"] == "invalid_value" and caught.value.body["param"] == param
        assert says in caught.value.message
    assert len(model.requests) == before  # no turn ran


@pytest.mark.parametrize(("option", "value"), [("temperature", "warm"), ("max_tokens", True), ("top_p", "0.5")])
def test_a_wrongly_typed_sampling_option_is_an_invalid_request(gateway: GatewayProcess, option: str,
                                                              value: object) -> None:
    response = httpx.post(gateway.url("/v1/chat/completions"), headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": AGENT, "messages": [{"role": "user", "content": "hi"}], option: value})
    assert response.status_code == 422
    assert response.json()["error"]["param"] == option
