"""`[model_roles] simple`: a cheap chain answers simple turns (a short message, a small prompt), a
turn that needs a tool goes on to the main chain, and the trace says which and why."""

from __future__ import annotations

import json

from ember.app.models import configured_simple_model
from ember.app.runtime import build_runtime
from ember.config.settings import Settings
from ember.core.messages import Message, ToolCall
from ember.core.tools import ToolSpec
from ember.models.base import ModelReply
from ember.models.router import ModelRouter
from ember.models.scripted import FunctionModel
from ember.models.spec import ModelSpec
from ember.pipeline.inference import SIMPLE_MAX_MESSAGE_CHARS
from ember.tools.base import ToolRegistry
from tests.conftest import note_tool, running_harness


def answering(said: str) -> FunctionModel:
    return FunctionModel(lambda messages, tools: ModelReply(text=said, input_tokens=10, output_tokens=2),
                         name=f"{said}-model")


def noting(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
    if messages[-1].role.value == "user":
        return ModelReply(tool_calls=(ToolCall(id="n1", name="note", arguments=json.dumps({"text": "tea"})),))
    return ModelReply(text="Noted.")


async def routing_of(h, final) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    await h.runtime.traces.flush()
    trace = await h.runtime.traces.get(final.turn_id)
    return trace.detail["routing"]


async def test_a_short_turn_goes_to_the_simple_chain_and_a_long_one_to_main(settings: Settings) -> None:
    main, simple = answering("main"), answering("simple")
    runtime = await build_runtime(settings, main, tools=ToolRegistry(), simple_model=simple)
    async with running_harness(runtime) as h:
        short = await h.turn("hi there", stream=True)
        long = await h.turn("please think about this: " + "words " * SIMPLE_MAX_MESSAGE_CHARS)
        short_routing, long_routing = await routing_of(h, short), await routing_of(h, long)
        streamed = "".join(event.text for event in h.chats["c1"].events if event.turn_id == short.turn_id)

    assert short.text == "simple" and long.text == "main"
    assert len(simple.requests) == 1 and len(main.requests) == 1
    assert [step["chain"] for step in short_routing] == ["simple"]
    assert [step["chain"] for step in long_routing] == ["main"] and "message of" in long_routing[0]["why"]
    assert "simple" in streamed  # held until known to call no tool, then shown whole


async def test_a_turn_the_simple_chain_would_take_to_a_tool_goes_to_main(settings: Settings) -> None:
    noted: list[str] = []
    main = FunctionModel(noting, name="main-model")
    simple = FunctionModel(noting, name="simple-model")
    runtime = await build_runtime(settings, main, tools=ToolRegistry([note_tool(noted)]), simple_model=simple)
    async with running_harness(runtime) as h:
        final = await h.turn("note tea")
        routing = await routing_of(h, final)
        session = await h.runtime.sessions.load("test:c1")

    assert final.text == "Noted." and noted == ["tea"]  # the tool ran once: main's call, not the simple one's
    assert len(simple.requests) == 1 and len(main.requests) == 2
    assert [step["chain"] for step in routing] == ["simple", "main"]
    assert routing[1]["why"] == "the simple chain asked for a tool"
    assert [m.role.value for m in session.messages] == ["user", "assistant", "tool", "assistant"]


def test_the_simple_chain_is_off_unless_model_roles_names_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    models = {"big": ModelSpec(base_url="http://127.0.0.1:9/v1", model="big"),
              "small": ModelSpec(base_url="http://127.0.0.1:9/v1", model="small")}
    off = Settings(home=tmp_path, models=models)
    on = Settings(home=tmp_path, models=models, model_roles={"main": ["big"], "simple": ["small"]})
    assert configured_simple_model(off) is None
    chosen = configured_simple_model(on)
    assert isinstance(chosen, ModelRouter) and chosen.role == "simple"
    assert [route.model.name for route in chosen.routes] == ["small"]
