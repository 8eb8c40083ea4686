"""Named agents (`[agents.NAME]`): each answers with its own system prompt, model chain, tools and
skills; a tool outside an agent's set is neither offered nor run; an agent with a memory of its
own keeps it apart from the person's; the gateway lets a client pick one."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from playwright.sync_api import Page, expect

from ember.config.settings import Settings
from ember.core.events import InboundEvent
from ember.core.messages import Message, Role, ToolCall
from ember.core.tools import ToolSpec
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.models.spec import ModelSpec
from ember.pipeline.agent_spec import AgentSpec
from ember.tools.base import ToolRegistry
from tests.browser import answer, box, needs_chromium, send, sign_in
from tests.conftest import CHANNEL, IDENTITY, SENDER, note_tool
from tests.gatewayproc import LaunchGateway
from tests.modelserver import ModelServer, Reply, serving
from tests.sse import events
from tests.test_cli_e2e import ember, ember_env

ALICE_KEY = "alice-secret-0123456789"
CODER = AgentSpec(system_prompt="You are Coder, who writes code.", models=["small"], tools=["note"])
WRITER = AgentSpec(system_prompt="You are Writer, who writes prose.", tools=[])


def agents_settings(settings: Settings, small: ModelServer, **agents: AgentSpec) -> Settings:
    return settings.model_copy(update={
        "models": {"small": ModelSpec(base_url=small.base_url, model="small")},
        "model_roles": {"main": ["small"]}, "agents": agents})


async def ask(h, text: str, *, chat: str, agent: str | None = None):  # type: ignore[no-untyped-def]
    await h.runtime.bus.publish_inbound(InboundEvent(channel=CHANNEL, chat_id=chat, sender_id=SENDER, text=text,
                                                     message_id=uuid.uuid4().hex, agent=agent))
    return await h.next_closing(chat)


def tools_offered(body: dict) -> list[str]:
    return [tool["function"]["name"] for tool in body.get("tools", [])]


async def test_each_agent_answers_with_its_own_prompt_model_and_tools(start, settings) -> None:  # type: ignore[no-untyped-def]
    main = FunctionModel(lambda messages, tools: ModelReply(text=f"main: {len(tools)} tools"), name="main")
    noted: list[str] = []
    registry = ToolRegistry([note_tool(noted), note_tool(noted, name="jot")])
    with serving() as small:
        small.push(Reply(text="code answer"), Reply(text="more code"))
        config = agents_settings(settings, small, coder=CODER, writer=WRITER)
        async with start(main, tools=registry, config=config) as h:
            coded = await ask(h, "write a script", chat="c", agent="coder")
            again = await ask(h, "and a test", chat="c")  # the session keeps its agent
            prose = await ask(h, "write a poem", chat="w", agent="writer")
            plain = await ask(h, "hello", chat="d")

    assert (coded.text, again.text) == ("code answer", "more code")
    first = small.requests[0]
    assert first["messages"][0]["content"].startswith("You are Coder, who writes code.")
    assert tools_offered(first) == ["note"] and tools_offered(small.requests[1]) == ["note"]
    assert prose.text == "main: 0 tools" and plain.text == "main: 2 tools"
    writer_prompt, default_prompt = main.requests[0][0].content, main.requests[1][0].content
    assert writer_prompt.startswith("You are Writer, who writes prose.")
    assert not default_prompt.startswith(("You are Writer", "You are Coder"))


async def test_a_tool_outside_an_agents_set_is_never_run(start, settings) -> None:  # type: ignore[no-untyped-def]
    def insisting(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        if messages[-1].role is Role.USER:  # asks for a tool it was not offered
            return ModelReply(tool_calls=(ToolCall(id="n1", name="note", arguments=json.dumps({"text": "x"})),))
        return ModelReply(text=messages[-1].content)

    noted: list[str] = []
    with serving() as small:
        config = agents_settings(settings, small, writer=WRITER)
        async with start(FunctionModel(insisting), tools=ToolRegistry([note_tool(noted)]), config=config) as h:
            final = await ask(h, "note x", chat="w", agent="writer")
    assert noted == []
    assert final.text == "Error: there is no tool named 'note' for agent writer. Available: none."


async def test_an_agent_with_its_own_memory_keeps_it_apart_from_the_persons(start, settings) -> None:  # type: ignore[no-untyped-def]
    diary = AgentSpec(system_prompt="You are Diary.", tools=["remember", "memory_search"], memory="own")

    def answering(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        asked = next(m.content for m in reversed(messages) if m.role is Role.USER)
        if messages[-1].role is not Role.USER:
            return ModelReply(text=messages[-1].content)  # the tool's result, as the answer
        if asked.startswith("remember "):
            return ModelReply(tool_calls=(ToolCall(id="r1", name="remember", arguments=json.dumps(
                {"content": asked.removeprefix("remember ")})),))
        if asked.startswith("search "):
            return ModelReply(tool_calls=(ToolCall(id="s1", name="memory_search", arguments=json.dumps(
                {"query": asked.removeprefix("search ")})),))
        return ModelReply(text="\n".join(m.content for m in messages if m.role is Role.SYSTEM))

    with serving() as small:
        config = agents_settings(settings, small, diary=diary)
        async with start(FunctionModel(answering), config=config) as h:
            await ask(h, "remember the hidden orchid greenhouse plan", chat="d1", agent="diary")
            await h.runtime.runner.wait_idle()  # its words are archived too, into the diary's memory
            person = await ask(h, "search orchid greenhouse", chat="p")
            person_prompt = await ask(h, "what do you know?", chat="p2")
            diary_found = await ask(h, "search orchid greenhouse", chat="d2", agent="diary")
            kept = [hit.record.content for hit in await h.runtime.memory.search(f"{IDENTITY}@diary", "orchid")]
            persons = [hit.record.content for hit in await h.runtime.memory.search(IDENTITY, "orchid")]

    assert "orchid" not in person.text and "orchid" not in person_prompt.text
    assert "hidden orchid greenhouse plan" in diary_found.text
    assert any("orchid" in content for content in kept) and persons == []


async def test_a_channel_or_one_chat_can_be_bound_to_an_agent(start, settings) -> None:  # type: ignore[no-untyped-def]
    main = FunctionModel(lambda messages, tools: ModelReply(text=messages[0].content.split(",")[0]), name="main")
    with serving() as small:
        small.push(Reply(text="coder here"), Reply(text="coder asked for"))
        config = agents_settings(settings, small, coder=CODER, writer=WRITER).model_copy(update={
            "channel_agents": {CHANNEL: "writer", f"{CHANNEL}:special": "coder"}})
        async with start(main, config=config) as h:
            by_channel = await ask(h, "hello", chat="any")
            by_chat = await ask(h, "hello", chat="special")
            asked_for = await ask(h, "hello", chat="any-other", agent="coder")
    assert by_channel.text == "You are Writer" and by_chat.text == "coder here"
    assert asked_for.text == "coder asked for"  # a message that names its agent overrides the binding


def test_an_agent_must_name_configured_models_and_a_plain_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"agents\.coder\.models names 'big', not under \[models\]"):
        Settings(home=tmp_path, agents={"coder": AgentSpec(models=["big"])})
    with pytest.raises(ValueError, match="an agent's name is lower-case"):
        Settings(home=tmp_path, agents={"My Agent": AgentSpec()})
    with pytest.raises(ValueError, match=r"channel_agents\.telegram names agent 'nobody', not under \[agents\]"):
        Settings(home=tmp_path, channel_agents={"telegram": "nobody"})


def test_the_gateway_lists_agents_and_a_client_picks_one(model_server: ModelServer,
                                                         launch_gateway: LaunchGateway) -> None:
    agents = json.dumps({"coder": {"system_prompt": "You are Coder."}, "diary": {"memory": "own"}})
    gateway = launch_gateway(model_server, keys={"alice": ALICE_KEY}, EMBER_AGENTS=agents)
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    listed = httpx.get(gateway.url("/v1/models"), headers=headers, timeout=10).json()
    assert [model["id"] for model in listed["data"]][1:] == ["coder", "diary"]

    model_server.push(Reply(text="from coder"))
    body = {"model": "coder", "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(gateway.url("/v1/chat/completions"), json=body, headers=headers, timeout=30).json()
    assert answer["choices"][0]["message"]["content"] == "from coder" and answer["model"] == "coder"
    assert model_server.requests[-1]["messages"][0]["content"].startswith("You are Coder.")

    refused = httpx.post(gateway.url("/api/sessions/s1/messages"), json={"text": "hi", "agent": "nobody"},
                         headers=headers, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unknown_agent"
    model_server.push(Reply(text="native coder"))
    with httpx.stream("POST", gateway.url("/api/sessions/s2/messages"), json={"text": "hi", "agent": "coder"},
                      headers=headers, timeout=30) as response:
        final = [event for event in events(response.iter_lines()) if event.name == "final"]
    assert final[0].json()["text"] == "native coder"

    # What an agent with a memory of its own keeps is the person's to see, with ?agent=.
    made = httpx.post(gateway.url("/api/memory"), params={"agent": "diary"}, json={"content": "Alice dreams of Oslo"},
                      headers=headers, timeout=10)
    assert made.status_code == 201, made.text
    theirs = httpx.get(gateway.url("/api/memory"), params={"agent": "diary"}, headers=headers, timeout=10).json()
    assert [record["content"] for record in theirs] == ["Alice dreams of Oslo"]
    own = httpx.get(gateway.url("/api/memory"), headers=headers, timeout=10).json()
    assert all("Oslo" not in record["content"] for record in own)
    shared = httpx.get(gateway.url("/api/memory"), params={"agent": "coder"}, headers=headers, timeout=10)
    assert shared.status_code == 400 and shared.json()["error"]["code"] == "unknown_agent"


def test_the_terminal_chat_asks_for_an_agent_and_agents_list_shows_them(model_server: ModelServer,
                                                                       tmp_path) -> None:  # type: ignore[no-untyped-def]
    agents = json.dumps({"writer": {"description": "writes poems", "system_prompt": "You are Writer.",
                                    "tools": [], "memory": "own"}})
    env = ember_env(tmp_path / "home", model_server, EMBER_AGENTS=agents)
    model_server.push(Reply(text="a poem"))
    done = ember(env, "chat", "--agent", "writer", "-m", "write a poem")
    assert done.returncode == 0 and done.stdout.strip() == "a poem", done.stderr
    asked = model_server.requests[-1]
    assert asked["messages"][0]["content"].startswith("You are Writer.") and "tools" not in asked

    unknown = ember(env, "chat", "--agent", "nobody", "-m", "hi")
    assert unknown.returncode == 2 and "there is no agent named 'nobody' (agents: writer)" in unknown.stderr
    listed = json.loads(ember(env, "agents", "list", "--json").stdout)
    assert listed == [{"name": "writer", "description": "writes poems", "models": [], "tools": [], "skills": None,
                       "memory": "own", "system_prompt": True}]
    assert "writer — writes poems" in ember(env, "agents", "list").stdout


@needs_chromium
def test_the_page_offers_the_agents_and_sends_the_one_picked(page: Page, model_server: ModelServer,
                                                             launch_gateway: LaunchGateway) -> None:
    agents = json.dumps({"coder": {"system_prompt": "You are Coder."}})
    gateway = launch_gateway(model_server, keys={"alice": ALICE_KEY}, EMBER_AGENTS=agents)
    page.set_viewport_size({"width": 390, "height": 800})  # a phone: the picker fits beside the box
    sign_in(page, gateway, ALICE_KEY)
    picker = page.locator("#agent-select")
    expect(picker).to_be_visible()
    expect(picker.locator("option")).to_have_text(["Default agent", "coder"])
    found = box(page, "#agent-select")
    assert found["x"] >= 0 and found["x"] + found["width"] <= 390, found
    picker.select_option("coder")
    model_server.push(Reply(text="Coder here."))
    send(page, "who are you?")
    expect(answer(page)).to_have_text("Coder here.")
    assert model_server.requests[-1]["messages"][0]["content"].startswith("You are Coder.")
