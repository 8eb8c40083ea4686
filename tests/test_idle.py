"""An idle Ember makes no model call (issue 31): background work is queued only by new data (a
turn's commit), so once a busy session's work has drained no job is left, now or due later, and
the runner, looking again, finds nothing to do. Counted, not timed: no clock has to run for an hour."""

from __future__ import annotations

from ember.config.settings import Settings
from ember.core.messages import Message, ToolCall
from ember.core.tools import ToolSpec
from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel


def busy(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
    """Turns that call tools (so reviews follow), summaries for consolidation, and plain answers."""
    if SUMMARY_INSTRUCTION in messages[0].content:
        return ModelReply(text="They talked about their garden.")
    if messages[-1].role.value == "user" and "remember" in messages[-1].content:
        calls = tuple(ToolCall(id=f"r{n}", name="memory_search", arguments='{"query": "garden"}') for n in range(3))
        return ModelReply(tool_calls=calls)
    return ModelReply(text="Noted.")


async def test_after_its_work_drains_an_idle_ember_calls_no_model(start, settings: Settings) -> None:
    model = FunctionModel(busy)
    config = settings.model_copy(update={"consolidation_threshold": 4, "consolidation_keep_recent": 0})
    async with start(model, config=config) as h:
        for n in range(6):
            await h.turn(f"remember the garden, note {n}" if n % 2 else f"tell me about note {n}")
        await h.runtime.runner.wait_idle()
        busy_calls = len(model.requests)
        left = await h.runtime.jobs.counts()  # pending counts jobs due later too
        h.runtime.runner.wake()  # what its next poll would do, now
        await h.runtime.runner.wait_idle()
        idle_calls = len(model.requests) - busy_calls

    assert busy_calls > 6  # the turns, and the consolidation and reviews they queued
    assert left.get("pending", 0) == 0 and left.get("running", 0) == 0
    assert idle_calls == 0
