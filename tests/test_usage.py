"""Model usage and cost: counted per call, charged to the turn or the background job's
session and identity, summed by `ember usage`, refused past a daily budget."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from ember.cli.usage import since_timestamp
from ember.config.settings import Settings
from ember.core.events import InboundEvent
from ember.core.messages import Message, ToolCall
from ember.core.usage import Price, cost_usd
from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.models.spec import ModelSpec
from ember.pipeline.agent_spec import AgentSpec
from tests.conftest import IDENTITY, session_key
from tests.pgserver import RUNTIMES, engine_settings
from tests.test_cli_e2e import EMBER, TIMEOUT_S

PRICED = ModelSpec(base_url="http://127.0.0.1:9/v1", model="priced", price_input_per_mtok=2.0,
                   price_output_per_mtok=10.0)


@pytest.fixture(params=RUNTIMES)
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """The usage and trace stores on SQLite, on PostgreSQL, and on PostgreSQL with the Redis bus."""
    return engine_settings(settings, request.param, request)


def answer(messages: list[Message], tools: object) -> ModelReply:
    if SUMMARY_INSTRUCTION in messages[0].content:
        return ModelReply(text="The user asked about the weather.", input_tokens=1_000, output_tokens=50)
    if messages[-1].role.value == "user":
        return ModelReply(tool_calls=(ToolCall(id="c1", name="list_dir", arguments="{}"),), input_tokens=400,
                          output_tokens=20)
    return ModelReply(text="done", input_tokens=500, output_tokens=30)


def usage_json(settings, *args: str) -> list[dict]:  # type: ignore[no-untyped-def]
    env = {"EMBER_HOME": str(settings.home_dir), "PATH": "/usr/bin:/bin"}
    if settings.database_url is not None:
        env["EMBER_DATABASE_URL"] = settings.database_url.get_secret_value()
    done = subprocess.run([EMBER, "usage", "--json", *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_a_tool_loop_and_its_consolidation_are_counted_and_charged_to_the_session(start, settings) -> None:  # type: ignore[no-untyped-def]
    model = FunctionModel(answer, name="priced")
    config = settings.model_copy(update={"consolidation_threshold": 4, "consolidation_keep_recent": 0,
                                         "models": {"priced": PRICED}})
    async with start(model, config=config) as h:
        await h.turn("what is in my folder?")  # user, assistant + call, tool, assistant: 4 messages
        await h.runtime.runner.wait_idle()
        trace = (await h.runtime.traces.for_session(session_key()))[0]

    assert [(c["input_tokens"], c["output_tokens"]) for c in trace.detail["model_calls"]] == [(400, 20), (500, 30)]
    by_job = {row["key"]: row for row in usage_json(settings, "--by", "job")}
    assert by_job["turn"]["calls"] == 2 and by_job["turn"]["input_tokens"] == 900
    assert by_job["consolidate"]["calls"] == 1 and by_job["consolidate"]["output_tokens"] == 50
    assert by_job["turn"]["cost_usd"] == round((900 * 2 + 50 * 10) / 1e6, 6)
    assert by_job["consolidate"]["cost_usd"] == round((1_000 * 2 + 50 * 10) / 1e6, 6)
    [session] = usage_json(settings, "--by", "session")
    assert session["key"] == session_key() and session["calls"] == 3  # the job's cost is the session's
    [identity] = usage_json(settings, "--by", "identity")
    assert identity["key"] == IDENTITY and identity["unpriced_calls"] == 0
    assert usage_json(settings, "--since", "2099-01-01") == []


async def test_an_unpriced_model_counts_tokens_and_never_guesses_a_cost(start, settings) -> None:  # type: ignore[no-untyped-def]
    model = FunctionModel(lambda m, t: ModelReply(text="hi", input_tokens=10, output_tokens=2), name="free")
    async with start(model) as h:
        await h.turn("hello")
    [row] = usage_json(settings, "--by", "model")
    assert (row["key"], row["input_tokens"], row["cost_usd"], row["unpriced_calls"]) == ("free", 10, 0, 1)
    assert cost_usd(Price(1.0, 1.0), input_tokens=5, output_tokens=5, cache_read_tokens=3) is None  # no cache price


async def test_a_spent_daily_budget_refuses_the_turn_clearly(start, settings) -> None:  # type: ignore[no-untyped-def]
    expensive = FunctionModel(lambda m, t: ModelReply(text="costly", input_tokens=1_000_000, output_tokens=0),
                              name="priced")
    config = settings.model_copy(update={"models": {"priced": PRICED}, "budget_usd_per_day": {IDENTITY: 1.5}})
    async with start(expensive, config=config) as h:
        assert (await h.turn("first")).text == "costly"  # $2.00 spent: over the $1.50 budget now
        refused = await h.turn("second")
    assert "daily model budget" in refused.text and "$1.50" in refused.text and "$2.00" in refused.text
    assert len(expensive.requests) == 1


async def test_fifty_calls_at_once_never_spend_past_the_daily_budget(start, settings) -> None:  # type: ignore[no-untyped-def]
    """Each call reserves what it may cost before it is made: the day's total stays under the budget,
    however many calls a person has in flight."""
    async def slow(messages: list[Message], tools: object) -> ModelReply:
        await asyncio.sleep(0.05)  # every turn's call is in flight together
        return ModelReply(text="answered", input_tokens=1_000, output_tokens=100)  # $0.003 at PRICED

    budget = 0.1
    config = settings.model_copy(update={"models": {"priced": PRICED}, "budget_usd_per_day": {IDENTITY: budget}})
    async with start(FunctionModel(slow, name="priced"), config=config) as h:
        for n in range(50):
            await h.publish(f"question {n}", chat=f"c{n}")
        finals = [await h.next_closing(f"c{n}") for n in range(50)]
        await h.runtime.usage.flush()
        spent = await h.runtime.usage.store.spent(IDENTITY, 0.0)

    answered = [final for final in finals if final.text == "answered"]
    refused = [final for final in finals if "daily model budget" in final.text]
    assert len(answered) + len(refused) == 50 and answered and refused
    assert spent == pytest.approx(0.003 * len(answered)) and spent <= budget


async def test_an_agents_daily_budget_holds_whoever_its_turns_are_for(start, settings) -> None:  # type: ignore[no-untyped-def]
    async def slow(messages: list[Message], tools: object) -> ModelReply:
        await asyncio.sleep(0.05)
        return ModelReply(text="answered", input_tokens=1_000, output_tokens=100)  # $0.003 at PRICED

    budget = 0.05
    config = settings.model_copy(update={"models": {"priced": PRICED}, "agents": {
        "coder": AgentSpec(budget_usd_per_day=budget)}})
    async with start(FunctionModel(slow, name="priced"), config=config) as h:
        for n in range(30):  # thirty people at once, each asking the coder
            await h.runtime.bus.publish_inbound(InboundEvent(
                channel="test", chat_id=f"c{n}", sender_id=f"person{n}", text="code", message_id=f"m{n}",
                agent="coder"))
        finals = [await h.next_closing(f"c{n}") for n in range(30)]
        plain = await h.turn("and without the agent?", chat="plain")  # the default agent has no budget
        await h.runtime.usage.flush()
        by_agent = {row["key"]: row["cost_usd"] for row in await h.runtime.usage.store.totals("agent")}

    refused = [final for final in finals if "daily model budget for agent coder" in final.text]
    assert refused and len(refused) < 30 and plain.text == "answered"
    assert by_agent["coder"] <= budget and by_agent["coder"] == pytest.approx(0.003 * (30 - len(refused)))


def test_since_takes_spans_and_dates() -> None:
    assert since_timestamp("24h", now=100_000.0) == 100_000.0 - 86_400
    assert since_timestamp("2026-11-01") == 1_793_491_200.0
    assert since_timestamp(None) == 0.0
