"""OpenTelemetry: the spans of a turn with a tool loop and of the consolidation it queued,
received by a real OTLP/HTTP collector of the tests' own, with their parents, links and
GenAI attributes, and no secret anywhere."""

from __future__ import annotations

import json

from ember.core.messages import Message, ToolCall
from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.models.spec import ModelSpec
from ember.runtime.telemetry import turn_span_context
from tests.conftest import session_key
from tests.otelcollector import collecting

SECRET = "sk-live-telemetry-0123456789abcdef"


def answer(messages: list[Message], tools: object) -> ModelReply:
    if SUMMARY_INSTRUCTION in messages[0].content:
        return ModelReply(text="They asked for the folder.", input_tokens=300, output_tokens=12, provider="openai")
    if messages[-1].role.value == "user":
        call = ToolCall(id="call-1", name="list_dir", arguments=json.dumps({"path": ".", "token": SECRET}))
        return ModelReply(tool_calls=(call,), input_tokens=100, output_tokens=10, provider="openai")
    return ModelReply(text="Your folder is empty.", input_tokens=150, output_tokens=8, provider="openai")


async def test_a_turn_and_its_background_job_reach_the_collector_as_linked_spans(start, settings) -> None:  # type: ignore[no-untyped-def]
    with collecting() as collector:
        config = settings.model_copy(update={
            "otel_endpoint": collector.endpoint, "consolidation_threshold": 4, "consolidation_keep_recent": 0,
            "models": {"traced": ModelSpec(base_url="http://127.0.0.1:9/v1", model="traced",
                                           api_key=SECRET, price_input_per_mtok=1.0, price_output_per_mtok=2.0)}})
        async with start(FunctionModel(answer, name="traced"), config=config) as h:
            final = await h.turn(f"list my folder, my key is {SECRET}")
            await h.runtime.runner.wait_idle()
            await h.runtime.traces.flush()
            journal = await h.runtime.traces.get(final.turn_id)
        # Leaving the runtime shut the exporter down: every span was sent.

    assert final.text == "Your folder is empty."
    [turn] = collector.named("turn")
    assert turn.parent_span_id == "" and turn.attributes["ember.session.key"] == session_key()
    assert turn.service == "ember"
    stages = {span.attributes["ember.stage"]: span for span in collector.spans if span.name.startswith("stage ")}
    assert set(stages) == {"context", "inference", "response"}
    assert all(span.parent_span_id == turn.span_id and span.trace_id == turn.trace_id for span in stages.values())

    inference = stages["inference"]
    chats = [span for span in collector.named("chat traced") if span.trace_id == turn.trace_id]
    assert len(chats) == 2 and all(span.parent_span_id == inference.span_id for span in chats)
    first = chats[0].attributes
    assert first["gen_ai.operation.name"] == "chat" and first["gen_ai.request.model"] == "traced"
    assert first["gen_ai.provider.name"] == "openai" and first["gen_ai.usage.output_tokens"] in (10, 8)
    assert {span.attributes["gen_ai.usage.input_tokens"] for span in chats} == {100, 150}
    assert {round(span.attributes["ember.cost.usd"], 9) for span in chats} == {
        round((100 * 1 + 10 * 2) / 1e6, 9), round((150 * 1 + 8 * 2) / 1e6, 9)}
    [tool] = collector.named("execute_tool list_dir")
    assert tool.parent_span_id == inference.span_id
    assert tool.attributes["gen_ai.tool.call.id"] == "call-1" and tool.attributes["gen_ai.operation.name"] == (
        "execute_tool")
    # The trace row's journal was told the same events as the spans.
    assert journal is not None
    assert [call["call_id"] for call in journal.detail["tool_calls"]] == ["call-1"]
    assert [call["input_tokens"] for call in journal.detail["model_calls"]] == [100, 150]

    [job] = collector.named("background_job consolidate")
    assert job.trace_id != turn.trace_id and job.links == [(turn.trace_id, turn.span_id)]
    expected = turn_span_context(turn.attributes["ember.turn.id"])
    assert (int(turn.trace_id, 16), int(turn.span_id, 16)) == (expected.trace_id, expected.span_id)
    [summary] = [span for span in collector.named("chat traced") if span.trace_id == job.trace_id]
    assert summary.parent_span_id == job.span_id and summary.attributes["gen_ai.usage.output_tokens"] == 12

    for span in collector.spans:
        shown = json.dumps([span.name, span.attributes, span.events], default=str)
        assert SECRET not in shown and "sk-live" not in shown, span.name


async def test_traces_are_off_without_an_endpoint(start, settings) -> None:  # type: ignore[no-untyped-def]
    async with start(FunctionModel(lambda m, t: ModelReply(text="hi"))) as h:
        await h.turn("hello")
        assert h.runtime.telemetry is None
