"""What a person tells Ember to remember reaches the prompt's profile, whichever way they said it:
`ember memory add`, `POST /api/memory`, or asking in chat (the model's `remember` tool), with no
subject or key. Checked in the prompt the model is sent for the next question, in a new session,
through a running `ember serve` and the tests' own model server."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from ember.memory.reconcile import JUDGE_INSTRUCTION
from ember.pipeline.context import PROFILE_HEADING
from tests.gatewayproc import EMBER, GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, Reply, serving, tool_call

ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789ab"
REMEMBER_ASK = "please remember this:"


def answer(body: dict[str, Any]) -> Reply:
    """The model: asked to remember, it calls `remember` with what follows; it checks facts as
    compatible; anything else is noted."""
    messages = body["messages"]
    if JUDGE_INSTRUCTION in str(messages[0].get("content")):
        return Reply(text=json.dumps({"verdict": "compatible"}))
    last = messages[-1]
    if last["role"] == "user" and REMEMBER_ASK in str(last["content"]):
        return Reply(tool_calls=(tool_call("remember", content=str(last["content"]).split(REMEMBER_ASK)[1].strip()),))
    return Reply(text="noted.")


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        server.responder = answer
        yield server


@pytest.fixture(scope="module")
def gateway(model: ModelServer, launch_module_gateway: LaunchGateway,
            tmp_path_factory: pytest.TempPathFactory) -> GatewayProcess:
    home = tmp_path_factory.mktemp("profile") / "home"
    home.mkdir()
    (home / "ember.toml").write_text('identities = {alice = ["http:alice"]}\n')
    return launch_module_gateway(model, keys={"alice": ALICE, "bob": BOB}, home=home)


def chat(gateway: GatewayProcess, key: str, text: str) -> None:
    with openai.OpenAI(base_url=gateway.url("/v1"), api_key=key, max_retries=0, timeout=30) as sdk:
        sdk.chat.completions.create(model="ember", messages=[{"role": "user", "content": text}],
                                    extra_headers={"X-Ember-Session": f"profile-{uuid.uuid4().hex[:8]}"})


def profile_seen(gateway: GatewayProcess, model: ModelServer, key: str) -> str:
    """The profile section of the system prompt the model is sent for a question in a new session."""
    question = f"what do you know about me? ({uuid.uuid4().hex[:8]})"
    chat(gateway, key, question)
    # Found by its question: a background call (a fact's reconciliation) may have come after it.
    [asked] = [body for body in model.requests if body["messages"][-1].get("content") == question]
    system = str(asked["messages"][0]["content"])
    return system.split(PROFILE_HEADING, 1)[1] if PROFILE_HEADING in system else ""


def fact() -> str:
    return f"I am allergic to peanuts, says tag zq{uuid.uuid4().hex[:10]}."


def test_a_fact_added_on_the_command_line_is_in_the_next_prompts_profile(gateway: GatewayProcess,
                                                                         model: ModelServer) -> None:
    stated = fact()
    subprocess.run([EMBER, "memory", "add", stated, "--identity", "alice"], env=gateway.env, check=True,
                   capture_output=True, text=True, timeout=120)
    assert f"- {stated}" in profile_seen(gateway, model, ALICE)
    assert stated not in profile_seen(gateway, model, BOB)


def test_a_fact_added_over_http_is_in_the_next_prompts_profile(gateway: GatewayProcess, model: ModelServer) -> None:
    stated = fact()
    added = httpx.post(gateway.url("/api/memory"), json={"content": stated},
                       headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
    assert added.status_code == 201, added.text
    assert f"- {stated}" in profile_seen(gateway, model, ALICE)
    assert stated not in profile_seen(gateway, model, BOB)


def test_a_fact_remembered_in_chat_is_in_the_next_prompts_profile(gateway: GatewayProcess,
                                                                 model: ModelServer) -> None:
    stated = fact()
    chat(gateway, ALICE, f"{REMEMBER_ASK} {stated}")
    assert f"- {stated}" in profile_seen(gateway, model, ALICE)
    assert stated not in profile_seen(gateway, model, BOB)
