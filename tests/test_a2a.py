"""A2A against a real `ember serve`: the official `a2a-sdk` client (card, send, stream, get, list,
cancel, a tool turn, an approval in input-required) and an independent one (`@a2a-js/sdk`, from the
npm registry, driven by tests/a2a_js/client.mjs); another identity's task does not exist for a caller."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from a2a.client import A2AClientError, ClientConfig, create_client
from a2a.client.client import Client
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskState,
)
from a2a.utils.errors import TaskNotFoundError

from ember.config.settings import Settings
from ember.core.messages import Message as EmberMessage
from ember.core.messages import Role as EmberRole
from ember.core.messages import ToolCall
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.tools.a2a import A2AAgentSpec, a2a_tools
from ember.tools.base import ToolRegistry
from tests.conftest import serving_runtime
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, Reply, serving, tool_call

ALICE, BOB = "alice-a2a-key-0123456789", "bob-a2a-key-0123456789ab"
JS_DIR = Path(__file__).parent / "a2a_js"
POLICY = """
[tool_policy]
write = "ask"
timeout_s = 30
"""


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(model: ModelServer, launch_module_gateway: LaunchGateway,
            tmp_path_factory: pytest.TempPathFactory) -> GatewayProcess:
    home = tmp_path_factory.mktemp("a2a") / "home"
    home.mkdir()
    (home / "ember.toml").write_text(POLICY)
    return launch_module_gateway(model, keys={"alice": ALICE, "bob": BOB}, home=home)


@pytest.fixture
async def clients(gateway: GatewayProcess) -> AsyncIterator[dict[str, Client]]:
    made, http = {}, []
    for name, key, streaming in (("alice", ALICE, False), ("alice_stream", ALICE, True), ("bob", BOB, False)):
        transport = httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30)
        http.append(transport)
        made[name] = await create_client(gateway.base_url, ClientConfig(streaming=streaming, httpx_client=transport))
    yield made
    for client in made.values():
        await client.close()
    for transport in http:
        await transport.aclose()


def request(text: str, *, task: Task | None = None, message_id: str | None = None) -> SendMessageRequest:
    return SendMessageRequest(message=Message(
        role=Role.ROLE_USER, message_id=message_id or uuid.uuid4().hex, parts=[Part(text=text)],
        task_id=task.id if task else "", context_id=task.context_id if task else ""))


async def events(client: Client, req: SendMessageRequest) -> list[StreamResponse]:
    return [event async for event in client.send_message(req)]


def final_task(responses: list[StreamResponse]) -> Task:
    [last] = [r.task for r in responses if r.WhichOneof("payload") == "task"][-1:]
    return last


def answer(task: Task) -> str:
    return "".join(part.text for artifact in task.artifacts for part in artifact.parts)


async def test_the_card_names_the_endpoint_streaming_and_the_bearer_scheme(gateway: GatewayProcess) -> None:
    card = httpx.get(gateway.url("/.well-known/agent-card.json")).json()  # public: no key
    assert card["supportedInterfaces"][0]["url"] == gateway.url("/a2a")
    assert card["capabilities"]["streaming"] is True
    assert "bearer" in card["securitySchemes"]
    assert {"conversation", "tool-read_file", "tool-schedule_task"} <= {skill["id"] for skill in card["skills"]}
    refused = httpx.post(gateway.url("/a2a"), json={"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {}})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


async def test_send_get_and_list_are_one_turn_in_the_callers_own_session(
        clients: dict[str, Client], model: ModelServer) -> None:
    model.push(Reply(text="Hello over A2A."))
    task = final_task(await events(clients["alice"], request("hi from another agent")))
    assert task.status.state == TaskState.TASK_STATE_COMPLETED
    assert answer(task) == "Hello over A2A."
    assert model.requests[-1]["messages"][-1]["content"] == "hi from another agent"
    got = await clients["alice"].get_task(GetTaskRequest(id=task.id))
    assert got.status.state == TaskState.TASK_STATE_COMPLETED
    listed = await clients["alice"].list_tasks(ListTasksRequest())
    assert task.id in {t.id for t in listed.tasks}
    assert task.id not in {t.id for t in (await clients["bob"].list_tasks(ListTasksRequest())).tasks}
    with pytest.raises(TaskNotFoundError):
        await clients["bob"].get_task(GetTaskRequest(id=task.id))
    with pytest.raises(TaskNotFoundError):
        await clients["bob"].cancel_task(CancelTaskRequest(id=task.id))


async def test_a_second_message_in_the_context_continues_the_same_session(
        clients: dict[str, Client], model: ModelServer) -> None:
    model.push(Reply(text="Noted: blue."), Reply(text="It was blue."))
    first = final_task(await events(clients["alice"], request("my colour is blue")))
    follow = SendMessageRequest(message=Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex,
                                                parts=[Part(text="what was my colour?")],
                                                context_id=first.context_id))
    second = final_task(await events(clients["alice"], follow))
    assert answer(second) == "It was blue."
    seen = [m["content"] for m in model.requests[-1]["messages"] if m["role"] in ("user", "assistant")]
    assert seen[-3:] == ["my colour is blue", "Noted: blue.", "what was my colour?"]


async def test_a_streamed_answer_arrives_in_chunks_then_once_whole(clients: dict[str, Client],
                                                                  model: ModelServer) -> None:
    text = "A streamed answer in several small chunks."
    # A model paced like a real one: chunks read faster than they are sent would go out together.
    model.push(Reply(text=text, chunk_delay_s=0.02))
    responses = await events(clients["alice_stream"], request("stream it"))
    kinds = [r.WhichOneof("payload") for r in responses]
    assert kinds[0] == "task" and kinds.count("artifact_update") >= 3
    updates = [r.artifact_update for r in responses if r.WhichOneof("payload") == "artifact_update"]
    assert "".join(p.text for u in updates[:-1] for p in u.artifact.parts) == text  # the chunks
    assert (updates[-1].append, updates[-1].last_chunk) == (False, True)  # the whole, replacing them
    assert "".join(p.text for p in updates[-1].artifact.parts) == text
    states = [r.status_update.status.state for r in responses if r.WhichOneof("payload") == "status_update"]
    assert states[-1] == TaskState.TASK_STATE_COMPLETED


async def test_a_tool_turn_is_reported_as_working_and_answers(clients: dict[str, Client], model: ModelServer,
                                                              gateway: GatewayProcess) -> None:
    (gateway.home / "workspaces" / "alice").mkdir(parents=True, exist_ok=True)  # the caller's own
    (gateway.home / "workspaces" / "alice" / "a2a.txt").write_text("the launch code is 7")
    model.push(Reply(tool_calls=(tool_call("read_file", path="a2a.txt"),)), Reply(text="The code is 7."))
    responses = await events(clients["alice_stream"], request("read a2a.txt"))
    statuses = [r.status_update.status for r in responses if r.WhichOneof("payload") == "status_update"]
    working = [s.message for s in statuses if s.state == TaskState.TASK_STATE_WORKING]
    assert any("read_file" in part.text for message in working for part in message.parts)
    assert "the launch code is 7" in json.dumps(model.requests[-1]["messages"])
    updates = [r.artifact_update for r in responses if r.WhichOneof("payload") == "artifact_update"]
    assert "".join(p.text for p in updates[-1].artifact.parts) == "The code is 7."


@pytest.mark.parametrize(("reply", "written"), [("yes", True), ("no", False)])
async def test_an_approval_waits_in_input_required_and_the_next_message_answers_it(
        clients: dict[str, Client], model: ModelServer, gateway: GatewayProcess, reply: str, written: bool) -> None:
    name = f"approved-{uuid.uuid4().hex[:6]}.txt"
    model.push(Reply(tool_calls=(tool_call("write_file", path=name, content="ok"),)), Reply(text="Finished."))
    waiting = final_task(await events(clients["alice"], request(f"write {name}")))
    assert waiting.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    asked = " ".join(part.text for part in waiting.status.message.parts)
    assert name in asked and 'Reply "yes"' in asked
    with pytest.raises(TaskNotFoundError):  # bob cannot answer alice's approval
        await events(clients["bob"], request("yes", task=waiting))
    done = final_task(await events(clients["alice"], request(reply, task=waiting)))
    assert done.status.state == TaskState.TASK_STATE_COMPLETED and answer(done) == "Finished."
    assert (gateway.home / "workspaces" / "alice" / name).exists() is written
    tool_result = [m for m in model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"]
    assert ("not permitted" in tool_result) is not written


async def test_cancelling_a_task_that_waits_for_an_approval_denies_it(clients: dict[str, Client],
                                                                      model: ModelServer,
                                                                      gateway: GatewayProcess) -> None:
    name = f"cancelled-{uuid.uuid4().hex[:6]}.txt"
    model.push(Reply(tool_calls=(tool_call("write_file", path=name, content="no"),)), Reply(text="Stopped."))
    waiting = final_task(await events(clients["alice"], request(f"write {name}")))
    cancelled = await clients["alice"].cancel_task(CancelTaskRequest(id=waiting.id))
    assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
    for _ in range(200):  # the turn ends on its own once the approval is denied
        if model.requests and model.requests[-1]["messages"][-1]["role"] == "tool":
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the cancelled turn did not go on after its approval was denied")
    assert "not permitted" in model.requests[-1]["messages"][-1]["content"]
    assert not (gateway.home / "workspaces" / "alice" / name).exists()


async def test_a_resent_message_id_gets_the_recorded_answer_not_a_second_turn(clients: dict[str, Client],
                                                                              model: ModelServer) -> None:
    model.push(Reply(text="Only once."))
    message_id = uuid.uuid4().hex
    first = final_task(await events(clients["alice"], request("once please", message_id=message_id)))
    calls = len(model.requests)
    resent = SendMessageRequest(message=Message(role=Role.ROLE_USER, message_id=message_id, context_id=first.context_id,
                                                parts=[Part(text="once please")]))
    again = final_task(await events(clients["alice"], resent))
    assert answer(first) == answer(again) == "Only once." and len(model.requests) == calls


async def test_a_bad_key_is_refused_by_the_sdk_client(gateway: GatewayProcess) -> None:
    async with httpx.AsyncClient(headers={"Authorization": "Bearer not-a-key-at-all"}) as transport:
        client = await create_client(gateway.base_url, ClientConfig(streaming=False, httpx_client=transport))
        with pytest.raises(A2AClientError, match="401"):
            await events(client, request("let me in"))


def test_an_independent_javascript_client_sees_the_same(gateway: GatewayProcess, model: ModelServer) -> None:
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.fail("Node.js is needed for the independent A2A client (apt-get install nodejs npm)")
    if not (JS_DIR / "node_modules" / "@a2a-js" / "sdk").exists():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=JS_DIR, check=True, timeout=300,
                       capture_output=True)
    model.push(Reply(text="Hello, Node."), Reply(text="Streamed to Node."))
    done = subprocess.run([node, "client.mjs", gateway.base_url, ALICE, BOB], cwd=JS_DIR, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["card"] == {"name": "Ember", "streaming": True, "schemes": ["bearer"]}
    assert seen["send"] == {"state": "TASK_STATE_COMPLETED", "answer": ["Hello, Node."]}
    assert seen["stream"][0][0] == "task" and seen["stream"][-1][1] == "TASK_STATE_COMPLETED"
    assert [text for kind, _, text in seen["stream"] if kind == "artifactUpdate"][-1] == "Streamed to Node."
    assert seen["get"] == "TASK_STATE_COMPLETED"
    assert seen["other"] == "TaskNotFoundError"


# --- the call_agent tool: Ember as an A2A client of the gateway above -------------------------------

def calling(agent: str, message: str) -> FunctionModel:
    def reply(messages: list[EmberMessage], tools: object) -> ModelReply:
        if messages[-1].role is EmberRole.TOOL:
            return ModelReply(text=f"The peer said: {messages[-1].content}")
        return ModelReply(text="", tool_calls=(ToolCall(id="a1", name="call_agent", arguments=json.dumps(
            {"agent": agent, "message": message})),))

    return FunctionModel(reply)


async def test_call_agent_hands_the_message_over_and_records_the_answers_progress(
        settings: Settings, gateway: GatewayProcess, model: ModelServer) -> None:
    model.push(Reply(text="Four, streamed in pieces."))
    tools = ToolRegistry(a2a_tools({"peer": A2AAgentSpec(url=gateway.base_url, api_key=ALICE)},
                                   allowed_hosts=frozenset({"127.0.0.1"})))
    allowed = Settings(**{**settings.model_dump(), "tool_policy": {"network": "allow"}})
    async with serving_runtime(allowed, calling("peer", "what is 2+2?"), tools=tools) as h:
        final = await h.turn("ask the peer")
        trace = await h.runtime.traces.get(final.turn_id)
    assert final.text == "The peer said: peer answered: Four, streamed in pieces."
    assert model.requests[-1]["messages"][-1]["content"] == "what is 2+2?"
    assert trace is not None
    notes = [entry["note"] for entry in trace.detail["progress"]]
    assert "peer: TASK_STATE_COMPLETED" in notes and any(note.endswith("characters") for note in notes)
    assert ALICE not in json.dumps(trace.detail)


@pytest.mark.parametrize(("spec", "expected"), [
    (A2AAgentSpec(url="http://127.0.0.1:9"), "refused: 127.0.0.1 is a loopback address"),
    (A2AAgentSpec(url="http://peer.invalid"), "could not resolve"),
])
async def test_call_agent_refuses_private_addresses_and_reports_failures(settings: Settings, spec: A2AAgentSpec,
                                                                         expected: str) -> None:
    allowed = Settings(**{**settings.model_dump(), "tool_policy": {"network": "allow"}})
    async with serving_runtime(allowed, calling("peer", "hi"), tools=ToolRegistry(a2a_tools({"peer": spec}))) as h:
        final = await h.turn("ask the peer")
    assert final.text.startswith("The peer said: Error: ") and expected in final.text


async def test_a_task_is_still_there_after_a_restart(launch_gateway: LaunchGateway, model_server: ModelServer) -> None:
    first = launch_gateway(model_server, keys={"alice": ALICE})
    model_server.push(Reply(text="Kept across restarts."))
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ALICE}"}, timeout=30) as transport:
        client = await create_client(first.base_url, ClientConfig(streaming=False, httpx_client=transport))
        task = final_task(await events(client, request("remember this task")))
    assert first.stop() == 0
    again = launch_gateway(model_server, keys={"alice": ALICE}, port=first.port)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ALICE}"}, timeout=30) as transport:
        client = await create_client(again.base_url, ClientConfig(streaming=False, httpx_client=transport))
        kept = await client.get_task(GetTaskRequest(id=task.id))
        listed = await client.list_tasks(ListTasksRequest(include_artifacts=True))
    assert kept.status.state == TaskState.TASK_STATE_COMPLETED and answer(kept) == "Kept across restarts."
    assert [t.id for t in listed.tasks] == [task.id]
